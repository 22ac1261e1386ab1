"""Activation norms chosen by name; gains can live in the tied or the per-layer collection.

Formulas follow ../shared/reference/sharing-and-normalization.md part B:
  layernorm  gamma * (x - mean) / sqrt(var + eps) + beta            (B1; var = mean((x-mu)^2))
  rmsnorm    gamma * x / sqrt(mean(x^2) + eps)                      (B1)
  crmsnorm   gamma * z / sqrt((sum z^2 + (sum z)^2) / (n + 1) + eps) (B1; z is the compressed
             (n)-vector of a zero-mean (n+1)-vector whose last entry is -sum z)
  scalenorm  g * x / max(||x||_2, eps), one scalar g initialised to sqrt(d)        (B2)
  dyt        gamma * tanh(alpha * x) + beta, one scalar alpha (init 0.5)         (B7)
  l2         x / max(||x||_2, eps) with no gain (QK-norm of Henry et al., B3: the gain is a
             scalar in the attention logits instead)
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

PER_LAYER = 'per_layer'  # collection scanned per applied layer while 'params' may be tied
KINDS = ('layernorm', 'rmsnorm', 'crmsnorm', 'scalenorm', 'dyt', 'l2', 'none')


def variable(module: nn.Module, collection: str, name: str, init, shape, axes, dtype):
  """Creates a logically-partitioned variable in `collection` ('params' or PER_LAYER)."""
  boxed_init = nn.with_logical_partitioning(init, axes)
  if collection == 'params':
    return module.param(name, boxed_init, shape, dtype)
  return module.variable(collection, name,
                         lambda: boxed_init(module.make_rng(PER_LAYER), shape, dtype)).value


class Norm(nn.Module):
  """One activation norm over the last axis; `kind` is one of KINDS."""
  kind: str = 'rmsnorm'
  eps: float = 1e-6
  collection: str = 'params'
  axis_name: str = 'embed'
  param_dtype: jnp.dtype = jnp.float32
  dyt_alpha: float = 0.5

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if self.kind == 'none':
      return x
    if self.kind not in KINDS:
      raise ValueError(f'unknown norm {self.kind!r}; valid: {", ".join(KINDS)}')
    d = x.shape[-1]
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    bshape = (1,) * (x.ndim - 1) + (d,)

    def vec(name, init):
      return variable(self, self.collection, name, init, (d,), (self.axis_name,),
                      self.param_dtype).reshape(bshape)

    def scalar(name, value):
      return variable(self, self.collection, name, nn.initializers.constant(value), (),
                      (), self.param_dtype)

    sq = jnp.sum(jnp.square(xf), axis=-1, keepdims=True)
    if self.kind == 'l2':
      return (xf * jax.lax.rsqrt(jnp.maximum(sq, self.eps ** 2))).astype(x.dtype)
    if self.kind == 'scalenorm':
      y = scalar('g', math.sqrt(d)) * xf * jax.lax.rsqrt(jnp.maximum(sq, self.eps ** 2))
      return y.astype(x.dtype)
    if self.kind == 'dyt':
      y = jnp.tanh(scalar('alpha', self.dyt_alpha) * xf) * vec('scale', nn.initializers.ones)
      return (y + vec('bias', nn.initializers.zeros)).astype(x.dtype)
    if self.kind == 'layernorm':
      xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
      sq = jnp.sum(jnp.square(xf), axis=-1, keepdims=True)
    if self.kind == 'crmsnorm':
      total = jnp.sum(xf, axis=-1, keepdims=True)
      ms = (sq + jnp.square(total)) / (d + 1)
    else:
      ms = sq / d
    y = xf * jax.lax.rsqrt(ms + self.eps) * vec('scale', nn.initializers.ones)
    if self.kind == 'layernorm':
      y = y + vec('bias', nn.initializers.zeros)
    return y.astype(x.dtype)
