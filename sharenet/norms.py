"""Activation norms chosen by name; gains can live in the tied or the per-layer collection."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

PER_LAYER = 'per_layer'  # collection scanned per applied layer while 'params' may be tied


def variable(module: nn.Module, collection: str, name: str, init, shape, axes, dtype):
  """Creates a logically-partitioned variable in `collection` ('params' or PER_LAYER)."""
  boxed_init = nn.with_logical_partitioning(init, axes)
  if collection == 'params':
    return module.param(name, boxed_init, shape, dtype)
  return module.variable(collection, name,
                         lambda: boxed_init(module.make_rng(PER_LAYER), shape, dtype)).value


class Norm(nn.Module):
  """LayerNorm / RMSNorm over the last axis (variance computed as mean((x-mu)^2), not fast)."""
  kind: str = 'rmsnorm'
  eps: float = 1e-6
  collection: str = 'params'
  axis_name: str = 'embed'
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if self.kind == 'none':
      return x
    d = x.shape[-1]
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if self.kind == 'layernorm':
      xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
    elif self.kind != 'rmsnorm':
      raise ValueError(f'unknown norm {self.kind!r}')
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
    scale = variable(self, self.collection, 'scale', nn.initializers.ones, (d,),
                     (self.axis_name,), self.param_dtype)
    bshape = (1,) * (y.ndim - 1) + (d,)
    y = y * scale.reshape(bshape)
    if self.kind == 'layernorm':
      y = y + variable(self, self.collection, 'bias', nn.initializers.zeros, (d,),
                       (self.axis_name,), self.param_dtype).reshape(bshape)
    return y.astype(x.dtype)
