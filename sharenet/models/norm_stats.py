"""Statistics norms: state carried across training steps, read back from cotangents.

`model.norm.kind` = powernorm | unified_norm | online_norm (norms.Norm calls `APPLY[kind]`).
Each norm keeps its statistics in the NORM_STATS collection. The stack scans the collection per
applied layer (like per_layer: a tied block keeps one entry per applied layer);
TrainState.tstate holds it, so it is checkpointed and restored with the state. A norm is in
training mode exactly when the collection is mutable in the apply (trainer.loss_fn), in eval
mode otherwise (eval_loss, generation). JAX functions cannot write state, so whatever a step
changes leaves the differentiated forward as a cotangent: train_step differentiates the loss
with respect to the collection too, and `update` turns those cotangents into the next
statistics. Statistics are means (or scans) over the jitted global batch, so data-parallel
devices see one device's statistic. The backward statistics are taken at the summed token
loss's scale (`grad_scale` = the rows' count), as the references back-propagate it, so the
state equals theirs while sharenet's loss is the token mean; dx is divided back.

PowerNorm: Shen et al., "PowerNorm: Rethinking Batch Normalization in Transformers",
arXiv:2003.07845
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

Gamma's increment mean(g^ z) leaves `power_norm` as the cotangent of `tap_C` (Gamma passed a
second time); the batch moment's cotangent is psi2 itself, so a caller that passes
stop_gradient(psi2) plus a zero-valued tap of the last psi2 reads this step's. Its state:
`phi` (ones), `gz` (Gamma, zeros), `psi2` (the last training step's batch moment), `count`.
Unified Norm and Online Norm: their sections below.
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
                     eps: float, n: Any) -> jax.Array:
  """PowerNorm over the last axis of x (..., C) inside flax `module` (norms.Norm), with the
  options of NormConfig `n`: group scaling, then the training forward and approximate backward
  where NORM_STATS is mutable, the eval forward with the running phi otherwise. Creates the
  module's statistics."""
  c = x.shape[-1]
  var = lambda name, init: module.variable(NORM_STATS, name, init, (c,), jnp.float32).value
  phi, gz, last_psi2 = var('phi', jnp.ones), var('gz', jnp.zeros), var('psi2', jnp.zeros)
  count = module.variable(NORM_STATS, 'count', jnp.zeros, (), jnp.float32).value
  x_NC = group_scale(x.reshape(-1, c).astype(jnp.float32), n.groups, eps)
  if not module.is_mutable_collection(NORM_STATS):
    y = power_norm_eval(x_NC, gain_C, bias_C, phi, eps)
    return y.reshape(x.shape).astype(x.dtype)
  psi2 = jax.lax.stop_gradient(batch_moment(x_NC))
  v = jnp.where(count + 1 <= n.stats_warmup, psi2, jax.lax.stop_gradient(phi))
  y = power_norm(x_NC, gain_C, bias_C, v, psi2 + _tap(last_psi2), jax.lax.stop_gradient(gz), gz,
                 eps, n.stats_grad_momentum, float(x_NC.shape[0]))
  return y.reshape(x.shape).astype(x.dtype)


def _tap(leaf: jax.Array) -> jax.Array:
  """Zero in value, so that `value + _tap(leaf)` is `value` and its cotangent reaches `leaf`."""
  return leaf - jax.lax.stop_gradient(leaf)


def _power_norm_update(stats: dict, cot: dict, n: Any) -> dict:
  step = stats['count'] + 1
  psi2 = cot['psi2']
  phi = update_phi(stats['phi'], psi2, step[..., None], n.stats_momentum, n.stats_warmup)
  return {'phi': phi, 'gz': stats['gz'] + cot['gz'], 'psi2': psi2, 'count': step}


