"""u-muP's unit-scaled ops (Blake et al., arXiv:2407.17465): separate forward / backward scales.

Reference: graphcore-research/unit-scaling (unit_scaling/scale.py, functional.py,
core/functional.py). Scales are parameter-free scalars; the backward scale of an op is not the
derivative of its forward scale (unit scaling's convention), hence the custom VJP.

The attention scale uses the sequence length of the call, as the reference does: a model trained
at length T evaluates at another length with another scale (no decoding path uses it today).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


@jax.custom_vjp
def scale(x: jax.Array, fwd: jax.Array, bwd: jax.Array) -> jax.Array:
  """x * fwd in the forward pass; the incoming gradient times bwd in the backward pass."""
  return x * fwd.astype(x.dtype)


def _scale_fwd(x, fwd, bwd):
  return x * fwd.astype(x.dtype), (fwd, bwd)


def _scale_bwd(res, g):
  fwd, bwd = res
  return g * bwd.astype(g.dtype), jnp.zeros_like(fwd), jnp.zeros_like(bwd)


scale.defvjp(_scale_fwd, _scale_bwd)


def scale_fwd(x: jax.Array, s) -> jax.Array:
  """Forward x * s, gradient passed through unscaled (unit_scaling.scale.scale_fwd)."""
  return scale(x, jnp.asarray(s, jnp.float32), jnp.ones((), jnp.float32))


def scale_bwd(x: jax.Array, s) -> jax.Array:
  """Forward x, gradient times s (unit_scaling.scale.scale_bwd)."""
  return scale(x, jnp.ones((), jnp.float32), jnp.asarray(s, jnp.float32))


def residual_alphas(residual_mult: float = 1.0, residual_attn_ratio: float = 1.0
                    ) -> tuple[float, float]:
  """(alpha_attn, alpha_mlp) of u-muP's transformer residual rule (paper Appendix G;
  unit_scaling.core.functional.transformer_residual_scaling_rule): attention branches contribute
  residual_attn_ratio^2 times the variance of MLP branches, and their average contribution over
  the stack is residual_mult^2 times the embedding's."""
  alpha_mlp = residual_mult * (2.0 / (1.0 + residual_attn_ratio ** 2)) ** 0.5
  return residual_attn_ratio * alpha_mlp, alpha_mlp


def residual_tau(index, num_layers: int, alphas: tuple[float, float]):
  """tau of residual branch `index` (attention 2l, MLP 2l+1 of applied layer l) in a stack of
  `num_layers` applied layers: alpha_i / sqrt(L + sum of alpha_j^2 over the branches j < i).

  The embedding counts as variance L (the reference's `layers / 2` with layers = 2L branches).
  Python ints give a float (tables, tests); a traced int scalar (the scanned stack) an array.
  """
  a_attn, a_mlp = alphas
  n_attn, n_mlp = (index + 1) // 2, index // 2
  if isinstance(index, int):
    alpha = a_attn if index % 2 == 0 else a_mlp
    return alpha / math.sqrt(num_layers + n_attn * a_attn ** 2 + n_mlp * a_mlp ** 2)
  alpha = jnp.where(index % 2 == 0, a_attn, a_mlp).astype(jnp.float32)
  f32 = jnp.float32
  var = num_layers + n_attn.astype(f32) * a_attn ** 2 + n_mlp.astype(f32) * a_mlp ** 2
  return alpha * jax.lax.rsqrt(var)


def residual_apply(fn, x: jax.Array, tau) -> jax.Array:
  """u-muP's residual_split -> fn -> residual_add: forward (x + tau fn(x)) / sqrt(1 + tau^2);
  backward: the branch input's gradient x tau / sqrt(1 + tau^2), the skip's x 1 / sqrt(1 +
  tau^2), and the branch output's and skip's forward scales not differentiated."""
  denom = jnp.sqrt(1.0 + jnp.square(jnp.asarray(tau, jnp.float32)))
  r = tau / denom
  out = scale_fwd(fn(scale_bwd(x, r)), r)
  return out + scale_fwd(scale_bwd(x, 1.0 / denom), 1.0 / denom)


def attention_output_scale(seq_len: int, head_dim: int, mult: float = 1.0,
                           causal: bool = True) -> float:
  """u-muP's empirical output scale of softmax attention with logit scale mult / head_dim
  (unit_scaling.functional.scaled_dot_product_attention, no dropout): 1 / sigma, sigma
  log-interpolated between the flat-softmax limit sqrt(ln(T)/T) (causal; sqrt(1/T) otherwise)
  and the one-hot limit 1 with weight 1 / (1 + 4 head_dim / mult^2). T = 1: 1 (the output is v)."""
  if seq_len < 2:
    return 1.0
  alpha = 1.0 / (1.0 + 4.0 * head_dim / mult ** 2)
  lower = ((math.log(seq_len) if causal else 1.0) / seq_len) ** 0.5
  return 1.0 / _log_interp(alpha, lower, 1.0)


def _log_interp(alpha: float, lower: float, upper: float) -> float:
  """exp(alpha ln upper + (1 - alpha) ln lower) (unit_scaling.core.functional)."""
  return math.exp(alpha * math.log(upper) + (1.0 - alpha) * math.log(lower))


# u-muP's empirical scales of the MLP nonlinearities at mult = 1 (unit_scaling.functional.gelu and
# silu_glu; the constraint ties the input-gradient scale to the output scale).
GELU_SCALE = _log_interp(1.0 / (1.0 + 0.25), 2.0, (2.0 / (1.0 - 1.0 / math.pi)) ** 0.5)
SILU_GLU_SCALE = _log_interp(0.5, 2.0, 2.0 ** 0.5)


def gelu(x: jax.Array) -> jax.Array:
  """Unit-scaled GELU: gradient into x and the output both x GELU_SCALE."""
  return scale_fwd(jax.nn.gelu(scale_bwd(x, GELU_SCALE)), GELU_SCALE)


def silu_glu(up: jax.Array, gate: jax.Array) -> jax.Array:
  """Unit-scaled up * silu(gate): gradients into both inputs and the output x SILU_GLU_SCALE."""
  up, gate = scale_bwd(up, SILU_GLU_SCALE), scale_bwd(gate, SILU_GLU_SCALE)
  return scale_fwd(up * jax.nn.silu(gate), SILU_GLU_SCALE)


def loss_grad_scale(vocab_size: int) -> float:
  """u-muP cross entropy's backward scale on the logits (unit_scaling.functional.cross_entropy):
  vocab / sqrt(vocab - 1) makes the per-token gradient softmax - onehot unit RMS at uniform
  logits."""
  return vocab_size / math.sqrt(vocab_size - 1)
