"""Leaf roles and matrix views derived from parameter paths and logical axis names.

A transform selects leaves by role (reader / writer kernels, embeddings, norm gains, ...) or by
a regex over the '/'-joined path, and views a kernel as a stack of (fan_in, fan_out) matrices:
leading scan axes ('layers', 'repeats') index separate matrices, never width.
"""
from __future__ import annotations

import dataclasses
import math
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict

from sharenet.models import DecoderLM, init_variables
from sharenet.models.lm import logical_axes

STACK_AXES = ('layers', 'repeats')
OUTPUT_NORMS = ('final_norm', 'attn_out_norm', 'mlp_out_norm')
MATRIX_ROLES = ('reader', 'writer', 'readout', 'embedding', 'pos_embed', 'lora')
ROLES = MATRIX_ROLES + ('norm_in', 'norm_out', 'bias', 'scalar', 'reparam')


def role_of(path: tuple[str, ...], axes: tuple | None = None) -> str:
  """Role of a leaf from its path (collection first) and, for kernels, its logical axes."""
  name, parent = path[-1], (path[-2] if len(path) > 1 else '')
  if path[0] == 'reparam':
    return 'reparam'
  if name == 'kernel':
    if parent == 'readout':
      return 'readout'
    return 'writer' if axes is not None and axes[-1] == 'embed' else 'reader'
  if name in ('embedding', 'pos_embed'):
    return name
  if name in ('lora_a', 'lora_b'):
    return 'lora'
  if parent.endswith('_norm'):
    return 'norm_out' if parent in OUTPUT_NORMS else 'norm_in'
  if name in ('bias', 'logits_bias'):
    return 'bias'
  return 'scalar'


@dataclasses.dataclass(frozen=True)
class Leaf:
  """A trainable leaf: path (collection first), logical axes, shape and role."""
  path: tuple[str, ...]
  axes: tuple
  shape: tuple[int, ...]
  role: str

  @property
  def key(self) -> str:
    return '/'.join(self.path)

  @property
  def num_stack(self) -> int:
    n = 0
    while n < len(self.axes) and self.axes[n] in STACK_AXES:
      n += 1
    return n

  @property
  def stack_shape(self) -> tuple[int, ...]:
    return self.shape[:self.num_stack]

  @property
  def num_in(self) -> int:
    """Input dims of a kernel after the stack dims: all but 'embed' for writers, else one."""
    rest = len(self.shape) - self.num_stack
    return rest - 1 if self.role == 'writer' else 1

  @property
  def fan_in(self) -> int:
    return math.prod(self.shape[self.num_stack:self.num_stack + self.num_in])

  @property
  def fan_out(self) -> int:
    return math.prod(self.shape[self.num_stack + self.num_in:])

  def as_matrix(self, w: jax.Array) -> jax.Array:
    """(stack..., fan_in, fan_out) view of a kernel."""
    return w.reshape(self.stack_shape + (self.fan_in, self.fan_out))

  def embed_axis(self) -> int | None:
    """Position of the 'embed' axis (the residual-stream width), if any."""
    return self.axes.index('embed') if 'embed' in self.axes else None


def leaf_infos(model: DecoderLM) -> dict[tuple[str, ...], Leaf]:
  """{path: Leaf} for every trainable leaf of `model` (from its logical-axis metadata)."""
  specs = flatten_dict(logical_axes(model))   # PartitionSpecs are leaves (not dicts)
  shapes = flatten_dict(jax.eval_shape(lambda: init_variables(model, jax.random.key(0))))
  out = {}
  for path, spec in specs.items():
    axes = tuple(spec)
    out[path] = Leaf(path, axes, tuple(shapes[path].shape), role_of(path, axes))
  return out


def unit_norm(x: jax.Array, axis, eps: float = 1e-12) -> jax.Array:
  sq = jnp.sum(jnp.square(x), axis=axis, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(sq, eps))
