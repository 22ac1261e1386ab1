"""SwitchHead attention (model.moe.attention = switchhead; docs/experts.md).

Csordas, Piekos, Irie, Schmidhuber, "SwitchHead: Accelerating Transformers with Mixture-of-
Experts Attention" (arXiv:2312.07987, Sec. 3), as MoEUT uses it (arXiv:2405.16039; reference
code moeut.py SwitchHeadCore): queries and keys are the dense projections; the value and output
projections are E = model.moe.attention_experts experts per head. Each head picks its top-k
(model.moe.attention_top_k) experts by sigmoid scores s = sigmoid(x W_sel) and sums them
weighted by the scores:

  v_{t,h}   = sum_{e in topk(s^V_{t,h})} s^V_{t,h,e} x_t W^V_{h,e}        (selected from the
              source token t, so a cached value needs nothing of the later queries)
  out_t     = sum_h sum_{e in topk(s^O_{t,h})} s^O_{t,h,e} a_{t,h} W^O_{h,e}   (selected from
              the destination token t, a_{t,h} its head's attention output)

With one expert (E = 1) the reference has no value selector and gates each head's output by
sigmoid(x_t W^O_sel,h) (its special case "att_n_experts=1"): v_t = x_t W^V, out_t =
sum_h sigmoid(x_t W^O_sel,h) a_{t,h} W^O_h, plain attention with a sigmoid output gate per head.
The selections' regularizer (E > 1) is MoEUT's att_entropy_reg: for each of the value and the
output selectors, the negative entropy of the selection distribution per (sequence, head)
averaged over its tokens (models/moe.py entropy_reg on the raw logits), both summed, times
model.moe.attention_entropy_reg; like sigma-MoE's, each application of a stored set adds its
share (num_unique / num_layers of it), where the reference pools a set's applications into one
distribution. Under model.norm.placement=moeut (MoEUT's peri-layernorm, models/block.py) the
value experts read the un-normalised stream and their selector the normed one, as the
reference's v_src and k_src; otherwise both read the block's normed input.

Parameters (the attention module's, so a tied block ties them): 'v_experts' (E, D, K, Dh)
readers of fan-in D, 'o_experts' (E, H, Dh, D) writers of fan-in H Dh, both with the leading
'experts' stack axis of models/moe.py; 'v_router' (E, D, K) (not for E = 1) and 'o_router'
(E, D, H), role router. Init as the reference: N(0, 1/fan_in) (without its depth scale and the
selectors' row renormalisation). The grouped matmuls are models/moe.py's (model.moe.dispatch),
over H E (head, expert) groups, so only the selected experts run.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet.models import moe
from sharenet.models.config import ModelConfig
from sharenet.models.params import param

BRANCH = 'attn'


def _param(module: nn.Module, cfg: ModelConfig, name: str, shape: tuple[int, ...],
           axes: tuple[str, ...], role: str, num_in: int, fan_in: int) -> jax.Array:
  return param(module, name, (cfg.moe.attention_experts,) + shape, ('experts',) + axes, role,
               std=fan_in ** -0.5, dtype=jnp.dtype(cfg.param_dtype), num_in=num_in,
               branch=BRANCH, writes=role == 'writer')


def _select(module: nn.Module, cfg: ModelConfig, name: str, x_BTD: jax.Array, heads: int,
            axis: str, auxes: list | None) -> tuple[jax.Array, jax.Array]:
  """(experts (B T heads, k) as global group ids head * E + e, sigmoid gates (B T heads, k));
  the selection's weighted entropy regularizer is appended to `auxes` (when not None)."""
  D, E = cfg.d_model, cfg.moe.attention_experts
  w_EDH = _param(module, cfg, name, (D, heads), ('embed', axis), 'router', 1, D)
  dt = jnp.dtype(cfg.dtype)
  logits_BTHE = jnp.einsum('btd,edh->bthe', x_BTD.astype(dt), w_EDH.astype(dt))
  if auxes is not None and E > 1 and cfg.moe.attention_entropy_reg:
    B, T = x_BTD.shape[:2]
    per_head = jnp.transpose(logits_BTHE, (0, 2, 1, 3)).reshape(B * heads, T, E)
    share = cfg.moe.attention_entropy_reg * cfg.plan.num_unique / cfg.num_layers
    auxes.append(share * moe.entropy_reg(per_head))
  experts_NK, gates_NK = moe.sigma_select(logits_BTHE.reshape(-1, E), cfg.moe.attention_top_k)
  head_N = jnp.tile(jnp.arange(heads), x_BTD.shape[0] * x_BTD.shape[1])
  return experts_NK + (head_N * E)[:, None], gates_NK