# ------------------------------------------------------------------------------ Unified Norm
#
# Yang et al., "Unified Normalization for Accelerating and Stabilizing Transformers",
# arXiv:2208.01313, as its reference code (hikvision-research/Unified-Normalization, UN1d and
# UN2dFunction) computes it. Per channel, at training step t (counting from 1), window M:
#   x2        the batch's quadratic mean of x (no mean subtraction)
#   window    buffer_x2[t % M] <- x2; with the outlier filter (after warmup), when the
#             window's arithmetic mean exceeds its geometric mean by more than M times the
#             variance of sqrt(buffer) (taken before the write) in any channel, the slot takes
#             the running statistic instead and the step is skipped (batch statistics only)
#   v         x2 while t <= M, t < warmup or skipped, else the window's geometric mean
#   r         sqrt(v + eps) / sqrt(running_var + eps) clipped to [1/5, 5]; 1 while
#             t <= max(1000, warmup) or skipped (gradient compensation)
#   forward   z = x / sqrt(v + eps), y = gamma z + beta; running_var <- m rv + (1 - m) v
#   backward  g = dy gamma r; gz = mean(g z); buffer_gz[t % M] <- gz (ema_gz if skipped);
#             mean_gz = gz while t <= M, t < warmup or skipped, else the window's mean;
#             ema_gz <- m ema_gz + (1 - m) mean_gz; dx = (g - c z) / sqrt(v + eps) with
#             c = ema_gz (mean_gz if skipped); d gamma = sum(dy r z), d beta = sum(dy)
#   eval      y = gamma x / sqrt(running_var + eps) + beta (foldable into the next linear map)
# As for PowerNorm, gz is taken at the summed loss's scale (x the rows' count) and dx divided
# back; x2 and gz leave the differentiated forward as the cotangents of taps.

COMPENSATION_START = 1000   # the reference's hard-coded start of the gradient compensation


def _un_forward_state(st: dict, x2: jax.Array, t: jax.Array, n: Any, eps: float):
  """(v, r, skipped, {'buffer_x2', 'running_var'} after this step) from the state `st`."""
  buf, rv = st['buffer_x2'], st['running_var']
  M = buf.shape[-2]
  slot = jax.nn.one_hot(jnp.mod(t, M).astype(jnp.int32), M)[..., :, None]   # (..., M, 1)
  recorded = jnp.var(jnp.sqrt(buf), axis=(-2, -1), ddof=1)[..., None] if M > 1 else 0.0
  buf = buf * (1 - slot) + x2[..., None, :] * slot
  skip = jnp.full(t.shape, M <= 1)
  log_mean = lambda b: jnp.mean(jnp.log(jnp.maximum(b, 1e-30)), axis=-2)
  if n.outlier_filter and M > 1:
    am, gm = jnp.mean(buf, axis=-2), jnp.exp(log_mean(buf))
    out = (t >= n.stats_warmup) & jnp.any(am - gm > recorded * M, axis=-1)
    buf = jnp.where(out[..., None, None], buf * (1 - slot) + rv[..., None, :] * slot, buf)
    skip = skip | out
  batch = ((t <= M) | (t < n.stats_warmup) | skip)[..., None]
  v = jnp.where(batch, x2, jnp.exp(log_mean(buf)))
  early = ((t <= max(COMPENSATION_START, n.stats_warmup)) | skip)[..., None]
  r = jnp.where(early, 1.0, jnp.clip(jnp.sqrt(v + eps) / jnp.sqrt(rv + eps), 0.2, 5.0))
  m = n.stats_momentum
  return v, r, skip, {'buffer_x2': buf, 'running_var': m * rv + (1 - m) * v}


