"""Parameter and FLOP accounting on stored (unique) and applied depth."""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
from flax.traverse_util import flatten_dict

from sharenet.models.config import ModelConfig
from sharenet.models.lm import param_table
from sharenet.models.masa import atom_specs
from sharenet.models.sections import RecurrenceConfig
from sharenet.models.params import PER_LAYER


def params_unique(variables: Any) -> int:
  """Stored trainable parameters (shared sets counted once)."""
  variables = nn.unbox(variables)
  return sum(math.prod(x.shape) for c in ('params', PER_LAYER) if c in variables
             for x in jax.tree.leaves(variables[c]))


def params_applied(variables: Any, cfg: ModelConfig) -> int:
  """Parameters an untied model with the same applied depth would store: a tied block leaf
  counts once per use of each stored set it holds (its structure metadata, params.py)."""
  variables = nn.unbox(variables)
  table = param_table(cfg)
  total = 0
  for c in ('params', PER_LAYER):
    for path, x in flatten_dict(variables.get(c, {})).items():
      n = math.prod(x.shape)
      info = table.get((c,) + path)
      if info is not None and info.sets:   # routers and per-layer parts: stored as applied
        n = n // len(info.sets) * sum(info.uses)
      total += n
  return total


def matmul_params_per_layer(cfg: ModelConfig) -> int:
  """Weights one applied layer multiplies with (LoRA factors included), from the role table;
  experts (model.moe) as executed: the top_k a token runs, not all (`executed`); the kernels a
  parameter bank generates (models/bank.py: the bank sits outside the blocks) and the MPO
  kernels (models/mpo.py: a chain of tensors) at their shape, and the transposes CEM's tied
  attention and MLP multiply with."""
  s = cfg.sharing   # LoRA where an untied layer keeps it (lora_layers=all), as segment_cfg
  one = cfg.derive(num_layers=1, scan_layers=True, routing={'kind': 'none'}, kv_sharing='none',
                   loop_slices='',
                   recurrence=RecurrenceConfig(),   # one layer: no loop to recur
                   sharing={'scheme': 'untied', 'num_unique': 0, 'repeats': 0, 'pattern': '',
                            'lora_rank': s.lora_rank if s.lora_layers == 'all' else 0},
                   moe={'lora_experts': cfg.moe.lora_experts if s.lora_layers == 'all' else 0})
  generated = sum(math.prod(spec[0]) for spec in atom_specs(
      cfg, cfg.bank_kernels + cfg.mpo_kernels).values())
  # tied transposes (CEM): W_O = W_Q^T and the tied MLP's W^T multiply without a leaf of their own
  generated += cfg.num_heads * cfg.d_head * cfg.d_model if cfg.attention_sharing == 'cem' else 0
  generated += cfg.mlp_dim * cfg.d_model if cfg.mlp_tied else 0
  return generated + sum(executed(i, cfg) for i in param_table(one).values()
                         if i.branch is not None and i.role in ('reader', 'writer', 'lora',
                                                                'router'))


def executed(info: Any, cfg: ModelConfig) -> int:
  """Weights of one block leaf a token multiplies with: one matrix of a stack, and of an expert
  stack (model.moe, models/moe.py) the top_k experts the token runs (SwitchHead's value / output
  experts, models/switchhead.py: attention_top_k per head; Mixture-of-LoRAs factors,
  models/lora_experts.py: every expert, which it runs masked); a selector's every row (it
  scores all experts)."""
  n = math.prod(info.shape[info.num_stack:])
  if 'experts' not in info.axes[:info.num_stack]:
    return n
  stored = info.shape[info.axes.index('experts')]
  if info.role in ('router', 'lora'):
    return n * stored
  return n * (cfg.moe.attention_top_k if info.branch == 'attn' else cfg.moe_top_k)


def kv_params_skipped(cfg: ModelConfig) -> int:
  """Weights a later loop's layer does not multiply with under model.kv_sharing=first
  (models/kv_sharing.py): its key and value projections, except the one that is the query
  (qk_shared, qkv_shared) and the one that is the other (kv_shared); their LoRA factors and
  MASA kernels only where matmul_params_per_layer counts them. 0 without kv sharing."""
  if cfg.kv_segment is None:
    return 0
  D, KD = cfg.d_model, cfg.kv_heads * cfg.d_head
  skipped = {'none': ('k', 'v'), 'kv_shared': ('k',), 'cem': ('k',), 'qk_shared': ('v',),
             'qkv_shared': ()}[cfg.attention_sharing]
  s = cfg.sharing
  rank = s.lora_rank if s.lora_layers == 'all' else 0   # as matmul_params_per_layer counts
  return sum(D * KD + (rank * (D + KD) if t in s.lora_targets else 0)
             for t in skipped if t not in cfg.atom_kernels)


