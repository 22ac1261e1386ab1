"""Causal self-attention in parts: projections, the position step and one attention core.

  projections  models/projections.py: q, k, v with projection sharing (model.attention_sharing),
               depth-wise LoRA and MASA atoms, and the output projection o; under
               model.moe.attention=switchhead the value and output projections are experts
               (models/switchhead.py) and the KV cache holds the experts' values.
  positions    models/positions.py: QK-norm, then RoPE at the tokens' positions.
  core         sharenet/kernels/attention.py `attention`, on the back-end model.attention /
               model.kernels pick: training (causal over the call's T tokens, optional segment
               ids) and cached decoding (the new queries against the whole KV cache, masked by
               position) go through the same entry.
This module joins them: the logit scale (1/sqrt(Dh), model.attn_scale, or the l2 QK-norm's learned
qk_scale), u-muP's unit scaling around the core, and the KV cache of generation. Multi-head or
grouped-query; the parameters are this module's: q, k, v, o, q_norm, k_norm, qk_scale.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet import kernels
from sharenet.kernels import attention as attention_kernel
from sharenet.models import switchhead, unit_scale
from sharenet.models.config import ModelConfig
from sharenet.models.layers import INTERMEDIATES, sow_l1
from sharenet.models.positions import PositionStep
from sharenet.models.projections import BRANCH, Projected, project_out, project_qkv
from sharenet.models.params import param

__all__ = ['BRANCH', 'CausalAttention', 'DecodeStep', 'LayerCache']


class DecodeStep(NamedTuple):
  """What every applied layer of one cached forward pass shares (broadcast across the scans).

  The new tokens are written to cache slots [index, index + T). Positions are per sequence, so
  left-padded prompts of different lengths decode together: `positions_BT` are the new tokens'
  absolute positions (padding: 0; only its keys are masked), `key_positions_BS` the position of
  every cache slot after the write (-1: empty or padding). A query attends to the keys whose
  position is in [0, its own position].
  """
  index: jax.Array              # () int32: first cache slot written
  positions_BT: jax.Array       # (B, T) int32
  key_positions_BS: jax.Array   # (B, S) int32
  # (B,) bool, None = all: where False the slots keep what they hold and the layer attends to
  # it (loop-by-loop serving under model.kv_sharing=first: a later loop reads the first loop's)
  write_B: jax.Array | None = None
  # (B,) int32, None = arange(B): the batch row each sequence draws its random initial state as
  # (models/recurrence.py; loop-by-loop serving prefills a request alone, as its own row)
  rows_B: jax.Array | None = None


class LayerCache(NamedTuple):
  """One applied layer's keys and values (after QK-norm and RoPE), S cache slots.

  Under model.attention_sharing = kv_shared | qkv_shared (values are the keys) `k_BSKD` holds
  the key projection *before* QK-norm and RoPE (it is the values), `v_BSKD` is None, and each
  step normalises and rotates the cached keys again (`_write_cache`).
  """
  k_BSKD: jax.Array
  v_BSKD: jax.Array | None


def _logit_scale(module: nn.Module, cfg: ModelConfig) -> jax.Array | float:
  """The logits' multiplier: cfg.attn_mult (model.attn_scale or 1/sqrt(Dh), or the
  parametrization's, models/scaling.py); a learned scalar under l2 QK-norm."""
  if cfg.norm.qk_norm != 'l2':
    return cfg.attn_mult
  # Henry et al. (arXiv:2010.04245), section 3: one learned scalar per attention module
  # replaces 1/sqrt(d_head), initialised to log2(L^2 - L) with L the sequence length of the
  # training data (train.seq_len here, via model.norm.qk_norm_len), not the position limit.
  L = cfg.qk_len
  init = cfg.norm.qk_scale_init or math.log2(L * L - L)
  scale = param(module, 'qk_scale', (), (), 'scalar', init=nn.initializers.constant(init),
                dtype=jnp.dtype(cfg.param_dtype), branch=BRANCH)
  return scale.astype(jnp.dtype(cfg.dtype))


def _write_cache(cfg: ModelConfig, cache: LayerCache, step: DecodeStep, raw_k_BTKD: jax.Array,
                 k_BTKD: jax.Array, v_BTKD: jax.Array, place: PositionStep
                 ) -> tuple[LayerCache, jax.Array, jax.Array]:
  """(the cache with this call's entries at step.index, the keys and values the core reads)."""
  def write(buf_BSKD, new_BTKD):
    new_BTKD = new_BTKD.astype(buf_BSKD.dtype)
    if step.write_B is not None:
      held_BTKD = jax.lax.dynamic_slice_in_dim(buf_BSKD, step.index, new_BTKD.shape[1], axis=1)
      new_BTKD = jnp.where(step.write_B[:, None, None, None], new_BTKD, held_BTKD)
    return jax.lax.dynamic_update_slice_in_dim(buf_BSKD, new_BTKD, step.index, axis=1)
  if cfg.values_are_keys:
    # Values are the keys: the cache holds the key projection only (before QK-norm and
    # RoPE); the keys of every slot are normalised and rotated again at their positions.
    raw_BSKD = write(cache.k_BSKD, raw_k_BTKD)
    keys_BSKD = place.keys(raw_BSKD, jnp.maximum(step.key_positions_BS, 0))
    return LayerCache(raw_BSKD, None), keys_BSKD, raw_BSKD
  cache = LayerCache(write(cache.k_BSKD, k_BTKD), write(cache.v_BSKD, v_BTKD))
  return cache, cache.k_BSKD, cache.v_BSKD


