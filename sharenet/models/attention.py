"""Causal self-attention: multi-head or grouped-query, RoPE, configurable scale, QK-norm.

The softmax(q k^T) v core runs on the back-end `model.attention` / `model.kernels` pick
(sharenet/kernels/attention.py); projections, QK-norm, RoPE and u-muP scaling stay here.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sharenet import kernels
from sharenet.kernels import attention as attention_kernel
from sharenet.models.config import ModelConfig
from sharenet.models import unit_scale
from sharenet.models.layers import Dense, einsum_f32, rope, sow_l1
from sharenet.norms import Norm
from sharenet.params import param

BRANCH = 'attn'


class CausalAttention(nn.Module):
  """Attention with shape-suffixed names: B batch, T/S query/key time, K kv heads, G group."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD: jax.Array, positions_T: jax.Array,
               segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """`segment_ids_BT` (optional): query t attends key s only if s <= t and their ids are equal."""
    c = self.cfg
    H, K, Dh = c.num_heads, c.kv_heads, c.head_dim
    dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)

    def proj(name, heads, axis, use=None):
      rank = c.lora_rank if name in c.lora_targets else 0
      return Dense((heads, Dh), ('embed',), (axis, 'head_dim'), branch=BRANCH, use=use,
                   lora_rank=rank, lora_scale=c.lora_scale,
                   lora_zero=c.lora_zero, use_bias=c.reader_bias, dtype=dt,
                   param_dtype=pdt, name=name)

    q_BTHD = checkpoint_name(proj('q', H, 'heads', 'query')(x_BTD), 'query_proj')
    k_BTKD = checkpoint_name(proj('k', K, 'kv_heads')(x_BTD), 'key_proj')
    v_BTKD = checkpoint_name(proj('v', K, 'kv_heads')(x_BTD), 'value_proj')
    for name, a in (('query', q_BTHD), ('key', k_BTKD), ('value', v_BTKD)):
      sow_l1(self, name, a)
    # rms: a learned gain over head_dim (ViT-22B); l2: unit vectors (Henry et al.).
    if c.qk_norm != 'none':
      kind = 'rmsnorm' if c.qk_norm == 'rms' else 'l2'
      q_BTHD = Norm(kind, c.norm_eps, axis_name='head_dim', param_dtype=pdt, branch=BRANCH,
                    name='q_norm')(q_BTHD)
      k_BTKD = Norm(kind, c.norm_eps, axis_name='head_dim', param_dtype=pdt, branch=BRANCH,
                    name='k_norm')(k_BTKD)
    if c.position == 'rope':
      q_BTHD = rope(q_BTHD, positions_T, c.rope_base)
      k_BTKD = rope(k_BTKD, positions_T, c.rope_base)
    q_BTHD = nn.with_logical_constraint(
        q_BTHD, ('activation_batch', 'activation_length', 'activation_heads', None))

    B, T = x_BTD.shape[:2]
    if c.umup_ops:   # u-muP's unit-scaled attention (models/unit_scale.py)
      s_att = unit_scale.attention_output_scale(T, Dh, (c.attn_scale or Dh ** -0.5) * Dh)
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
    if impl == 'xla':
      # kernels.attention.reference is this arithmetic; kept inline for the 'attn_logits' sow
      # (coordinate checks) and the checkpoint names the remat policies select (models/stack.py).
      q_BTKGD = q_BTHD.reshape(B, T, K, H // K, Dh)
      # float32 logits from (bf16) operands: the softmax never sees logits rounded to bf16.
      logits_BKGTS = einsum_f32('btkgd,bskd->bkgts', q_BTKGD * scale, k_BTKD)
      causal_TS = jnp.tril(jnp.ones((T, T), dtype=bool))
      mask_BKGTS = causal_TS[None, None, None]
      if segment_ids_BT is not None:   # packed documents: no attention across them
        mask_BKGTS = mask_BKGTS & attention_kernel.same_segment(segment_ids_BT)[:, None, None]
      sow_l1(self, 'attn_logits', logits_BKGTS, mask_BKGTS)
      logits_BKGTS = jnp.where(mask_BKGTS, logits_BKGTS.astype(jnp.float32), -1e30)
      logits_BKGTS = checkpoint_name(logits_BKGTS, 'attn_logits')
      probs_BKGTS = checkpoint_name(jax.nn.softmax(logits_BKGTS, axis=-1).astype(dt),
                                    'attn_probs')
      out_BTKGD = jnp.einsum('bkgts,bskd->btkgd', probs_BKGTS, v_BTKD)
      out_BTHD = out_BTKGD.reshape(B, T, H, Dh)
    else:
      # A fused kernel (FlashAttention, Dao et al., arXiv:2205.14135) never materializes the
      # (T, T) logits: no 'attn_logits' sow (coordinate checks need model.attention=xla) and no
      # 'attn_logits' / 'attn_probs' checkpoint names (except_attn then saves everything else).
      out_BTHD = attention_kernel.attention(q_BTHD, k_BTKD, v_BTKD, scale=scale, impl=impl,
                                            segment_ids_BT=segment_ids_BT)
    if c.umup_ops:
      out_BTHD = unit_scale.scale_fwd(out_BTHD, s_att)
    rank = c.lora_rank if 'o' in c.lora_targets else 0
    out_BTD = Dense((c.d_model,), ('heads', 'head_dim'), ('embed',), role='writer', branch=BRANCH,
                    lora_rank=rank, lora_scale=c.lora_scale,
                    lora_zero=c.lora_zero, dtype=dt, param_dtype=pdt,
                    name='o')(out_BTHD)
    sow_l1(self, 'attn_out', out_BTD)
    return checkpoint_name(out_BTD, 'out_proj')
