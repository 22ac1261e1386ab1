"""Views of the stack's variables per unique set and per applied layer; tied -> untied."""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models.config import ModelConfig
from sharenet.norms import PER_LAYER

Tree = Any


def block_relative(path: tuple) -> tuple:
  """The part of a stacked block leaf's path below its block (the key `unique_sets` uses)."""
  return path[path.index('block') + 1:]


def _segment_leaves(tree: Tree) -> dict[int, dict[tuple, Any]]:
  """{segment index: {path relative to the block: leaf}} for a collection's 'stack' subtree."""
  out: dict[int, dict[tuple, Any]] = {}
  for path, leaf in flatten_dict(nn.unbox(tree).get('stack', {})).items():
    seg = int(path[0].removeprefix('segment_'))
    out.setdefault(seg, {})[block_relative(path)] = leaf
  return out


def unique_sets(params: Tree, cfg: ModelConfig) -> dict[tuple, jnp.ndarray]:
  """Block params stacked over all unique sets in plan order: {path: (U, ...)}."""
  segs = _segment_leaves(params)
  paths = segs[0].keys()
  return {p: jnp.concatenate([segs[i][p] for i in range(len(cfg.plan.segments))]) for p in paths}


def applied_per_layer(per_layer: Tree, cfg: ModelConfig) -> dict[tuple, jnp.ndarray]:
  """Per-layer variables in applied-layer order: {path: (L, ...)}.

  A part a segment does not hold (LoRA on an unshared segment under lora_layers='shared')
  reads as zeros there, which is what an absent LoRA computes.
  """
  segs = _segment_leaves(per_layer)
  if not segs:
    return {}
  lead = lambda seg: 1 if seg.order == 'gather' else 2   # (R, K) cycle, (K, R) sequence
  out = {}
  for p in sorted({p for leaves in segs.values() for p in leaves}):
    i0, seg0 = next((i, s) for i, s in enumerate(cfg.plan.segments) if p in segs.get(i, {}))
    inner = segs[i0][p].shape[lead(seg0):]
    parts = []
    for i, seg in enumerate(cfg.plan.segments):
      leaf = segs.get(i, {}).get(p)
      parts.append(jnp.zeros((seg.num_applied,) + inner, segs[i0][p].dtype) if leaf is None
                   else leaf.reshape((-1,) + leaf.shape[lead(seg):]))
    out[p] = jnp.concatenate(parts)
  return out


def applied_params(params: Tree, cfg: ModelConfig) -> dict[tuple, jnp.ndarray]:
  """Each applied layer's (tied) block params: {path: (L, ...)} gathered by the plan index."""
  idx = np.asarray(cfg.plan.index)
  return {p: v[idx] for p, v in unique_sets(params, cfg).items()}


def to_untied(variables: Tree, cfg: ModelConfig) -> tuple[ModelConfig, Tree]:
  """The untied model (and its variables) computing the same function as `variables`."""
  ucfg = dataclasses.replace(cfg, scheme='untied', num_unique=0, repeats=0, pattern='',
                             lora_layers='all')   # absent LoRA parts become zeros
  variables = nn.unbox(variables)
  prefix = ('stack', 'segment_0', 'level', 'block')
  params = {k: v for k, v in flatten_dict(variables['params']).items() if k[0] != 'stack'}
  params.update({prefix + p: v for p, v in applied_params(variables['params'], cfg).items()})
  out = {'params': unflatten_dict(params)}
  if PER_LAYER in variables:
    layer = {k: v for k, v in flatten_dict(variables[PER_LAYER]).items() if k[0] != 'stack'}
    layer.update({prefix + p: v[None] for p, v in
                  applied_per_layer(variables[PER_LAYER], cfg).items()})
    out[PER_LAYER] = unflatten_dict(layer)
  return ucfg, out


def _replace_stack(tree: Tree, per_segment: dict[int, dict[tuple, Any]]) -> Tree:
  flat = dict(flatten_dict(nn.unbox(tree)))
  for path in list(flat):
    if path[0] == 'stack':
      seg = int(path[1].removeprefix('segment_'))
      flat[path] = per_segment[seg][block_relative(path)]
  return unflatten_dict(flat)


def from_unique_sets(params: Tree, sets: dict[tuple, Any], cfg: ModelConfig) -> Tree:
  """Inverse of `unique_sets`: writes {path: (U, ...)} into a params tree of `cfg`'s model."""
  per_segment = {i: {p: v[seg.first_set:seg.first_set + seg.num_sets] for p, v in sets.items()}
                 for i, seg in enumerate(cfg.plan.segments)}
  return _replace_stack(params, per_segment)


def from_applied_per_layer(per_layer: Tree, layers: dict[tuple, Any], cfg: ModelConfig) -> Tree:
  """Inverse of `applied_per_layer`: {path: (L, ...)} into a per-layer tree of `cfg`'s model."""
  template = _segment_leaves(per_layer)
  per_segment, start = {}, 0
  for i, seg in enumerate(cfg.plan.segments):
    n = seg.num_applied
    per_segment[i] = {p: v[start:start + n].reshape(template[i][p].shape)
                      for p, v in layers.items() if p in template.get(i, {})}
    start += n
  return _replace_stack(per_layer, per_segment)
