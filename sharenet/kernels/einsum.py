"""einsum with a float32 result from low-precision operands: the attention scores and the logits.

A leaf of sharenet/kernels/ (the attention reference calls it) that the model re-exports as
`sharenet.models.layers.einsum_f32` (the readout's logits).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_f32(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """einsum of low-precision operands with a float32 result (float32 accumulation, no rounding
  of the output to the operands' dtype); the backward casts the float32 cotangent back to the
  operands' dtype, so both gradient matmuls run on low-precision operands as well.

  For outputs that must stay float32 under model.dtype=bfloat16 (the logits): a plain
  preferred_element_type=float32 would put float32 x bfloat16 matmuls in the backward pass.
  """
  return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)


def _einsum_f32_fwd(subscripts, a, b):
  return einsum_f32(subscripts, a, b), (a, b)


def _einsum_f32_bwd(subscripts, res, g):
  a, b = res
  _, vjp = jax.vjp(lambda a, b: jnp.einsum(subscripts, a, b), a, b)
  return vjp(g.astype(jnp.result_type(a, b)))


einsum_f32.defvjp(_einsum_f32_fwd, _einsum_f32_bwd)
