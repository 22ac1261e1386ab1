"""Causal self-attention: multi-head or grouped-query, RoPE, configurable scale, QK-norm.

The softmax(q k^T) v core runs on the back-end `model.attention` / `model.kernels` pick
(sharenet/kernels/attention.py); projections, QK-norm, RoPE and u-muP scaling stay here.

Projection sharing, model.attention_sharing (Kayyam, Madan Gopal, Lewis, "Do Transformers Need
Three Projections?", arXiv:2606.04032; docs/sublayer_sharing.md):
  none        q, k, v projections.
  kv_shared   values are the keys: no 'v' kernel, v = x W_k (the projection, before QK-norm
              and RoPE, exactly a `none` model with W_v = W_k); the KV cache holds K only.
  qk_shared   queries are the keys: no 'q' kernel; the key tensor after QK-norm (k_norm only)
              and RoPE is also the query, so the scores are symmetric.
  qkv_shared  one projection ('k'): queries as in qk_shared, values as in kv_shared.
QK-norm and RoPE apply to the shared tensor as they apply to keys today; qk_shared and
qkv_shared need num_kv_heads = num_heads (config check).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sharenet import kernels
from sharenet.kernels import attention as attention_kernel
from sharenet.models.config import ModelConfig
from sharenet.models import unit_scale
from sharenet.models.layers import INTERMEDIATES, Dense, dense_apply, einsum_f32, rope, sow_l1
from sharenet.norms import Norm
from sharenet.params import param

BRANCH = 'attn'


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


class LayerCache(NamedTuple):
  """One applied layer's keys and values (after QK-norm and RoPE), S cache slots.

  Under model.attention_sharing = kv_shared | qkv_shared (values are the keys) `k_BSKD` holds
  the key projection *before* QK-norm and RoPE (it is the values), `v_BSKD` is None, and each
  step normalises and rotates the cached keys again (models/attention.py).
  """
  k_BSKD: jax.Array
  v_BSKD: jax.Array | None


def _rope_per_sequence(x_BTHD: jax.Array, positions_BT: jax.Array, base: float) -> jax.Array:
  return jax.vmap(lambda x, p: rope(x[None], p, base)[0])(x_BTHD, positions_BT)


class CausalAttention(nn.Module):
  """Attention with shape-suffixed names: B batch, T/S query/key time, K kv heads, G group."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD: jax.Array, positions_T: jax.Array | None,
               segment_ids_BT: jax.Array | None = None, cache: LayerCache | None = None,
               step: DecodeStep | None = None, masa: dict[str, jax.Array] | None = None):
    """-> out (B, T, D); with a `cache` (and its `step`): (out, updated cache).

    `masa`: {target: atoms} of the MASA targets (models/masa.py); those kernels are formed from
    the shared atoms and this module's coefficients.

    `segment_ids_BT` (optional, packed documents): query t attends key s only if s <= t and
    their ids are equal.

    `positions_T` is (T,), or (B, T) for per-row positions (the gathered token subsets of
    Mixture-of-Recursions routing, models/routing.py).

    The cached path (generation, sharenet/generate.py) ignores `positions_T`, writes this
    call's keys and values into `cache` at `step.index` and attends over the whole cache.
    """
    c = self.cfg
    H, K, Dh = c.num_heads, c.kv_heads, c.head_dim
    dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)

    masa = masa or {}
    sharing = c.attention_sharing

    def proj(name, heads, axis, use=None):
      rank = c.lora_rank if name in c.lora_targets else 0
      return lambda x: dense_apply(
          Dense((heads, Dh), ('embed',), (axis, 'head_dim'), branch=BRANCH, use=use,
                lora_rank=rank, lora_scale=c.lora_scale, lora_zero=c.lora_zero,
                use_bias=c.reader_bias, dtype=dt, param_dtype=pdt, dense_grad=c.dense_grad,
                name=name), x, masa.get(name))

    def qk_norm(name):
      kind = 'rmsnorm' if c.qk_norm == 'rms' else 'l2'
      return Norm(kind, c.norm_eps, axis_name='head_dim', param_dtype=pdt, branch=BRANCH,
                  name=name)

    def rotate(x_BTHD, positions):   # positions: (T,) or per sequence (B, T)
      if c.position != 'rope':
        return x_BTHD
      if positions.ndim == 2:
        return _rope_per_sequence(x_BTHD, positions, c.rope_base)
      return rope(x_BTHD, positions, c.rope_base)

    if sharing == 'none':   # unchanged arithmetic and tree (bit-identical to before sharing)
      q_BTHD = checkpoint_name(proj('q', H, 'heads', 'query')(x_BTD), 'query_proj')
      k_BTKD = checkpoint_name(proj('k', K, 'kv_heads')(x_BTD), 'key_proj')
      v_BTKD = checkpoint_name(proj('v', K, 'kv_heads')(x_BTD), 'value_proj')
    else:
      # The shared tensor is the key projection; qk_shared / qkv_shared have K == H.
      k_BTKD = checkpoint_name(proj('k', K, 'kv_heads')(x_BTD), 'key_proj')
      q_BTHD = (checkpoint_name(proj('q', H, 'heads', 'query')(x_BTD), 'query_proj')
                if sharing == 'kv_shared' else k_BTKD)
      v_BTKD = (checkpoint_name(proj('v', K, 'kv_heads')(x_BTD), 'value_proj')
                if sharing == 'qk_shared' else k_BTKD)
    for name, a in (('query', q_BTHD), ('key', k_BTKD), ('value', v_BTKD)):
      sow_l1(self, name, a)
    shared_qk = sharing in ('qk_shared', 'qkv_shared')   # the query is the normed, rotated key
    positions = positions_T if cache is None else step.positions_BT
    k_norm = qk_norm('k_norm') if c.qk_norm != 'none' else (lambda x: x)
    # rms: a learned gain over head_dim (ViT-22B); l2: unit vectors (Henry et al.).
    if c.qk_norm != 'none' and not shared_qk:
      q_BTHD = qk_norm('q_norm')(q_BTHD)
    k_BTKD_raw = k_BTKD
    k_BTKD = k_norm(k_BTKD)
    if not shared_qk:
      q_BTHD = rotate(q_BTHD, positions)
    k_BTKD = rotate(k_BTKD, positions)
    if shared_qk:
      q_BTHD = k_BTKD
    q_BTHD = nn.with_logical_constraint(
        q_BTHD, ('activation_batch', 'activation_length', 'activation_heads', None))

    B, T = x_BTD.shape[:2]
    if c.umup_ops:   # u-muP's unit-scaled attention (models/unit_scale.py)
      # Its output scale is a constant of the forward's length T; a cached forward sees a part
      # of the sequence, so it takes the training length's (model.norm.qk_norm_len).
      s_att = unit_scale.attention_output_scale(T if cache is None else c.qk_len, Dh,
                                                (c.attn_scale or Dh ** -0.5) * Dh)
      q_BTHD, k_BTKD, v_BTKD = (unit_scale.scale_bwd(t, s_att) for t in (q_BTHD, k_BTKD, v_BTKD))
    if c.qk_norm == 'l2':
      # Henry et al. (arXiv:2010.04245), section 3: one learned scalar per attention module
      # replaces 1/sqrt(d_head), initialised to log2(L^2 - L) with L the sequence length of the
      # training data (train.seq_len here, via model.norm.qk_norm_len), not the position limit.
      L = c.qk_len
      init = c.qk_scale_init or math.log2(L * L - L)
      scale = param(self, 'qk_scale', (), (), 'scalar', init=nn.initializers.constant(init),
                    dtype=pdt, branch=BRANCH).astype(dt)
    else:
      scale = c.attn_scale or Dh ** -0.5
    impl = kernels.attention_backend(c.attention, c.kernels)
    if cache is not None and c.values_are_keys:
      # Values are the keys: the cache holds the key projection only (before QK-norm and
      # RoPE); the keys of every slot are normalised and rotated again at their positions.
      raw_BSKD = jax.lax.dynamic_update_slice_in_dim(
          cache.k_BSKD, k_BTKD_raw.astype(cache.k_BSKD.dtype), step.index, axis=1)
      cache = LayerCache(raw_BSKD, None)
      keys_BSKD = rotate(k_norm(raw_BSKD), jnp.maximum(step.key_positions_BS, 0))
      values_BSKD = raw_BSKD
    elif cache is not None:
      cache = LayerCache(
          jax.lax.dynamic_update_slice_in_dim(cache.k_BSKD, k_BTKD.astype(cache.k_BSKD.dtype),
                                              step.index, axis=1),
          jax.lax.dynamic_update_slice_in_dim(cache.v_BSKD, v_BTKD.astype(cache.v_BSKD.dtype),
                                              step.index, axis=1))
      keys_BSKD, values_BSKD = cache.k_BSKD, cache.v_BSKD
    if cache is not None:
      # Generation: the XLA arithmetic over the cache, whatever model.attention says (the fused
      # kernels take a causal T x T mask, not per-sequence key positions).
      q_BTKGD = q_BTHD.reshape(B, T, K, H // K, Dh)
      logits_BKGTS = einsum_f32('btkgd,bskd->bkgts', q_BTKGD * scale, keys_BSKD)
      key_pos_B1S = step.key_positions_BS[:, None, :]
      visible_BTS = (key_pos_B1S >= 0) & (key_pos_B1S <= step.positions_BT[:, :, None])
      logits_BKGTS = jnp.where(visible_BTS[:, None, None], logits_BKGTS.astype(jnp.float32),
                               -1e30)
      probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(dt)
      out_BTKGD = jnp.einsum('bkgts,bskd->btkgd', probs_BKGTS, values_BSKD)
      out_BTHD = out_BTKGD.reshape(B, T, H, Dh)
    elif impl in ('xla', 'chunked'):
      # kernels.attention.reference: float32 logits from (bf16) operands, so the softmax never
      # sees logits rounded to bf16, and the checkpoint names the remat policies select
      # (models/stack.py). `chunked` (the CPU default) splits the queries into causal chunks; a
      # coordinate check (mutable 'intermediates') takes the unchunked path, the same function,
      # to sow the whole 'attn_logits'.
      observe = self.is_mutable_collection(INTERMEDIATES)
      out_BTHD = attention_kernel.reference(
          q_BTHD, k_BTKD, v_BTKD, scale=scale, segment_ids_BT=segment_ids_BT,
          chunk=attention_kernel.CPU_CHUNK if impl == 'chunked' and not observe else 0,
          observe=(lambda l, m: sow_l1(self, 'attn_logits', l, m)) if observe else None)
    else:
      # A fused kernel (FlashAttention, Dao et al., arXiv:2205.14135) never materializes the
      # (T, T) logits: no 'attn_logits' sow (coordinate checks need model.attention=xla) and no
      # 'attn_logits' / 'attn_probs' checkpoint names (except_attn then saves everything else).
      out_BTHD = attention_kernel.attention(q_BTHD, k_BTKD, v_BTKD, scale=scale, impl=impl,
                                            segment_ids_BT=segment_ids_BT)
    if c.umup_ops:
      out_BTHD = unit_scale.scale_fwd(out_BTHD, s_att)
    rank = c.lora_rank if 'o' in c.lora_targets else 0
    out_BTD = dense_apply(Dense((c.d_model,), ('heads', 'head_dim'), ('embed',), role='writer',
                                branch=BRANCH, lora_rank=rank, lora_scale=c.lora_scale,
                                lora_zero=c.lora_zero, dtype=dt, param_dtype=pdt,
                                dense_grad=c.dense_grad, name='o'),
                          out_BTHD, masa.get('o'))
    sow_l1(self, 'attn_out', out_BTD)
    out_BTD = checkpoint_name(out_BTD, 'out_proj')
    return out_BTD if cache is None else (out_BTD, cache)