def _un_backward_state(st: dict, gz: jax.Array, t: jax.Array, skip: jax.Array, n: Any):
  """(the backward's correction coefficient, {'buffer_gz', 'ema_gz'} after this step)."""
  buf, ema = st['buffer_gz'], st['ema_gz']
  M = buf.shape[-2]
  slot = jax.nn.one_hot(jnp.mod(t, M).astype(jnp.int32), M)[..., :, None]
  written = jnp.where(skip[..., None], ema, gz)
  buf = buf * (1 - slot) + written[..., None, :] * slot
  current = ((t <= M) | (t < n.stats_warmup) | skip)[..., None]
  mean_gz = jnp.where(current, gz, jnp.mean(buf, axis=-2))
  m = n.stats_momentum
  ema = m * ema + (1 - m) * mean_gz
  return jnp.where(skip[..., None], mean_gz, ema), {'buffer_gz': buf, 'ema_gz': ema}


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def unified_norm(x_NC, gain_C, bias_C, x2_C, bwd_state, gz_tap_C, n, eps, grad_scale):
  """Unified Norm's training forward (v, r from `bwd_state`['v'], ['r']) with its approximate
  backward; x2_C's cotangent is x2 itself, gz_tap_C's the step's gz."""
  del x2_C, gz_tap_C, n, grad_scale
  z = x_NC * jax.lax.rsqrt(bwd_state['v'] + eps)[None]
  return z * gain_C[None] + bias_C[None]


def _unified_norm_fwd(x_NC, gain_C, bias_C, x2_C, bwd_state, gz_tap_C, n, eps, grad_scale):
  z = x_NC * jax.lax.rsqrt(bwd_state['v'] + eps)[None]
  return z * gain_C[None] + bias_C[None], (z, gain_C, x2_C, bwd_state)


def _unified_norm_bwd(n, eps, grad_scale, res, dy_NC):
  z, gain_C, x2_C, st = res
  r = st['r']
  g = dy_NC * (gain_C * r)[None] * grad_scale
  gz = jnp.mean(g * z, axis=0)
  coef, _ = _un_backward_state(st, gz, st['t'], st['skip'] > 0.5, n)
  dx = (g - coef[None] * z) * jax.lax.rsqrt(st['v'] + eps)[None] / grad_scale
  zeros = jax.tree.map(jnp.zeros_like, st)
  return (dx, jnp.sum(dy_NC * r[None] * z, axis=0), jnp.sum(dy_NC, axis=0), x2_C, zeros, gz)


unified_norm.defvjp(_unified_norm_fwd, _unified_norm_bwd)

UN_FIELDS = ('running_var', 'ema_gz', 'buffer_x2', 'buffer_gz', 'x2', 'gz', 'count', 'skips')


def apply_unified_norm(module: Any, x: jax.Array, gain_C: jax.Array, bias_C: jax.Array,
                       eps: float, n: Any) -> jax.Array:
  """Unified Norm over the last axis of x (..., C) inside flax `module` (norms.Norm): training
  mode where NORM_STATS is mutable, eval mode (the running statistic) otherwise."""
  c, M = x.shape[-1], n.stats_window
  v = lambda name, init, shape: module.variable(NORM_STATS, name, init, shape, jnp.float32).value
  st = {'running_var': v('running_var', jnp.ones, (c,)), 'ema_gz': v('ema_gz', jnp.zeros, (c,)),
        'buffer_x2': v('buffer_x2', jnp.zeros, (M, c)),
        'buffer_gz': v('buffer_gz', jnp.zeros, (M, c)), 'x2': v('x2', jnp.zeros, (c,)),
        'gz': v('gz', jnp.zeros, (c,)), 'count': v('count', jnp.zeros, ()),
        'skips': v('skips', jnp.zeros, ())}
  x_NC = x.reshape(-1, c).astype(jnp.float32)
  if not module.is_mutable_collection(NORM_STATS):
    y = power_norm_eval(x_NC, gain_C, bias_C, st['running_var'], eps)
    return y.reshape(x.shape).astype(x.dtype)
  st = jax.lax.stop_gradient({k: st[k] for k in UN_FIELDS if k not in ('x2', 'gz')})
  x2 = jax.lax.stop_gradient(batch_moment(x_NC))
  t = st['count'] + 1
  var, r, skip, _ = _un_forward_state(st, x2, t, n, eps)
  bwd = {'v': var, 'r': r, 't': t, 'skip': skip.astype(jnp.float32),
         'buffer_gz': st['buffer_gz'], 'ema_gz': st['ema_gz']}
  y = unified_norm(x_NC, gain_C, bias_C, x2 + _tap(module.get_variable(NORM_STATS, 'x2')), bwd,
                   module.get_variable(NORM_STATS, 'gz'), n, eps, float(x_NC.shape[0]))
  return y.reshape(x.shape).astype(x.dtype)


