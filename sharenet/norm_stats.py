"""PowerNorm's functional core: running statistics passed in and out explicitly.

Shen et al., "PowerNorm: Rethinking Batch Normalization in Transformers", arXiv:2003.07845
(reference code sIncerass/powernorm, MaskPowerNorm). Per channel c, with no mean subtraction:
  group scaling   x <- x / sqrt(mean_{group}(x^2) + eps) per token (GroupScaling1D)
  batch moment    psi2_c = mean over the batch's rows of x_c^2
  forward         z = x / sqrt(v + eps), v = psi2 while step <= warmup, else the running phi
                  (its value before this step's update); y = gamma z + beta
  running phi     during warmup the cumulative mean of psi2, then always
                  phi <- a_fwd phi + (1 - a_fwd) psi2                    (`update_phi`)
  approx backward g = dy gamma;  g^ = g - (1 - a_bkw) Gamma z;  dx = g^ / sqrt(psi2 + eps)
                  (the *batch* moment: the running statistic sits in the forward without
                  being differentiated); Gamma <- Gamma + mean(g^ z) over the rows.

Gamma is written by the backward pass. JAX's VJP cannot write state, so the increment
mean(g^ z) leaves `power_norm` as the cotangent of `tap_C`, a zero input the caller
differentiates and adds to Gamma. The batch moment psi2 leaves the same way: its cotangent
is psi2 itself, so a caller that passes stop_gradient(psi2) plus a zero-valued tap reads the
step's psi2 as the tap's cotangent. `grad_scale` = N rows makes Gamma the reference's: fairseq
back-propagates the summed token loss (dy of order 1) and divides the gradients afterwards,
while sharenet's loss is the token mean (dy of order 1/N); dx is divided back.

In the model (`model.norm.kind=powernorm`, norms.Norm): each norm keeps, in the NORM_STATS
collection, `phi` (ones), `gz` (Gamma, zeros), `psi2` (the last training step's batch moment)
and `count` (training steps seen). The stack scans the collection per applied layer (like
per_layer: a tied block keeps one entry per applied layer); TrainState.tstate holds it, so it
is checkpointed and restored with the state; the norm is in training mode exactly when the
collection is mutable in the apply (step_lib.loss_fn), in eval mode otherwise (eval_loss,
generation: `power_norm_eval` with phi). train_step differentiates the loss with respect to
the collection too, and `update` turns those cotangents into the next state. Statistics are
means over the jitted global batch, so data-parallel devices see the one batch statistic.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

NORM_STATS = 'norm_stats'


def group_scale(x_NC: jax.Array, groups: int, eps: float) -> jax.Array:
  """x over the root mean square of its channel group, per row (PowerNorm's GroupScaling1D)."""
  n, c = x_NC.shape
  g = x_NC.reshape(n, groups, c // groups)
  ms = jnp.mean(jnp.square(g), axis=-1, keepdims=True)
  return (g * jax.lax.rsqrt(ms + eps)).reshape(n, c)


def batch_moment(x_NC: jax.Array) -> jax.Array:
  """psi2: the quadratic mean of each channel over the rows (the batch's statistic)."""
  return jnp.mean(jnp.square(x_NC), axis=0)


def update_phi(phi_C: jax.Array, psi2_C: jax.Array, step: jax.Array, a_fwd: float,
               warmup: int) -> jax.Array:
  """The running quadratic mean after a training step (`step` counts from 1), as the reference
  updates it: a cumulative mean during warmup, followed every step by the EMA."""
  s = jnp.asarray(step, jnp.float32)
  cumulative = phi_C * (s - 1) / s + psi2_C / s
  phi_C = jnp.where(step < warmup, cumulative, phi_C)
  return a_fwd * phi_C + (1 - a_fwd) * psi2_C


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def power_norm(x_NC, gain_C, bias_C, v_C, psi2_C, ema_gz_C, tap_C, eps, a_bkw, grad_scale=1.0):
  """gamma x / sqrt(v + eps) + beta with PowerNorm's approximate backward (module docstring);
  v is psi2 in warmup and the running phi after, psi2 the batch moment (its cotangent: psi2),
  tap_C a zero-valued input whose cotangent is Gamma's increment."""
  del psi2_C, ema_gz_C, tap_C, a_bkw, grad_scale
  return x_NC * jax.lax.rsqrt(v_C + eps)[None] * gain_C[None] + bias_C[None]


def _power_norm_fwd(x_NC, gain_C, bias_C, v_C, psi2_C, ema_gz_C, tap_C, eps, a_bkw,
                    grad_scale=1.0):
  z = x_NC * jax.lax.rsqrt(v_C + eps)[None]
  return z * gain_C[None] + bias_C[None], (z, gain_C, psi2_C, ema_gz_C)


def _power_norm_bwd(eps, a_bkw, grad_scale, res, dy_NC):
  z, gain_C, psi2_C, ema_gz_C = res
  g = dy_NC * gain_C[None] * grad_scale
  g_hat = g - (1 - a_bkw) * ema_gz_C[None] * z
  dx = g_hat * jax.lax.rsqrt(psi2_C + eps)[None] / grad_scale
  zeros = jnp.zeros_like(psi2_C)
  return (dx, jnp.sum(dy_NC * z, axis=0), jnp.sum(dy_NC, axis=0), zeros, psi2_C, zeros,
          jnp.mean(g_hat * z, axis=0))


power_norm.defvjp(_power_norm_fwd, _power_norm_bwd)


def power_norm_eval(x_NC: jax.Array, gain_C: jax.Array, bias_C: jax.Array, phi_C: jax.Array,
                    eps: float) -> jax.Array:
  """Eval mode: the running phi alone (an affine map per channel, foldable into a linear)."""
  return x_NC * jax.lax.rsqrt(phi_C + eps)[None] * gain_C[None] + bias_C[None]


def apply_power_norm(module: Any, x: jax.Array, gain_C: jax.Array, bias_C: jax.Array,
                     eps: float, a_bkw: float, warmup: int, groups: int) -> jax.Array:
  """PowerNorm over the last axis of x (..., C) inside flax `module` (norms.Norm): group
  scaling, then the training forward and approximate backward where NORM_STATS is mutable, the
  eval forward with the running phi otherwise. Creates the module's statistics."""
  c = x.shape[-1]
  var = lambda name, init: module.variable(NORM_STATS, name, init, (c,), jnp.float32).value
  phi, gz, last_psi2 = var('phi', jnp.ones), var('gz', jnp.zeros), var('psi2', jnp.zeros)
  count = module.variable(NORM_STATS, 'count', jnp.zeros, (), jnp.float32).value
  x_NC = group_scale(x.reshape(-1, c).astype(jnp.float32), groups, eps)
  if not module.is_mutable_collection(NORM_STATS):
    y = power_norm_eval(x_NC, gain_C, bias_C, phi, eps)
    return y.reshape(x.shape).astype(x.dtype)
  psi2 = jax.lax.stop_gradient(batch_moment(x_NC))
  psi2_in = psi2 + (last_psi2 - jax.lax.stop_gradient(last_psi2))   # value psi2, cotangent out
  v = jnp.where(count + 1 <= warmup, psi2, jax.lax.stop_gradient(phi))
  y = power_norm(x_NC, gain_C, bias_C, v, psi2_in, jax.lax.stop_gradient(gz), gz, eps, a_bkw,
                 float(x_NC.shape[0]))
  return y.reshape(x.shape).astype(x.dtype)


def update(stats: Any, cotangents: Any, a_fwd: float, warmup: int) -> Any:
  """The statistics after a training step, from the step's cotangents of NORM_STATS (module
  docstring): count + 1, phi by `update_phi` with the step's psi2, Gamma plus its increment,
  psi2 the step's. Works on any leading (per applied layer) axes."""
  if isinstance(stats, dict) and set(stats) == {'phi', 'gz', 'psi2', 'count'}:
    step = stats['count'] + 1
    psi2 = cotangents['psi2']
    phi = update_phi(stats['phi'], psi2, step[..., None], a_fwd, warmup)
    return {'phi': phi, 'gz': stats['gz'] + cotangents['gz'], 'psi2': psi2, 'count': step}
  return {k: update(v, cotangents[k], a_fwd, warmup) for k, v in stats.items()}


def initial_state(cfg: Any) -> dict[str, Any]:
  """{NORM_STATS: the model's statistics at init} for a statistics norm, {} otherwise."""
  from sharenet.models.sections import STATS_NORMS
  if cfg.norm.kind not in STATS_NORMS:
    return {}
  from sharenet.models.lm import DecoderLM
  from sharenet.norms import PER_LAYER
  key = jax.random.key(0)
  variables = DecoderLM(cfg).init({'params': key, PER_LAYER: key}, jnp.zeros((1, 2), jnp.int32))
  return {NORM_STATS: variables[NORM_STATS]}
