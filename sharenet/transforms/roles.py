"""Leaves as transforms see them: rows of the model's role table (sharenet/models/params.py).

A transform selects leaves by role (reader / writer kernels, embeddings, norm gains, ...) or by
a regex over the '/'-joined path, and views a kernel as a stack of (fan_in, fan_out) matrices:
leading scan axes ('layers', 'repeats') index separate matrices, never width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sharenet.models import DecoderLM, param_table
from sharenet.models.params import KERNEL_ROLES, MATRIX_ROLES, ROLES, STACK_AXES, ParamInfo

Leaf = ParamInfo
__all__ = ['KERNEL_ROLES', 'MATRIX_ROLES', 'ROLES', 'STACK_AXES', 'Leaf', 'leaf_infos',
           'unit_norm']


def leaf_infos(model: DecoderLM) -> dict[tuple[str, ...], Leaf]:
  """{path: Leaf} for every trainable leaf of `model` (its role table)."""
  return dict(param_table(model.cfg))


def unit_norm(x: jax.Array, axis, eps: float = 1e-12) -> jax.Array:
  sq = jnp.sum(jnp.square(x), axis=axis, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(sq, eps))
