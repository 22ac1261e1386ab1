"""Post-step projections, placed last in the optax chain: updates = P(params + updates) - params.

  ngpt  every vector living in the embedding space has unit norm (nGPT's normalize_matrices,
        arXiv:2410.01131): embedding / readout rows and every Dense kernel normalised along its
        'embed' axis (reader kernels' input units, writer kernels' output units).
  nap   Normalize-and-Project (Lyle et al., arXiv:2407.01800): each matrix (each stacked set
        separately) is rescaled to its norm at initialisation, stored in the transform state.

Norm gains, biases and scalars are left alone (the NaP paper's treatment of gains is not
settled here). Under Adam a projection is not equivalent to the matching reparameterization:
Adam normalises the raw gradient, not the projected one.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.transforms.roles import MATRIX_ROLES, Leaf, unit_norm

PROJECTIONS = ('none', 'ngpt', 'nap')


def _targets(infos: dict[tuple, Leaf]) -> dict[tuple, Leaf]:
  return {p: l for p, l in infos.items() if l.role in MATRIX_ROLES and l.role != 'lora'
          and l.embed_axis() is not None}


def _matrix_norm(w: jax.Array, leaf: Leaf) -> jax.Array:
  axes = tuple(range(leaf.num_stack, w.ndim))
  return jnp.sqrt(jnp.sum(jnp.square(w), axis=axes, keepdims=True))


def project(name: str, params: Any, infos: dict[tuple, Leaf], init_norms: Any = None) -> Any:
  """Applies projection `name` to a params tree (leaves without a role are unchanged)."""
  targets = _targets(infos)
  flat = dict(flatten_dict(params))
  norms = flatten_dict(init_norms) if init_norms is not None else {}
  for path, leaf in targets.items():
    w = flat[path]
    if name == 'ngpt':
      flat[path] = unit_norm(w, leaf.embed_axis()).astype(w.dtype)
    elif name == 'nap':
      flat[path] = (w * norms[path] / jnp.maximum(_matrix_norm(w, leaf), 1e-12)).astype(w.dtype)
  return unflatten_dict(flat)


class NapState(NamedTuple):
  init_norms: Any


def projection(name: str, infos: dict[tuple, Leaf]) -> optax.GradientTransformation:
  """The optax transform for `name`; place it last in the chain."""
  targets = _targets(infos)

  def init_fn(params):
    if name != 'nap':
      return optax.EmptyState()
    flat = flatten_dict(params)
    return NapState(unflatten_dict({p: _matrix_norm(flat[p], l) for p, l in targets.items()}))

  def update_fn(updates, state, params):
    new = optax.apply_updates(params, updates)
    norms = state.init_norms if name == 'nap' else None
    projected = project(name, new, infos, norms)
    return jax.tree.map(lambda a, b: (a - b).astype(b.dtype), projected, params), state

  return optax.GradientTransformation(init_fn, update_fn)
