"""Experts in the feed-forward's place (model.moe; docs/experts.md).

sigma_moe (MoEUT, Csordas et al., arXiv:2405.16039, Sec. 2.1 and reference code moeut.py
SigmaMoE): a selector s = sigmoid(x W_S^T) over E small ReLU experts, the top-k of s run and
y = sum_{e in topk(s)} s_e ReLU(x K_e) V_e (the paper's Eq. 3-5). Its regularizer is the
negative entropy of the selection distribution averaged over a sequence's tokens,
sum_e p_e log p_e with p = mean_t softmax(x_t W_S^T) (MoEUT's entropy_reg), times
model.moe.entropy_reg. Init as MoEUT's: selector and K ~ N(0, 1/D), V ~ N(0, 1/(E F)) (without
its depth scale sqrt(2 / n_layers), which the rest of the model does not use either, and
without the selector rows' unit-norm renormalisation).

switch (Switch Transformer, Fedus et al., arXiv:2101.03961, Sec. 2.1-2.2): p = softmax(x W_r^T),
each token runs its argmax expert, scaled by that probability; an expert takes at most
C = ceil(capacity_factor * N / E) of the call's N tokens in token order, and the others are
dropped: the branch adds nothing, so the residual carries them. Load balancing: E sum_i f_i P_i
(Eq. 4-6: f_i the fraction of tokens whose argmax is i, P_i the mean probability of i), times
model.moe.balance_loss. Its experts are the model's MLP (model.mlp: swiglu or gelu).

The experts are parameters of the block: stored with its set and tied where the block is tied,
as (experts, in, out) stacks whose leading 'experts' axis is a stack axis (params.STACK_AXES):
each expert's matrices are reader / writer kernels of their own fan-in, the selector a 'router'
(muP output weight), and the 'experts' axis shards over mesh.expert. With
model.moe.router_per_layer the selector is a per-layer part instead (the PER_LAYER collection,
one per applied layer, like untied norm gains): a tied set's experts are shared by its uses and
each use routes with its own selector, as the shared-expert Conformer (Bai et al., arXiv:2209.08326:
"the MoE routers and normalization individually" per block of a shared group).

Dispatch (model.moe.dispatch): the N k (token, expert) pairs are sorted by expert, the sorted
rows multiplied by their expert's matrices as one grouped matmul, and the products scattered
back weighted by their gates. `ragged_dot` is jax.lax.ragged_dot (a native grouped matmul on GPU
and TPU; XLA:CPU expands it to every expert's matmul masked, E times the work); `reference` runs
the sorted rows in row blocks, each block padded to one expert, one matmul per block (the
work executed: the routed rows plus at most one block of padding per expert). `auto`:
ragged_dot on GPU / TPU, reference on CPU.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet import kernels as kernel_lib
from sharenet.models.config import ModelConfig
from sharenet.models.layers import sow_l1
from sharenet.models.mlp import BRANCH, swiglu
from sharenet.models.params import PER_LAYER, param

MOE = 'moe'       # sown collection: the forward pass's summed weighted aux loss (models/lm.py)
BLOCK_ROWS = 64   # rows of one reference block (the padding per expert is below one block)


def dispatch_of(cfg: ModelConfig) -> str:
  """The grouped matmul model.moe.dispatch runs on this backend: ragged_dot | reference."""
  d = cfg.moe.dispatch
  if d == 'auto':
    return 'ragged_dot' if kernel_lib.backend() in kernel_lib.ACCELERATORS else 'reference'
  return d


def blocked_matmul(x_MD: jax.Array, w_EDF: jax.Array, sizes_E: jax.Array,
                   block: int = BLOCK_ROWS) -> jax.Array:
  """Rows sorted by group (group e holds sizes_E[e] consecutive rows) times their group's
  matrix: each group's rows padded to whole blocks of `block` rows, one matmul per block."""
  M, E = x_MD.shape[0], w_EDF.shape[0]
  n_blocks = -(-M // block) + E   # static bound: every group pads less than one block
  padded_E = -(-sizes_E // block) * block
  end_E, pend_E = jnp.cumsum(sizes_E), jnp.cumsum(padded_E)
  rows_M = jnp.arange(M)
  group_M = jnp.minimum(jnp.searchsorted(end_E, rows_M, side='right'), E - 1)
  dest_M = (pend_E - padded_E)[group_M] + rows_M - (end_E - sizes_E)[group_M]
  x_PD = jnp.zeros((n_blocks * block, x_MD.shape[1]), x_MD.dtype).at[dest_M].set(x_MD)
  group_B = jnp.minimum(jnp.searchsorted(pend_E, jnp.arange(n_blocks) * block, side='right'),
                        E - 1)
  y_BbF = jax.lax.map(lambda a: a[0] @ w_EDF[a[1]].astype(x_MD.dtype),
                      (x_PD.reshape(n_blocks, block, -1), group_B))
  return y_BbF.reshape(n_blocks * block, -1)[dest_M]


def grouped_matmul(x_MD: jax.Array, w_EDF: jax.Array, sizes_E: jax.Array,
                   dispatch: str) -> jax.Array:
  """x_MD (rows sorted by expert) times each row's expert matrix -> (M, F)."""
  if dispatch == 'ragged_dot':
    return jax.lax.ragged_dot(x_MD, w_EDF.astype(x_MD.dtype), sizes_E.astype(jnp.int32))
  return blocked_matmul(x_MD, w_EDF, sizes_E)


def sigma_select(logits_NE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """sigma-MoE: (experts (N, k), gates sigmoid(logit) (N, k)) of the top-k logits."""
  top_NK, experts_NK = jax.lax.top_k(logits_NE, k)
  return experts_NK, jax.nn.sigmoid(top_NK)


def switch_select(logits_NE: jax.Array, capacity_factor: float
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Switch: (argmax experts (N, 1), gates (N, 1): the softmax probability, 0 where dropped,
  kept (N,) bool). Expert e keeps its first ceil(capacity_factor N / E) tokens in token order."""
  N, E = logits_NE.shape
  probs_NE = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
  expert_N = jnp.argmax(probs_NE, axis=-1)
  onehot_NE = jax.nn.one_hot(expert_N, E, dtype=jnp.int32)
  position_N = jnp.sum((jnp.cumsum(onehot_NE, axis=0) - 1) * onehot_NE, axis=-1)
  kept_N = position_N < capacity(capacity_factor, N, E)
  gate_N = jnp.take_along_axis(probs_NE, expert_N[:, None], axis=-1)[:, 0] * kept_N
  return expert_N[:, None], gate_N[:, None].astype(logits_NE.dtype), kept_N


def capacity(capacity_factor: float, tokens: int, experts: int) -> int:
  """Switch's expert capacity: ceil(capacity_factor * tokens / experts) tokens."""
  return int(math.ceil(capacity_factor * tokens / experts))


def entropy_reg(logits_BTE: jax.Array) -> jax.Array:
  """MoEUT's selection regularizer: mean over sequences of sum_e p_e log p_e (the negative
  entropy), p the sequence's mean softmax of the selection logits (log-space, as moeut.py)."""
  logp_BTE = jax.nn.log_softmax(logits_BTE.astype(jnp.float32), axis=-1)
  logmean_BE = jax.nn.logsumexp(logp_BTE, axis=1) - math.log(logits_BTE.shape[1])
  return jnp.mean(jnp.sum(jnp.exp(logmean_BE) * logmean_BE, axis=-1))


def balance_loss(logits_NE: jax.Array) -> jax.Array:
  """Switch's load-balancing loss E sum_i f_i P_i (f_i: fraction of tokens whose argmax is i,
  P_i: mean router probability of i)."""
  E = logits_NE.shape[-1]
  probs_NE = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
  f_E = jnp.mean(jax.nn.one_hot(jnp.argmax(probs_NE, axis=-1), E), axis=0)
  return E * jnp.sum(f_E * jnp.mean(probs_NE, axis=0))


def combine(x_ND: jax.Array, experts_NK: jax.Array, gates_NK: jax.Array, expert_fn,
            num_experts: int) -> jax.Array:
  """sum_j gate_nj f_{e_nj}(x_n): the N k pairs sorted by expert, `expert_fn(rows sorted by
  expert, group sizes)` run once over them, the gated products summed back per token."""
  N, K = experts_NK.shape
  e_M = experts_NK.reshape(-1)
  order_M = jnp.argsort(e_M, stable=True)
  token_M = order_M // K
  sizes_E = jnp.bincount(e_M, length=num_experts)
  y_MD = expert_fn(x_ND[token_M], sizes_E)
  y_MD = y_MD * gates_NK.reshape(-1)[order_M][:, None].astype(y_MD.dtype)
  return jnp.zeros((N, y_MD.shape[-1]), y_MD.dtype).at[token_M].add(y_MD)


class MoeFfn(nn.Module):
  """x (B, T, D) -> (feed-forward output (B, T, D), weighted aux loss of this application)."""
  cfg: ModelConfig

  def _kernel(self, name, shape, axes, role, std, collection='params'):
    c = self.cfg
    return param(self, name, (c.moe.num_experts,) + shape, ('experts',) + axes, role, std=std,
                 dtype=jnp.dtype(c.param_dtype), num_in=1, branch=BRANCH,
                 writes=role == 'writer', collection=collection)

  @nn.compact
  def __call__(self, x_BTD: jax.Array, select_BTD: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """`select_BTD` (model.norm.placement=moeut): what the selector reads instead of x (the
    normed stream, where the experts read the un-normalised one, as the reference's
    sel_input)."""
    c = self.cfg
    mo, E, F, D = c.moe, c.moe.num_experts, c.moe_expert_dim, c.d_model
    B, T, _ = x_BTD.shape
    dt = jnp.dtype(c.dtype)
    sigma = mo.kind == 'sigma_moe'
    # the selector: one row per expert (E, D), a muP output weight like the recursion routers
    w_sel = self._kernel('router_kernel', (D,), ('embed',), 'router', D ** -0.5,
                         PER_LAYER if mo.router_per_layer else 'params')
    sel_BTD = x_BTD if select_BTD is None else select_BTD
    logits_BTE = jnp.einsum('btd,ed->bte', sel_BTD.astype(dt), w_sel.astype(dt))
    logits_NE = logits_BTE.reshape(B * T, E)
    gelu_in = not sigma and c.mlp == 'gelu'
    ins = ('wi',) if sigma or gelu_in else ('wi_gate', 'wi_up')   # switch: model.mlp's form
    w_in = {n: self._kernel(n + '_kernel', (D, F), ('embed', 'mlp'), 'reader', D ** -0.5)
            for n in ins}
    w_out = self._kernel('wo_kernel', (F, D), ('mlp', 'embed'), 'writer',
                         (E * F) ** -0.5 if sigma else F ** -0.5)
    dispatch = dispatch_of(c)

    def experts(x_MD, sizes_E):
      mm = lambda w, x: grouped_matmul(x, w, sizes_E, dispatch)
      if sigma:
        h_MF = jax.nn.relu(mm(w_in['wi'], x_MD))
      elif gelu_in:
        h_MF = nn.gelu(mm(w_in['wi'], x_MD))
      else:
        h_MF = swiglu(mm(w_in['wi_gate'], x_MD), mm(w_in['wi_up'], x_MD))
      return mm(w_out, h_MF)

    if sigma:
      experts_NK, gates_NK = sigma_select(logits_NE, c.moe_top_k)
      aux = mo.entropy_reg * c.plan.num_unique / c.num_layers * entropy_reg(logits_BTE)
    else:
      experts_NK, gates_NK, _ = switch_select(logits_NE, mo.capacity_factor)
      aux = mo.balance_loss * balance_loss(logits_NE)
    out_ND = combine(x_BTD.reshape(B * T, D).astype(dt), experts_NK, gates_NK, experts, E)
    out_BTD = out_ND.reshape(B, T, D)
    sow_l1(self, 'mlp_out', out_BTD)
    return out_BTD, aux.astype(jnp.float32)
