"""Loop-by-loop serving's view of a model: any applied layer's variables, gathered on demand.

`LayerStore` holds the stored sets and per-layer parts of a model, read by the parameters'
structure metadata (sharenet/models/params.py, models/layout.py), so `run_layers` can apply a traced
range of applied layers to one token (the early-exit and depth-wise batching schedulers of
sharenet/inference/loop_by_loop.py place each token's next loop at run time). The layer itself is
the
loop runner's (models/loops.py `layer_fn`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import unflatten_dict

from sharenet.models import layout
from sharenet.models.attention import DecodeStep, LayerCache
from sharenet.models.block import Scanned, Shared, Stream
from sharenet.models.config import ModelConfig
from sharenet.models.loops import layer_fn
from sharenet.models.params import PER_LAYER


class LayerStore(NamedTuple):
  """What every applied layer reads (a pytree: jit and vmap see arrays only)."""
  sets: dict            # {block-local path: (U, ...)} stored sets
  set_of_L: jax.Array   # (L,) stored set of each applied layer
  per_layer: dict       # {block-local path: (L, ...)} per-layer parts
  atoms: Any            # MASA atoms or None
  adapter: Any = None   # model.recurrence.injection=concat: the adapter's params, else None


def layer_store(cfg: ModelConfig, variables: Any, atoms: Any = None) -> LayerStore:
  """The stored sets and per-layer parts of `variables` (a model of `cfg`), by metadata."""
  per_layer = variables.get(PER_LAYER)
  return LayerStore(layout.unique_sets(variables['params'], cfg),
                    jnp.asarray(np.asarray(cfg.plan.index, np.int32)),
                    {} if per_layer is None else layout.applied_per_layer(per_layer, cfg), atoms,
                    layout.adapter(variables['params'], cfg))


def _layer_variables(store: LayerStore, layer: jax.Array) -> dict:
  """Applied layer `layer`'s block variables (traced index)."""
  u = store.set_of_L[layer]
  out = {'params': unflatten_dict({p: v[u] for p, v in store.sets.items()})}
  if store.per_layer:
    out[PER_LAYER] = unflatten_dict({p: v[layer] for p, v in store.per_layer.items()})
  return out


def _serving_cfg(cfg: ModelConfig) -> ModelConfig:
  """The schedulers vmap this per-token pass over their slots, and jax.lax.ragged_dot has a
  batching rule over its leading axis only: experts dispatch through the sort-based reference
  here (models/moe.py, the same function)."""
  experts = cfg.moe.kind != 'none' or cfg.moe.attention != 'none'
  return cfg.derive(moe={'dispatch': 'reference'}) if experts else cfg


def run_layers(cfg: ModelConfig, store: LayerStore, x_D: jax.Array, first: jax.Array,
               count: int, k_LSKD: jax.Array, v_LSKD: jax.Array, pos: jax.Array,
               key_pos_S: jax.Array, row: jax.Array | None = None,
               write: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Applied layers first .. first+count-1 on one token at `pos` attending to its cache.

  -> (x after them, keys (count, Kh, Dh) and values the token wrote in those layers). The
  caches are read, not written: callers commit the returned columns where a slot runs. `row`:
  the cache row of layer `first` (default `first`); `write` (a traced bool, default True):
  False attends to the columns the rows hold at `pos` instead of the token's own (a later
  loop under model.kv_sharing=first, its rows the first loop's) and returns those.
  """
  step = DecodeStep(pos, pos[None, None], key_pos_S[None], None if write is None else write[None])
  row = first if row is None else row
  k_NSKD = jax.lax.dynamic_slice_in_dim(k_LSKD, row, count, axis=0)
  v_NSKD = jax.lax.dynamic_slice_in_dim(v_LSKD, row, count, axis=0)
  apply = layer_fn(_serving_cfg(cfg))

  def body(x_11D, inputs):
    layer, k_SKD, v_SKD = inputs
    stream, (cache, _) = apply(_layer_variables(store, layer), Stream(x_11D),
                               Shared(None, None, step, store.atoms),
                               Scanned(LayerCache(k_SKD[None], v_SKD[None])))
    x_11D = stream.x_BTD
    column = lambda a: jax.lax.dynamic_index_in_dim(a[0], pos, axis=0, keepdims=False)
    return x_11D, (column(cache.k_BSKD), column(cache.v_BSKD))

  layers = first + jnp.arange(count)
  x_11D, (k_NKD, v_NKD) = jax.lax.scan(body, x_D[None, None], (layers, k_NSKD, v_NSKD))
  return x_11D[0, 0], k_NKD, v_NKD


def write_columns(kv_LSKD: jax.Array, first: jax.Array, pos: jax.Array, cols_NKD: jax.Array,
                  where: jax.Array) -> jax.Array:
  """The cache with layers first.. at position `pos` set to `cols_NKD` if `where`."""
  at = (first, pos, 0, 0)
  new_N1KD = cols_NKD[:, None].astype(kv_LSKD.dtype)
  old_N1KD = jax.lax.dynamic_slice(kv_LSKD, at, new_N1KD.shape)
  return jax.lax.dynamic_update_slice(kv_LSKD, jnp.where(where, new_N1KD, old_N1KD), at)
