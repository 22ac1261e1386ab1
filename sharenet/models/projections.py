"""Attention's projections: q, k, v with projection sharing, and the output projection o.

Projection sharing, model.attention_sharing (Kayyam, Madan Gopal, Lewis, "Do Transformers Need
Three Projections?", arXiv:2606.04032; docs/sharing.md):
  none        q, k, v projections.
  kv_shared   values are the keys: no 'v' kernel, v = x W_k (the projection, before QK-norm
              and RoPE, exactly a `none` model with W_v = W_k); the KV cache holds K only.
  qk_shared   queries are the keys: no 'q' kernel; the key tensor after QK-norm (k_norm only)
              and RoPE is also the query (models/positions.py), so the scores are symmetric.
  qkv_shared  one projection ('k'): queries as in qk_shared, values as in kv_shared.
  cem         Causal Energy Minimization's weight-tied attention (Xu, Couturier, Ruhle,
              Rajmohan, Hensman, arXiv:2605.07588): values are the keys (as kv_shared) and the
              output projection is the queries' transposed, W_O,h = W_Q,h^T; no 'v' or 'o'
              kernel. Then head h's output at t is W_Q,h^T sum_s a_ts W_K,h x_s with
              a_ts = softmax_s(beta (W_Q,h x_t) . (W_K,h x_s)): minus the gradient in y, at
              y = x_t, of the interaction energy E_t(y) = -(1/beta) sum_h log sum_{s<=t}
              exp(beta (W_Q,h y) . (W_K,h x_s)) with the context x_{<=t} held fixed (our
              derivation from the paper's abstract, checked numerically in
              tests/models/test_cem.py; exact without positions and QK-norm, which act on
              queries and keys as in kv_shared).
QK-norm and RoPE apply to the shared tensor as they apply to keys; qk_shared and qkv_shared
need num_kv_heads = num_heads (config check).

Both functions run inside the attention module's compact call: the Dense layers they build are
its children 'q', 'k', 'v' and 'o', so the parameter paths are the attention module's own.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sharenet.models.config import ModelConfig
from sharenet.models.layers import Dense, dense_apply

BRANCH = 'attn'


class Projected(NamedTuple):
  """One call's projections, before QK-norm and RoPE; a shared mode aliases the shared tensor
  (k and v None where the call reads another loop's keys and values: project_qkv's `keys`).

  `shares_query`: the query is the key after QK-norm and RoPE (qk_shared, qkv_shared), so
  `q_BTHD` is the raw key projection and the position step takes the query from the keys.
  """
  q_BTHD: jax.Array
  k_BTKD: jax.Array | None
  v_BTKD: jax.Array | None
  shares_query: bool


def _dense(cfg: ModelConfig, name: str, heads: int, axis: str, use: str | None = None) -> Dense:
  rank = cfg.sharing.lora_rank if name in cfg.sharing.lora_targets else 0
  return Dense((heads, cfg.d_head), ('embed',), (axis, 'head_dim'), branch=BRANCH, use=use,
               lora_rank=rank, lora_scale=cfg.sharing.lora_scale, lora_zero=cfg.sharing.lora_zero,
               use_bias=cfg.bias_on(name), dtype=jnp.dtype(cfg.dtype),
               param_dtype=jnp.dtype(cfg.param_dtype), dense_grad=cfg.dense_grad, name=name,
               **cfg.mpo_args(name))


def project_qkv(cfg: ModelConfig, x_BTD: jax.Array, masa: dict[str, jax.Array],
                keys: bool = True, values: Callable[[jax.Array], jax.Array] | None = None,
                value_in_BTD: jax.Array | None = None) -> Projected:
  """q, k, v of x (B, T, D) under model.attention_sharing; `masa`: {target: atoms}.

  `values` (SwitchHead's value experts, models/switchhead.py; attention_sharing none only)
  replaces the 'v' projection: x -> v (B, T, K, Dh).

  `value_in_BTD` (model.norm.placement=moeut: the un-normalised stream) is what the value
  projection reads instead of x; only where the values have their own projection
  (attention_sharing none or qk_shared: the compatibility table refuses the others).

  `keys=False` (a later loop under model.kv_sharing=first, which reads the first loop's keys
  and values): only what the query needs is projected; k and v are None unless they are it.
  """
  H, K = cfg.num_heads, cfg.kv_heads
  v_in_BTD = x_BTD if value_in_BTD is None else value_in_BTD
  proj = lambda name, heads, axis, use=None: dense_apply(
      _dense(cfg, name, heads, axis, use), v_in_BTD if name == 'v' else x_BTD, masa.get(name))
  sharing = cfg.attention_sharing
  if sharing == 'none':   # unchanged arithmetic and tree (bit-identical to before sharing)
    q_BTHD = checkpoint_name(proj('q', H, 'heads', 'query'), 'query_proj')
    if not keys:
      return Projected(q_BTHD, None, None, False)
    k_BTKD = checkpoint_name(proj('k', K, 'kv_heads', 'key'), 'key_proj')
    v_BTKD = checkpoint_name(values(v_in_BTD) if values else proj('v', K, 'kv_heads'),
                             'value_proj')
    return Projected(q_BTHD, k_BTKD, v_BTKD, False)
  shares_query = sharing in ('qk_shared', 'qkv_shared')
  if sharing in ('kv_shared', 'cem') and not keys:
    return Projected(checkpoint_name(proj('q', H, 'heads', 'query'), 'query_proj'), None, None,
                     False)
  # The shared tensor is the key projection; qk_shared / qkv_shared have K == H.
  k_BTKD = checkpoint_name(proj('k', K, 'kv_heads', 'key'), 'key_proj')
  q_BTHD = (checkpoint_name(proj('q', H, 'heads', 'query'), 'query_proj')
            if sharing in ('kv_shared', 'cem') else k_BTKD)
  if not keys:   # the query is the key projection
    return Projected(q_BTHD, None, None, shares_query)
  v_BTKD = (checkpoint_name(proj('v', K, 'kv_heads'), 'value_proj')
            if sharing == 'qk_shared' else k_BTKD)
  return Projected(q_BTHD, k_BTKD, v_BTKD, shares_query)


def project_out(cfg: ModelConfig, out_BTHD: jax.Array, masa: dict[str, jax.Array],
                module: nn.Module | None = None) -> jax.Array:
  """The output projection 'o': heads (B, T, H, Dh) -> (B, T, D). Under attention_sharing=cem
  it is the query projection transposed, read from `module` (the attention module, whose 'q'
  kernel project_qkv created): W_O,h = W_Q,h^T."""
  if cfg.attention_sharing == 'cem':
    q_DHK = nn.unbox(module.variables['params']['q']['kernel'])
    B, T, H, Dh = out_BTHD.shape
    dt = jnp.dtype(cfg.dtype)
    w = jnp.transpose(q_DHK, (1, 2, 0)).reshape(H * Dh, -1).astype(dt)
    return checkpoint_name(out_BTHD.reshape(B, T, H * Dh).astype(dt) @ w, 'out_proj')
  rank = cfg.sharing.lora_rank if 'o' in cfg.sharing.lora_targets else 0
  dense = Dense((cfg.d_model,), ('heads', 'head_dim'), ('embed',), role='writer', branch=BRANCH,
                lora_rank=rank, lora_scale=cfg.sharing.lora_scale, lora_zero=cfg.sharing.lora_zero,
                use_bias=cfg.bias_on('o'), dtype=jnp.dtype(cfg.dtype),
                param_dtype=jnp.dtype(cfg.param_dtype), dense_grad=cfg.dense_grad, name='o',
                **cfg.mpo_args('o'))
  return checkpoint_name(dense_apply(dense, out_BTHD, masa.get('o')), 'out_proj')
