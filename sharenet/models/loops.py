"""Applied layers run one by one from the stored sets: loop-by-loop serving of looped plans.

A plan with one looped segment (a `cycle` segment applying its K stored sets R > 1 times) reads
as prelude (the applied layers before it), R loops of K layers, and coda (the layers after it):
`cycle` / `universal` have no prelude or coda, `middle_cycle` one unique layer each (Relaxed
Recursive Transformers, arXiv:2410.20672). `LayerStore` gathers what applied layer l needs from
the stored tree by the parameters' structure metadata (sharenet/params.py): the block params of
its stored set (`plan.index[l]`, gathered by index, never copied per layer) and its per-layer
parts (depth-wise LoRA, untied norms; zeros where a segment holds none, which is what an absent
LoRA computes). `run_layers` applies a contiguous, dynamically placed range of applied layers to
one token with a KV cache, so one compiled program runs any loop of any slot.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import unflatten_dict

from sharenet.errors import ConfigError
from sharenet.models import layout
from sharenet.models.attention import DecodeStep, LayerCache
from sharenet.models.block import Block, Scanned, Shared, Stream
from sharenet.models.config import ModelConfig
from sharenet.norms import PER_LAYER


class Looped(NamedTuple):
  """A plan read as prelude + R loops of K layers + coda (applied-layer counts)."""
  start: int        # first applied layer of the looped segment (= prelude layers)
  num_sets: int     # K layers per loop
  loops: int        # R
  num_layers: int   # L, all applied layers

  @property
  def coda(self) -> int:
    """First applied layer after the loops."""
    return self.start + self.num_sets * self.loops


def looped(cfg: ModelConfig) -> Looped:
  """The plan's looped segment; one ConfigError line when it has none or several."""
  segs = cfg.plan.segments
  loops = [i for i, s in enumerate(segs) if s.order == 'cycle' and s.repeats > 1]
  if len(loops) != 1:
    raise ConfigError(f'loop-by-loop serving needs exactly one looped cycle segment; '
                      f'model.sharing.scheme={cfg.sharing.scheme!r} has {len(loops)}; valid '
                      f'schemes: cycle, universal, middle_cycle, groups')
  i = loops[0]
  start = sum(s.num_applied for s in segs[:i])
  return Looped(start, segs[i].num_sets, segs[i].repeats, cfg.num_layers)


class LayerStore(NamedTuple):
  """What every applied layer reads (a pytree: jit and vmap see arrays only)."""
  sets: dict            # {block-local path: (U, ...)} stored sets
  set_of_L: jax.Array   # (L,) stored set of each applied layer
  per_layer: dict       # {block-local path: (L, ...)} per-layer parts
  atoms: Any            # MASA atoms or None


def layer_store(cfg: ModelConfig, variables: Any, atoms: Any = None) -> LayerStore:
  """The stored sets and per-layer parts of `variables` (a model of `cfg`), by metadata."""
  per_layer = variables.get(PER_LAYER)
  return LayerStore(layout.unique_sets(variables['params'], cfg),
                    jnp.asarray(np.asarray(cfg.plan.index, np.int32)),
                    {} if per_layer is None else layout.applied_per_layer(per_layer, cfg), atoms)


def _layer_variables(store: LayerStore, layer: jax.Array) -> dict:
  """Applied layer `layer`'s block variables (traced index)."""
  u = store.set_of_L[layer]
  out = {'params': unflatten_dict({p: v[u] for p, v in store.sets.items()})}
  if store.per_layer:
    out[PER_LAYER] = unflatten_dict({p: v[layer] for p, v in store.per_layer.items()})
  return out


def run_layers(cfg: ModelConfig, store: LayerStore, x_D: jax.Array, first: jax.Array,
               count: int, k_LSKD: jax.Array, v_LSKD: jax.Array, pos: jax.Array,
               key_pos_S: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Applied layers first .. first+count-1 on one token at `pos` attending to its cache.

  -> (x after them, keys (count, Kh, Dh) and values the token wrote in those layers). The
  caches are read, not written: callers commit the returned columns where a slot runs.
  """
  step = DecodeStep(pos, pos[None, None], key_pos_S[None])
  k_NSKD = jax.lax.dynamic_slice_in_dim(k_LSKD, first, count, axis=0)
  v_NSKD = jax.lax.dynamic_slice_in_dim(v_LSKD, first, count, axis=0)
  block = Block(cfg)

  def body(x_11D, inputs):
    layer, k_SKD, v_SKD = inputs
    stream, cache = block.apply(_layer_variables(store, layer), Stream(x_11D),
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