def _placed(cfg: ModelConfig, qkv: Projected, place: PositionStep, positions: jax.Array,
            step: DecodeStep | None, shared_kv: LayerCache | None, emit: bool):
  """(q, k, v, emitted) of one call: its placed queries and keys and its values (`emit`: also
  its keys and values in the cache's format, a LayerCache), or under model.kv_sharing=first
  its queries and another loop's keys and values `shared_kv` (as stored; under values-are-keys
  the raw keys, placed again at their slots' positions)."""
  if shared_kv is not None:
    k_BSKD = shared_kv.k_BSKD
    if not cfg.values_are_keys:
      return place.queries(qkv, positions), k_BSKD, shared_kv.v_BSKD, None
    slots = positions if step is None else jnp.maximum(step.key_positions_BS, 0)
    return place.queries(qkv, positions), place.keys(k_BSKD, slots), k_BSKD, None
  q_BTHD, k_BTKD = place(qkv, positions)
  emitted = None
  if emit:
    emitted = (LayerCache(qkv.k_BTKD, None) if cfg.values_are_keys
               else LayerCache(k_BTKD, qkv.v_BTKD))
  return q_BTHD, k_BTKD, qkv.v_BTKD, emitted


class CausalAttention(nn.Module):
  """Attention with shape-suffixed names: B batch, T/S query/key time, K kv heads, G group."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD: jax.Array, positions_T: jax.Array | None,
               segment_ids_BT: jax.Array | None = None, cache: LayerCache | None = None,
               step: DecodeStep | None = None, masa: dict[str, jax.Array] | None = None,
               shared_kv: LayerCache | None = None, emit: bool = False,
               value_in_BTD: jax.Array | None = None, auxes: list | None = None,
               slices: jax.Array | None = None):
    """-> out (B, T, D); with a `cache` (and its `step`): (out, updated cache).

    `value_in_BTD` (model.norm.placement=moeut, models/block.py): the stream the values are
    projected from, where queries, keys and the selectors read x. `auxes`: a list SwitchHead's
    selection regularizers are appended to (models/switchhead.py).

    model.kv_sharing=first (models/loops.py): `emit` also returns this call's keys and values
    as a LayerCache of its T tokens (out, kv), in the cache's format; `shared_kv` (such a
    LayerCache, or in cached generation the first loop's updated cache) is attended to instead
    of this call's own keys and values, which are then not projected.

    `masa`: {target: atoms} of the MASA targets (models/masa.py); those kernels are formed from
    the shared atoms and this module's coefficients.

    `segment_ids_BT` (optional, packed documents): query t attends key s only if s <= t and
    their ids are equal.

    `positions_T` is (T,), or (B, T) for per-row positions (the gathered token subsets of
    Mixture-of-Recursions routing, models/routing.py).

    The cached path (generation, sharenet/inference/generate.py) ignores `positions_T` and
    `segment_ids_BT`, writes this call's keys and values into `cache` at `step.index` and
    attends over the whole cache by the step's query and key positions.

    `slices` (model.loop_slices; a traced int32 index into (full, *cfg.slice_lens)): SReT's
    sliced group attention (`sliced_attention`): query t attends only keys of its own slice of
    cfg.slice_lens[slices - 1] consecutive positions; 0 attends in full.
    """
    c = self.cfg
    masa = masa or {}
    switch = c.moe.attention == 'switchhead'   # expert values and outputs (models/switchhead.py)
    qkv = project_qkv(c, x_BTD, masa, keys=shared_kv is None,
                      values=((lambda v: switchhead.values(self, c, v, x_BTD, auxes))
                              if switch else None),
                      value_in_BTD=value_in_BTD)
    for name, a in (('query', qkv.q_BTHD), ('key', qkv.k_BTKD), ('value', qkv.v_BTKD)):
      if a is not None:
        sow_l1(self, name, a)
    place = PositionStep(c, qkv.shares_query)
    positions = positions_T if step is None else step.positions_BT
    q_BTHD, k_BTKD, v_BTKD, emitted = _placed(c, qkv, place, positions, step, shared_kv,
                                              emit and cache is None)
    if shared_kv is not None:   # a coordinate check sees the keys and values read instead
      sow_l1(self, 'key', k_BTKD)
      sow_l1(self, 'value', v_BTKD)
    q_BTHD = nn.with_logical_constraint(
        q_BTHD, ('activation_batch', 'activation_length', 'activation_heads', None))
    if c.umup_ops:   # u-muP's unit-scaled attention (models/unit_scale.py)
      # Its output scale is a constant of the forward's length T; a cached forward sees a part
      # of the sequence, so it takes the training length's (model.norm.qk_norm_len).
      Dh = c.d_head
      s_att = unit_scale.attention_output_scale(x_BTD.shape[1] if step is None else c.qk_len,
                                                Dh, c.attn_mult * Dh)
      q_BTHD, k_BTKD, v_BTKD = (unit_scale.scale_bwd(t, s_att) for t in (q_BTHD, k_BTKD, v_BTKD))
    if step is None:
      masks = dict(segment_ids_BT=segment_ids_BT)
    else:
      if cache is not None:
        cache, k_BTKD, v_BTKD = _write_cache(c, cache, step, qkv.k_BTKD, k_BTKD, v_BTKD, place)
      masks = dict(q_positions_BT=step.positions_BT, k_positions_BS=step.key_positions_BS)
    # A coordinate check (mutable 'intermediates') sees the logits on the reference back-ends
    # (xla, chunked: then unchunked); a fused kernel never forms them, so nothing is sown there.
    observe = ((lambda l, m: sow_l1(self, 'attn_logits', l, m))
               if self.is_mutable_collection(INTERMEDIATES) else None)
    attend = functools.partial(
        attention_kernel.attention, scale=_logit_scale(self, c),
        impl=kernels.attention_backend(c.attention, c.kernels), observe=observe,
        softcap=c.attn_softcap)
    if slices is None:
      out_BTHD = attend(q_BTHD, k_BTKD, v_BTKD, **masks)
    elif step is None and observe is None:
      out_BTHD = sliced_attention(attend, q_BTHD, k_BTKD, v_BTKD, segment_ids_BT, slices,
                                  c.slice_lens)
    elif step is None:   # a coordinate check sows the logits: the same function as masks
      out_BTHD = attend(q_BTHD, k_BTKD, v_BTKD,
                        segment_ids_BT=slice_segments(segment_ids_BT, q_BTHD.shape[:2], slices,
                                                      c.slice_lens))
    else:   # cached: the slice as a mask on the positions (the kernels' reference path)
      lens = jnp.asarray((0,) + c.slice_lens, jnp.int32)
      out_BTHD = attend(q_BTHD, k_BTKD, v_BTKD, slice_len=lens[slices], **masks)
    if c.umup_ops:
      out_BTHD = unit_scale.scale_fwd(out_BTHD, s_att)
    out_BTD = (switchhead.output(self, c, out_BTHD, x_BTD, auxes) if switch
               else project_out(c, out_BTHD, masa, self))
    sow_l1(self, 'attn_out', out_BTD)
    if cache is not None:
      return out_BTD, cache
    return out_BTD if emitted is None else (out_BTD, emitted)


def sliced_attention(attend: Callable, q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array,
                     segment_ids_BT: jax.Array | None, slices: jax.Array,
                     slice_lens: tuple[int, ...]) -> jax.Array:
  """SReT's sliced group self-attention (Shen et al., "Sliced Recursive Transformer",
  arXiv:2111.05297): the T positions cut into consecutive slices of n, each attending causally
  within itself. `slices` (traced) picks full attention (0) or slice_lens[slices - 1]; each
  choice is a branch of lax.switch that folds the slices into the batch, (B T/n, n, ...), so
  the back-end (every one, the Pallas kernels too) computes T n instead of T^2 logits (a call
  whose length is no multiple of n is padded at the end, causally invisible). RoPE
  was applied at the absolute positions before, so a slice's scores are its own. The
  reference's groups are contiguous in the first pass of a block and randomly permuted in the
  second (SReT.py Group_Attention): for a causal model here every loop's groups are
  contiguous."""
  B, T, H, Dh = q_BTHD.shape

  def full(q, k, v, seg):
    return attend(q, k, v, segment_ids_BT=seg)

  def cut(n):
    Tp = -(-T // n) * n   # a call of another length: padded at the end, which no query sees

    def fold(a):
      a = jnp.pad(a, [(0, 0), (0, Tp - T)] + [(0, 0)] * (a.ndim - 2))
      return a.reshape((B * Tp // n, n) + a.shape[2:])

    def run(q, k, v, seg):
      out = attend(fold(q), fold(k), fold(v), segment_ids_BT=None if seg is None else fold(seg))
      return out.reshape(B, Tp, H, Dh)[:, :T]
    return run

  return jax.lax.switch(slices, [full] + [cut(n) for n in slice_lens],
                        q_BTHD, k_BTKD, v_BTKD, segment_ids_BT)


def slice_segments(segment_ids_BT: jax.Array | None, shape_BT: tuple[int, int],
                   slices: jax.Array, slice_lens: tuple[int, ...]) -> jax.Array:
  """Segment ids under which full attention is `sliced_attention` (packed documents and slices
  both separate): (document, slice) numbered as one id. Computes all T^2 logits."""
  B, T = shape_BT
  n = jnp.asarray((T,) + slice_lens, jnp.int32)[slices]
  slice_T = jnp.arange(T, dtype=jnp.int32) // n
  seg_BT = jnp.zeros(shape_BT, jnp.int32) if segment_ids_BT is None else segment_ids_BT
  return seg_BT * T + slice_T[None, :]
