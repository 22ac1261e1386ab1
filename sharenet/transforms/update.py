"""Update transforms that read params: unit-wise AGC (optax's) and AdamP's radial projection."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.params import KERNEL_ROLES
from sharenet.transforms.roles import Leaf

UPDATES = ('agc', 'adamp')


def unit_axes(leaf: Leaf | None, ndim: int) -> tuple[int, ...]:
  """Axes summed for one unit's norm: a kernel's fan-in dims; other leaves' non-stack dims."""
  if leaf is None:
    return tuple(range(ndim))
  if leaf.role in KERNEL_ROLES:
    return tuple(range(leaf.num_stack, leaf.num_stack + leaf.num_in))
  if leaf.role in ('embedding', 'pos_embed'):
    return (leaf.embed_axis(),)
  return tuple(range(leaf.num_stack, ndim))


def _agc_label(leaf: Leaf | None) -> str:
  if leaf is None or leaf.role == 'readout':
    return 'skip'
  return 'axes' + '_'.join(map(str, unit_axes(leaf, len(leaf.shape))))


def agc(clipping: float, eps: float, infos: dict[tuple, Leaf]) -> optax.GradientTransformation:
  """optax.adaptive_grad_clip per group of leaves sharing unit axes (a kernel's units are its
  output features, stacked sets separate). Skipped: the readout (NFNets leave the final linear
  layer unclipped, Brock et al., arXiv:2102.06171) and reparam gains."""
  groups = {lab: optax.adaptive_grad_clip(clipping, eps, axis=tuple(
      int(a) for a in lab[4:].split('_') if a)) for lab in map(_agc_label, infos.values())
      if lab != 'skip'}
  groups['skip'] = optax.identity()
  labels = lambda params: unflatten_dict(
      {p: _agc_label(infos.get(p)) for p in flatten_dict(params)})
  return optax.partition(groups, labels)


class AdamPState(NamedTuple):
  adam: Any


def scale_by_adamp(b1: float, b2: float, eps: float, weight_decay: float, decay_mask: Any,
                   infos: dict[tuple, Leaf], delta: float = 0.1, wd_ratio: float = 0.1
                   ) -> optax.GradientTransformation:
  """Adam direction with AdamP's projection (Heo et al., arXiv:2006.08217) and decoupled decay.

  For a matrix whose gradient is nearly orthogonal to the weight (max |cos| over its output
  units < delta / sqrt(fan_in), else over the whole matrix < delta / sqrt(size)), the weight
  looks scale-invariant: the radial component of the Adam step is removed (p -= w_hat <w_hat, p>
  in that view) and its weight decay is multiplied by wd_ratio. Stacked sets are separate
  matrices. The result still needs scale_by_learning_rate (and a sign flip) after it.
  """
  adam = optax.scale_by_adam(b1, b2, eps)

  def init_fn(params):
    return AdamPState(adam.init(params))

  def project(p, g, w, leaf):
    if leaf is None or leaf.role not in KERNEL_ROLES:
      return p, 1.0
    shape = w.shape
    m_w, m_g, m_p = (leaf.as_matrix(x) for x in (w, g, p))

    def cos_and_proj(axes, dim):
      wn = m_w / jnp.maximum(jnp.sqrt(jnp.sum(m_w * m_w, axes, keepdims=True)), 1e-8)
      gn = m_g / jnp.maximum(jnp.sqrt(jnp.sum(m_g * m_g, axes, keepdims=True)), 1e-8)
      cos = jnp.abs(jnp.sum(wn * gn, axes, keepdims=True))
      stack_axes = tuple(range(leaf.num_stack, m_w.ndim))
      invariant = jnp.max(cos, axis=stack_axes, keepdims=True) < delta / math.sqrt(dim)
      proj = m_p - wn * jnp.sum(wn * m_p, axes, keepdims=True)
      return invariant, proj

    unit_inv, unit_proj = cos_and_proj((-2,), leaf.fan_in)
    whole_inv, whole_proj = cos_and_proj((-2, -1), leaf.fan_in * leaf.fan_out)
    out = jnp.where(unit_inv, unit_proj, jnp.where(whole_inv, whole_proj, m_p))
    ratio = jnp.where(unit_inv | whole_inv, wd_ratio, 1.0)
    return out.reshape(shape), ratio.reshape(leaf.stack_shape + (1,) * (len(shape) -
                                                                      leaf.num_stack))

  def update_fn(grads, state, params):
    steps, adam_state = adam.update(grads, state.adam, params)
    flat_s, flat_g, flat_w = (flatten_dict(t) for t in (steps, grads, params))
    flat_m = flatten_dict(decay_mask(params) if callable(decay_mask) else decay_mask)
    out = {}
    for path, p in flat_s.items():
      p2, ratio = project(p, flat_g[path], flat_w[path], infos.get(path))
      if weight_decay and flat_m[path]:
        p2 = p2 + weight_decay * ratio * flat_w[path]
      out[path] = p2.astype(p.dtype)
    return unflatten_dict(out), AdamPState(adam_state)

  return optax.GradientTransformation(init_fn, update_fn)