def router_flops(cfg: ModelConfig, seq_len: int) -> float:
  """Forward FLOPs per token of the routers (models/routing.py): expert choice scores the
  candidates of each recursion (all T, then the k_{r-1} kept; bucketed, model.routing.buckets,
  also every padded token of every recursion in a bucket's scan), token choice every token
  once."""
  D, R = cfg.d_model, cfg.recursions
  if cfg.routing.kind == 'expert_choice':
    per_row = 2 * D * 2 * D + 2 * 2 * D if cfg.routing.router == 'mlp' else 2 * D
    caps = cfg.capacity_tokens(seq_len)
    candidates = (seq_len,) + caps[:-1]
    rows = sum(candidates[b[0]] for b in cfg.expert_buckets)   # each bucket's first routing
    if cfg.routing.buckets:   # + the in-scan router of every recursion, over the padded tokens
      rows += sum(len(b) * caps[b[0]] for b in cfg.expert_buckets)
    return per_row * rows / seq_len
  return 2 * D * 2 * D + 2 * 2 * D * R if cfg.routing.router == 'mlp' else 2 * D * R


def readout_matmul_params(cfg: ModelConfig) -> int:
  """The readout's weights per token: D x V, or a factorized tied readout's D x E projection
  and E x V table (model.embed_dim = E, models/embeddings.py)."""
  D, V, E = cfg.d_model, cfg.vocab_size, cfg.embed_dim
  return D * E + E * V if E and cfg.tie_embeddings else D * V


def lift_matmul_params(cfg: ModelConfig) -> int:
  """A factorized embedding's lift from E to D per token (linear: E x D; self-attentive: q, k,
  v, o and W_1 of E x E, W_2 of E x D); 0 without factorization."""
  E, D = cfg.embed_dim, cfg.d_model
  if not E:
    return 0
  return E * D if cfg.embed_projection == 'linear' else 5 * E * E + E * D


def io_matmul_params(cfg: ModelConfig) -> int:
  """Weights a token multiplies with outside the blocks: the readout and the embedding's lift."""
  return readout_matmul_params(cfg) + lift_matmul_params(cfg)


def io_attention_flops(cfg: ModelConfig, seq_len: int) -> float:
  """The self-attentive embedding's QK^T and PV per token (E wide, causal: halved)."""
  if cfg.embed_dim and cfg.embed_projection == 'self_attentive':
    return 2 * seq_len * cfg.embed_dim
  return 0.0


def attended_length(cfg: ModelConfig, seq_len: int) -> int:
  """The key length summed over the applied layers: T per layer, a sliced loop's layers
  (model.loop_slices, models/attention.py) their slice length."""
  if not cfg.slice_lens:
    return cfg.num_layers * seq_len
  lens = (seq_len,) + cfg.slice_lens
  return sum(min(lens[b], seq_len) for b in cfg.slice_branch)


def flops_per_token(cfg: ModelConfig, seq_len: int, train: bool = True) -> float:
  """Model FLOPs per token on applied depth; causal attention counted at half (MaxText).

  Routed models (model.routing): expert choice counts only the tokens each recursion keeps,
  k_r / T of the matmuls and attention at the subset length k_r, plus the routers (bucketed,
  model.routing.buckets: the executed FLOPs, every recursion of a bucket at its first k). Token
  choice runs every token through every recursion with the exited ones masked (static shapes),
  so its count is the executed FLOPs of the plain recursive model plus the router; the FLOPs
  its routing would need are data-dependent (train metrics routing_capacity_r give the
  realised fractions). Under model.kv_sharing=first the later loops' key and value projections
  are not counted (`kv_params_skipped`). A sliced loop (model.loop_slices) attends within
  slices of n positions: its QK^T and PV cost n / T of full attention's (`attended_length`).
  """
  if cfg.routing.kind == 'expert_choice':
    P, T = matmul_params_per_layer(cfg), seq_len
    HD = cfg.num_heads * cfg.d_head
    routed = cfg.plan.segments[cfg.routed_segment]
    fwd = 2 * io_matmul_params(cfg) + io_attention_flops(cfg, T) + router_flops(cfg, T)
    fwd += (cfg.num_layers - routed.num_applied) * (2 * P + 2 * T * HD)
    ks = cfg.capacity_tokens(T)
    for bucket in cfg.expert_buckets:   # each recursion runs the bucket's first k tokens
      k = ks[bucket[0]]                 # (buckets=0: recursion r alone, k_r of T)
      fwd += len(bucket) * routed.num_sets * (k / T) * (2 * P + 2 * k * HD)
    return 3 * fwd if train else fwd
  matmul = cfg.num_layers * matmul_params_per_layer(cfg) + io_matmul_params(cfg)
  if cfg.kv_segment is not None:   # later loops project no keys or values
    seg = cfg.plan.segments[cfg.kv_segment]
    matmul -= (seg.repeats - 1) * seg.num_sets * kv_params_skipped(cfg)
  # QK^T and PV: 2 * 2 * T * H * Dh per token per layer, halved for the causal mask.
  attn = 2 * attended_length(cfg, seq_len) * cfg.num_heads * cfg.d_head + io_attention_flops(
      cfg, seq_len)
  fwd = 2 * matmul + attn
  if cfg.routing.kind == 'token_choice':
    fwd += router_flops(cfg, seq_len)
  return 3 * fwd if train else fwd