def _unified_norm_update(stats: dict, cot: dict, n: Any, eps: float) -> dict:
  t = stats['count'] + 1
  _, _, skip, fwd = _un_forward_state(stats, cot['x2'], t, n, eps)
  _, bwd = _un_backward_state(stats, cot['gz'], t, skip, n)
  return {**fwd, **bwd, 'x2': cot['x2'], 'gz': cot['gz'], 'count': t,
          'skips': stats['skips'] + skip.astype(jnp.float32)}


# ----------------------------------------------------------------------------- Online Norm
#
# Chiley et al., "Online Normalization for Training Neural Networks", arXiv:1905.05894, as its
# reference code (Cerebras/online-normalization, numpy_on/online_norm_1d.py) computes it: the
# rows (tokens, batch-major) are a stream, each normalised by the per-channel statistics of the
# rows before it, which continue across steps:
#   forward   y_t = (x_t - mu_{t-1}) / sqrt(var_{t-1} + eps);
#             var_t = a var_{t-1} + a (1 - a) (x_t - mu_{t-1})^2; mu_t = a mu_{t-1} + (1 - a) x_t
#   backward  (control processes u, v, also continued across steps)
#             g~_t = g_t - (1 - b) v_{t-1} y_t;  v_t = v_{t-1} + g~_t y_t;
#             dx_t = g~_t / sqrt(var_{t-1} + eps) - (1 - b) u_{t-1};  u_t = u_{t-1} + dx_t
#   then gamma y + beta and the error-checking mechanism: activation clamping to +-5 ('ac', the
#   reference's default) or layer scaling ('ls')
#   eval      (x - mu) / sqrt(var + eps) with the last statistics
# Every recurrence is first-order linear, so each runs as one associative scan over the rows.
# The statistics after the step leave as the cotangents of the statistics themselves; g is
# taken at the summed loss's scale (x the rows' count), as for PowerNorm.

def _linear_scan(a_NC: jax.Array, b_NC: jax.Array, h_C: jax.Array) -> jax.Array:
  """h_t = a_t h_{t-1} + b_t for t = 1..N from h_0 = h_C, all at once: (N, C)."""
  combine = lambda p, q: (q[0] * p[0], q[0] * p[1] + q[1])
  a, b = jax.lax.associative_scan(combine, (a_NC, b_NC))
  return a * h_C[None] + b