def _grouped(cfg: ModelConfig, rows_MI: jax.Array, experts_MK: jax.Array, gates_MK: jax.Array,
             w_GIO: jax.Array) -> jax.Array:
  """sum_j gate_mj rows_m W_{e_mj}: models/moe.py's combine over the G (head, expert) groups."""
  dispatch = moe.dispatch_of(cfg)
  fn = lambda x_SI, sizes_G: moe.grouped_matmul(x_SI, w_GIO, sizes_G, dispatch)
  return moe.combine(rows_MI, experts_MK, gates_MK, fn, w_GIO.shape[0])


def values(module: nn.Module, cfg: ModelConfig, x_BTD: jax.Array, select_BTD: jax.Array,
           auxes: list | None = None) -> jax.Array:
  """The value experts' output v (B, T, K, Dh) of the source tokens x, selected by their
  `select_BTD` (x itself, or under model.norm.placement=moeut its normed form)."""
  D, K, Dh, E = cfg.d_model, cfg.kv_heads, cfg.d_head, cfg.moe.attention_experts
  B, T, _ = x_BTD.shape
  dt = jnp.dtype(cfg.dtype)
  w_EDKH = _param(module, cfg, 'v_experts', (D, K, Dh), ('embed', 'kv_heads', 'head_dim'),
                  'reader', 1, D)
  if E == 1:   # the reference's special case: one value projection, no selector
    return jnp.einsum('btd,dkh->btkh', x_BTD.astype(dt), w_EDKH[0].astype(dt))
  experts_NK, gates_NK = _select(module, cfg, 'v_router', select_BTD, K, 'kv_heads', auxes)
  w_GDH = jnp.transpose(w_EDKH, (2, 0, 1, 3)).reshape(K * E, D, Dh)
  rows_ND = jnp.repeat(x_BTD.reshape(B * T, D).astype(dt), K, axis=0)   # one row per (t, head)
  return _grouped(cfg, rows_ND, experts_NK, gates_NK, w_GDH).reshape(B, T, K, Dh)


def output(module: nn.Module, cfg: ModelConfig, out_BTHD: jax.Array, x_BTD: jax.Array,
           auxes: list | None = None) -> jax.Array:
  """The output experts: heads (B, T, H, Dh) -> (B, T, D), selected from the query tokens x."""
  D, H, Dh, E = cfg.d_model, cfg.num_heads, cfg.d_head, cfg.moe.attention_experts
  B, T = out_BTHD.shape[:2]
  dt = jnp.dtype(cfg.dtype)
  w_EHDO = _param(module, cfg, 'o_experts', (H, Dh, D), ('heads', 'head_dim', 'embed'),
                  'writer', 2, H * Dh)
  experts_NK, gates_NK = _select(module, cfg, 'o_router', x_BTD, H, 'heads', auxes)
  w_GDO = w_EHDO.transpose(1, 0, 2, 3).reshape(H * E, Dh, D)
  rows_ND = out_BTHD.reshape(B * T * H, Dh).astype(dt)
  out_NHD = _grouped(cfg, rows_ND, experts_NK, gates_NK, w_GDO).reshape(B * T, H, D)
  return jnp.sum(out_NHD, axis=1).reshape(B, T, D)
