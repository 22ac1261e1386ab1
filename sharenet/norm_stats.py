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
differentiates and adds to Gamma. Not wired into the model yet (docs/normalization.md:
the per-layer statistics collection it needs); the functions here are the forward and backward
the model will call.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def power_norm(x_NC, gain_C, bias_C, v_C, psi2_C, ema_gz_C, tap_C, eps, a_bkw):
  """gamma x / sqrt(v + eps) + beta with PowerNorm's approximate backward (module docstring);
  v is psi2 in warmup and the running phi after, psi2 the batch moment, tap_C zeros whose
  cotangent is Gamma's increment."""
  del psi2_C, ema_gz_C, tap_C, a_bkw
  return x_NC * jax.lax.rsqrt(v_C + eps)[None] * gain_C[None] + bias_C[None]


def _power_norm_fwd(x_NC, gain_C, bias_C, v_C, psi2_C, ema_gz_C, tap_C, eps, a_bkw):
  z = x_NC * jax.lax.rsqrt(v_C + eps)[None]
  return z * gain_C[None] + bias_C[None], (z, gain_C, psi2_C, ema_gz_C)


def _power_norm_bwd(eps, a_bkw, res, dy_NC):
  z, gain_C, psi2_C, ema_gz_C = res
  g = dy_NC * gain_C[None]
  g_hat = g - (1 - a_bkw) * ema_gz_C[None] * z
  dx = g_hat * jax.lax.rsqrt(psi2_C + eps)[None]
  zeros = jnp.zeros_like(psi2_C)
  return (dx, jnp.sum(dy_NC * z, axis=0), jnp.sum(dy_NC, axis=0), zeros, zeros, zeros,
          jnp.mean(g_hat * z, axis=0))


power_norm.defvjp(_power_norm_fwd, _power_norm_bwd)


def power_norm_eval(x_NC: jax.Array, gain_C: jax.Array, bias_C: jax.Array, phi_C: jax.Array,
                    eps: float) -> jax.Array:
  """Eval mode: the running phi alone (an affine map per channel, foldable into a linear)."""
  return x_NC * jax.lax.rsqrt(phi_C + eps)[None] * gain_C[None] + bias_C[None]
