"""Update transforms that read params: unit-wise AGC (optax's) and AdamP's radial projection."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models.params import KERNEL_ROLES
from sharenet.transforms.roles import Leaf

UPDATES = ('agc', 'adamp')


def unit_axes(leaf: Leaf | None, ndim: int) -> tuple[int, ...]:
  """Axes of one unit's vector: a row of the PyTorch-layout weight, i.e. one output unit.

  PyTorch stores a Linear weight as (out, in) and a unit is a row, `x.view(x.size(0), -1)`;
  our kernels are (stack..., in..., out...), so a unit's vector runs over the fan-in axes.
  LoRA A (in..., r) and B (r, out...) are kernels too (torch Linear(in, r), Linear(r, out)).
  An embedding table (vocab, embed) and learned positions (length, embed) have PyTorch's
  nn.Embedding layout already: a unit is a row, its vector runs over 'embed'. Other leaves
  (norm gains, biases, scalars): all non-stack dims. Stack axes ('layers', 'repeats') index
  separate tensors and never belong to a unit.
  """
  if leaf is None:
    return tuple(range(ndim))
  if leaf.role in KERNEL_ROLES + ('lora',):
    return tuple(range(leaf.num_stack, leaf.num_stack + leaf.num_in))
  if leaf.role in ('embedding', 'pos_embed'):   # a factorized table: its row runs over E
    return (leaf.embed_axis() if leaf.embed_axis() is not None else ndim - 1,)
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


def _cosine(x: jax.Array, y: jax.Array, axes: tuple[int, ...], eps: float) -> jax.Array:
  """|cos(x, y)| over `axes` (torch.nn.functional.cosine_similarity with eps), kept dims."""
  nx = jnp.maximum(jnp.sqrt(jnp.sum(x * x, axes, keepdims=True)), eps)
  ny = jnp.maximum(jnp.sqrt(jnp.sum(y * y, axes, keepdims=True)), eps)
  return jnp.abs(jnp.sum(x * y, axes, keepdims=True)) / (nx * ny)


def scale_by_adamp(b1: float, b2: float, eps: float, weight_decay: float, decay_mask: Any,
                   infos: dict[tuple, Leaf], delta: float = 0.1, wd_ratio: float = 0.1
                   ) -> optax.GradientTransformation:
  """Adam direction with AdamP's projection (Heo et al., arXiv:2006.08217) and decoupled decay.

  As the authors' code (clovaai/AdamP, adamp.py `_projection`) does for every parameter with
  more than one dimension (here: more than one non-stack dimension, so kernels, LoRA factors,
  embedding tables, learned positions and the readout; not gains, biases, scalars or reparam
  gains): if max over units of |cos(grad_i, w_i)| < delta / sqrt(unit size), with units the
  per-output-channel vectors of `unit_axes` (PyTorch's x.view(x.size(0), -1)), the weight looks
  scale-invariant per channel; otherwise the whole tensor is tested with delta / sqrt(size).
  The first test that passes removes the radial part of the Adam step in its view
  (p -= w_hat <w_hat, p>, w_hat = w / (||w|| + eps)) and multiplies that tensor's weight decay
  by wd_ratio. Each stacked set ('layers', 'repeats') is tested and projected as its own tensor.
  The result still needs scale_by_learning_rate (and a sign flip) after it.
  """
  adam = optax.scale_by_adam(b1, b2, eps)

  def init_fn(params):
    return AdamPState(adam.init(params))

  def project(p, g, w, leaf):
    if leaf is None or len(w.shape) - leaf.num_stack < 2:
      return p, 1.0
    rest = tuple(range(leaf.num_stack, w.ndim))          # one tensor's axes (stack excluded)

    def test_and_project(axes):
      size = math.prod(w.shape[a] for a in axes)
      cos = _cosine(g, w, axes, eps)
      hit = jnp.max(cos, axis=rest, keepdims=True) < delta / math.sqrt(size)
      w_hat = w / (jnp.sqrt(jnp.sum(w * w, axes, keepdims=True)) + eps)
      return hit, p - w_hat * jnp.sum(w_hat * p, axes, keepdims=True)

    unit_hit, unit_proj = test_and_project(unit_axes(leaf, w.ndim))
    whole_hit, whole_proj = test_and_project(rest)
    out = jnp.where(unit_hit, unit_proj, jnp.where(whole_hit, whole_proj, p))
    ratio = jnp.where(unit_hit | whole_hit, wd_ratio, 1.0)
    return out, ratio

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