def _shifted(h0_C: jax.Array, h_NC: jax.Array) -> jax.Array:
  """(h_0, ..., h_{N-1}): each row's value before it."""
  return jnp.concatenate([h0_C[None], h_NC[:-1]], axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def online_norm(x_NC, mean_C, var_C, u_C, v_C, a_fwd, a_bkw, eps, grad_scale):
  """Online Normalization's forward over the stream of rows (above); the cotangents of mean,
  var, u and v are their values after the rows."""
  return _online_forward(x_NC, mean_C, var_C, a_fwd, eps)[0]


def _online_forward(x_NC, mean_C, var_C, a_fwd, eps):
  a = jnp.full_like(x_NC, a_fwd)
  mu = _linear_scan(a, (1 - a_fwd) * x_NC, mean_C)
  mu_prev = _shifted(mean_C, mu)
  var = _linear_scan(a, a_fwd * (1 - a_fwd) * jnp.square(x_NC - mu_prev), var_C)
  scale = jnp.sqrt(_shifted(var_C, var) + eps)
  return (x_NC - mu_prev) / scale, scale, mu[-1], var[-1]


def _online_norm_fwd(x_NC, mean_C, var_C, u_C, v_C, a_fwd, a_bkw, eps, grad_scale):
  y, scale, mean_N, var_N = _online_forward(x_NC, mean_C, var_C, a_fwd, eps)
  return y, (y, scale, mean_N, var_N, u_C, v_C)


def _online_norm_bwd(a_fwd, a_bkw, eps, grad_scale, res, dy_NC):
  y, scale, mean_N, var_N, u_C, v_C = res
  g = dy_NC * grad_scale
  v = _linear_scan(1 - (1 - a_bkw) * jnp.square(y), g * y, v_C)
  g_ctrl = (g - (1 - a_bkw) * _shifted(v_C, v) * y) / scale
  u = _linear_scan(jnp.full_like(g, a_bkw), g_ctrl, u_C)
  dx = g_ctrl - (1 - a_bkw) * _shifted(u_C, u)
  return dx / grad_scale, mean_N, var_N, u[-1], v[-1]


online_norm.defvjp(_online_norm_fwd, _online_norm_bwd)

ONLINE_FIELDS = ('mean', 'var', 'u', 'v', 'count')


def apply_online_norm(module: Any, x: jax.Array, gain_C: jax.Array, bias_C: jax.Array,
                      eps: float, n: Any) -> jax.Array:
  """Online Normalization over the last axis of x (..., C) inside flax `module` (norms.Norm):
  the rows in order (batch-major) in training mode, the last statistics in eval mode; then
  gamma, beta and the error-checking mechanism (n.online_ecm)."""
  c = x.shape[-1]
  v = lambda name, init: module.variable(NORM_STATS, name, init, (c,), jnp.float32).value
  st = {'mean': v('mean', jnp.zeros), 'var': v('var', jnp.ones), 'u': v('u', jnp.zeros),
        'v': v('v', jnp.zeros)}
  module.variable(NORM_STATS, 'count', jnp.zeros, (), jnp.float32)
  x_NC = x.reshape(-1, c).astype(jnp.float32)
  if module.is_mutable_collection(NORM_STATS):
    y = online_norm(x_NC, st['mean'], st['var'], st['u'], st['v'], n.stats_momentum,
                    n.stats_grad_momentum, eps, float(x_NC.shape[0]))
  else:
    y = (x_NC - st['mean'][None]) * jax.lax.rsqrt(st['var'] + eps)[None]
  y = y * gain_C[None] + bias_C[None]
  if n.online_ecm == 'ac':
    y = jnp.clip(y, -ONLINE_CLAMP, ONLINE_CLAMP)
  elif n.online_ecm == 'ls':
    y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + eps)
  return y.reshape(x.shape).astype(x.dtype)


ONLINE_CLAMP = 5.0   # the reference's activation clamp


def _online_norm_update(stats: dict, cot: dict) -> dict:
  return {'mean': cot['mean'], 'var': cot['var'], 'u': cot['u'], 'v': cot['v'],
          'count': stats['count'] + 1}


APPLY = {'powernorm': apply_power_norm, 'unified_norm': apply_unified_norm,
         'online_norm': apply_online_norm}


def update(stats: Any, cotangents: Any, n: Any) -> Any:
  """The statistics after a training step, from the step's cotangents of NORM_STATS (module
  docstring), with the options of NormConfig `n`. Works on any leading (per applied layer)
  axes."""
  if isinstance(stats, dict) and set(stats) == {'phi', 'gz', 'psi2', 'count'}:
    return _power_norm_update(stats, cotangents, n)
  if isinstance(stats, dict) and set(stats) == set(UN_FIELDS):
    return _unified_norm_update(stats, cotangents, n, n.eps)
  if isinstance(stats, dict) and set(stats) == set(ONLINE_FIELDS):
    return _online_norm_update(stats, cotangents)
  return {k: update(v, cotangents[k], n) for k, v in stats.items()}
