"""Views of the stack's variables per unique set and per applied layer; tied -> untied.

Every view is keyed by a leaf's block-local path (`ParamInfo.local`, e.g. ('attn', 'q',
'kernel')) and placed by its structure metadata (`sets`, `layers`: sharenet/models/params.py), so
none
of them reads the stack's module names.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models.config import ModelConfig
from sharenet.models.lm import param_table
from sharenet.models.params import PER_LAYER
from sharenet.models.params import ParamInfo

Tree = Any


def _block_leaves(tree: Tree, cfg: ModelConfig, collection: str):
  """[(path in `tree`, leaf, info)] of the block leaves of one collection's tree."""
  table = param_table(cfg)
  out = []
  for path, leaf in flatten_dict(nn.unbox(tree)).items():
    info = table.get((collection,) + path)
    if info is not None and info.in_block:
      out.append((path, leaf, info))
  return out


def _entries(leaf, info: ParamInfo):
  """The leaf with its set / layer axes flattened into one leading axis."""
  n = info.num_layer_axes
  return leaf.reshape((-1,) + leaf.shape[n:]) if n else leaf[None]


def adapter(params: Tree, cfg: ModelConfig) -> Tree | None:
  """The injection adapter's params ({'kernel': (2D, D)}: its input axis is 'inject',
  models/recurrence.py), or None when the model has none."""
  table = param_table(cfg)
  found = {path[-1]: leaf for path, leaf in flatten_dict(nn.unbox(params)).items()
           if 'inject' in table[('params',) + path].axes}
  return found or None


def unique_sets(params: Tree, cfg: ModelConfig) -> dict[tuple, jnp.ndarray]:
  """Block params stacked over all unique sets in set order: {local path: (U, ...)}."""
  parts: dict[tuple, list] = {}
  for _, leaf, info in _block_leaves(params, cfg, 'params'):
    parts.setdefault(info.local, []).append((info.sets, _entries(leaf, info)))
  out = {}
  for local, pieces in parts.items():
    pieces.sort(key=lambda p: p[0][0])
    out[local] = jnp.concatenate([v for _, v in pieces])
  return out


def applied_per_layer(per_layer: Tree, cfg: ModelConfig) -> dict[tuple, jnp.ndarray]:
  """Per-layer variables in applied-layer order: {local path: (L, ...)}.

  A part a segment does not hold (LoRA on an unshared segment under lora_layers='shared')
  reads as zeros there, which is what an absent LoRA computes.
  """
  out = {}
  for _, leaf, info in _block_leaves(per_layer, cfg, PER_LAYER):
    entries = _entries(leaf, info)
    if info.local not in out:
      out[info.local] = jnp.zeros((cfg.num_layers,) + entries.shape[1:], entries.dtype)
    out[info.local] = out[info.local].at[np.asarray(info.layers)].set(entries)
  return out


def applied_params(params: Tree, cfg: ModelConfig) -> dict[tuple, jnp.ndarray]:
  """Each applied layer's (tied) block params: {local path: (L, ...)} gathered by the plan."""
  idx = np.asarray(cfg.plan.index)
  return {p: v[idx] for p, v in unique_sets(params, cfg).items()}


def _replace(tree: Tree, cfg: ModelConfig, collection: str, value_of) -> Tree:
  """`tree` with each block leaf replaced by value_of(info) reshaped to the leaf's shape."""
  flat = dict(flatten_dict(nn.unbox(tree)))
  for path, leaf, info in _block_leaves(tree, cfg, collection):
    value = value_of(info)
    if value is not None:
      flat[path] = jnp.reshape(value, leaf.shape).astype(leaf.dtype)
  return unflatten_dict(flat)


def from_unique_sets(params: Tree, sets: dict[tuple, Any], cfg: ModelConfig) -> Tree:
  """Inverse of `unique_sets`: writes {local path: (U, ...)} into a params tree of `cfg`."""
  return _replace(params, cfg, 'params', lambda i: None if i.local not in sets
                  else jnp.asarray(sets[i.local])[np.asarray(i.sets)])


def from_applied_per_layer(per_layer: Tree, layers: dict[tuple, Any], cfg: ModelConfig) -> Tree:
  """Inverse of `applied_per_layer`: {local path: (L, ...)} into a per-layer tree of `cfg`."""
  return _replace(per_layer, cfg, PER_LAYER, lambda i: None if i.local not in layers
                  else jnp.asarray(layers[i.local])[np.asarray(i.layers)])


def untied_config(cfg: ModelConfig) -> ModelConfig:
  """The untied model of `cfg`'s applied depth (absent LoRA parts become zeros)."""
  return cfg.derive(scan_layers=True, sharing={'scheme': 'untied', 'num_unique': 0,
                                               'repeats': 0, 'pattern': '', 'lora_layers': 'all'})


def to_untied(variables: Tree, cfg: ModelConfig) -> tuple[ModelConfig, Tree]:
  """The untied model (and its variables) computing the same function as `variables`."""
  ucfg = untied_config(cfg)
  variables = nn.unbox(variables)
  table = param_table(ucfg)
  keep = lambda c: {p: v for p, v in flatten_dict(variables[c]).items()
                    if not param_table(cfg)[(c,) + p].in_block}
  out = {}
  for c, view in (('params', applied_params), (PER_LAYER, applied_per_layer)):
    if c not in variables and not any(p[0] == c for p in table):
      continue
    applied = view(variables.get(c, {}), cfg)
    flat = keep(c) if c in variables else {}
    for path, info in table.items():
      if path[0] == c and info.in_block:
        flat[path[1:]] = jnp.reshape(applied[info.local], info.shape)
    out[c] = unflatten_dict(flat)
  return ucfg, out
