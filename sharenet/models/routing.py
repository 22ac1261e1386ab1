"""Mixture-of-Recursions routing (Bae et al., "Mixture-of-Recursions: Learning Dynamic Recursive
Depths for Adaptive Token-Level Computation", arXiv:2507.10524): each token gets its own number
of passes through the shared segment of a `cycle` / `middle_cycle` plan. Recursion r is one pass
through the segment's K stored sets (one pass of the loop runner, models/loops.py, driven from
models/stack.py `StoredSegment._routed`).

Expert choice (`expert_choice`): recursion r has its own router; it scores the tokens that
recursion r-1 kept, g = alpha * sigmoid(w_r . h), and keeps the top k_r = max(1, int(c_r * T))
per example (hierarchical: a subset of the previous subset), re-sorted into causal order. Only
those tokens run the K layers, attending among themselves at their original RoPE positions,
and they are updated as the paper's H <- H + g * f(H), where f is the K-layer stack's output
*including* its residual (the reference scatter-adds g times the decoder layers' output, and an
HF decoder layer returns x + branches). Unselected tokens keep their value bit for bit. The
auxiliary loss is the reference's `sampling: aux_loss`: binary cross entropy between router
logits and top-k membership, summed over the candidates and divided by batch x candidates.

Token choice (`token_choice`): one router before the first recursion scores the R depths,
g = alpha * softmax(W h); a token's exit recursion is its top-1 depth. Recursion r runs the
tokens whose exit is >= r (attention among them); a token that has not exited carries the raw
block output on, and the one exiting at r leaves with x_in + g_exit * f(...), x_in the
segment's input. The R recursions have one shape, so they run as one scan (compile time flat
in R); expert choice's subsets have R different static shapes, so R scans, unless
model.routing.buckets groups them into padded, masked scans (`expert_recursion`). Balancing:
Switch-style loss R * sum_i P_i f_i (P_i the mean gate alpha * p_i of depth i, f_i the
fraction of tokens exiting there). Both routers can add the router z-loss (ST-MoE), on by
default for token choice at the reference's 1e-5. Shapes stay static by
running every token through every recursion with the inactive ones masked out of attention
(each its own attention segment) and discarded: the executed FLOPs are those of the plain
recursive model (models/accounting.py). Cached decoding, with recursion-wise KV caches:
models/routed_decoding.py.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict

from sharenet.models.config import ModelConfig
from sharenet.models.params import param

ROUTING = 'routing'   # sown collection: per-recursion aux losses and realised capacities
# Non-trainable collection of loss-free balancing (token choice, model.routing.balancing=bias):
# the exit-score bias, kept in TrainState.tstate and advanced by `update_balance` after each step.
BALANCE = 'balance'


class Router(nn.Module):
  """Router parameters with one row per recursion (leading 'repeats' axis), so the stored tree
  is the same whichever recursion uses a row.

  The output rows have role 'router' (a muP output weight: width in, one logit out), the MLP's
  hidden weights role 'reader'. linear: w (R, D), no bias (the reference's LinearRouter). mlp: a 2-layer GELU MLP with hidden
  2 * d_model, exact erf GELU as torch's nn.GELU in the reference's MLPRouter (expert choice:
  per recursion (R, D, 2D) and (R, 2D); token choice: one shared (D, 2D) and a (R, 2D) output
  with one row per depth).
  """
  cfg: ModelConfig

  def setup(self):
    c = self.cfg
    R, D, pdt = c.recursions, c.d_model, jnp.dtype(c.param_dtype)
    per_recursion = c.routing.kind == 'expert_choice'
    if c.routing.router == 'linear':
      self.w = param(self, 'kernel', (R, D), ('repeats', 'embed'), 'router', std=D ** -0.5,
                     dtype=pdt, num_in=1)
    else:
      shape, axes = ((R, D, 2 * D), ('repeats', 'embed', 'mlp')) if per_recursion else \
          ((D, 2 * D), ('embed', 'mlp'))
      self.w_in = param(self, 'hidden', shape, axes, 'reader', std=D ** -0.5, dtype=pdt,
                        num_in=1)
      self.w = param(self, 'kernel', (R, 2 * D), ('repeats', 'mlp'), 'router',
                     std=(2 * D) ** -0.5, dtype=pdt, num_in=1)
    if c.loss_free:
      self.bias = self.variable(BALANCE, 'bias', jnp.zeros, (R,), jnp.float32)

  def exit_bias(self) -> jax.Array | None:
    """Loss-free balancing's bias on the R exit scores (None without it)."""
    return self.bias.value if self.cfg.loss_free else None

  def expert_logits(self, x_BND: jax.Array, r: int | jax.Array) -> jax.Array:
    """Recursion r's router logits (B, N), in float32 (float64 stays float64)."""
    return expert_logits(self.expert_weights(), x_BND, r)

  def expert_weights(self) -> tuple[jax.Array | None, jax.Array]:
    """(MLP input weights or None, output rows): what `expert_logits` reads, as arrays a scan
    over recursions can broadcast (the bucketed lowering's body, models/stack.py)."""
    return (self.w_in if self.cfg.routing.router == 'mlp' else None), self.w

  def token_logits(self, x_BTD: jax.Array) -> jax.Array:
    """Logits over the R exit depths (B, T, R), in float32 (float64 stays float64)."""
    dt = jnp.promote_types(x_BTD.dtype, jnp.float32)
    x = x_BTD.astype(dt)
    if self.cfg.routing.router == 'mlp':
      x = nn.gelu(x @ self.w_in.astype(dt), approximate=False)
    return jnp.einsum('btd,rd->btr', x, self.w.astype(dt))


def expert_logits(weights: tuple[jax.Array | None, jax.Array], x_BND: jax.Array,
                  r: int | jax.Array) -> jax.Array:
  """Router logits of recursion r (a Python or traced index into the per-recursion rows)."""
  w_in, w = weights
  dt = jnp.promote_types(x_BND.dtype, jnp.float32)
  x = x_BND.astype(dt)
  if w_in is not None:
    x = nn.gelu(x @ w_in[r].astype(dt), approximate=False)
  return x @ w[r].astype(dt)


def _rows(x_BT: jax.Array, idx_BK: jax.Array) -> jax.Array:
  """x[b, idx[b, k]] for (B, T) or (B, T, D) `x`."""
  if x_BT.ndim == 2:
    return jnp.take_along_axis(x_BT, idx_BK, axis=1)
  return jnp.take_along_axis(x_BT, idx_BK[:, :, None], axis=1)


def _route(h_BTD: jax.Array, cand_BN: jax.Array, r: int, k: int, *, cfg: ModelConfig,
           router: Router, sow: Callable[[str, jax.Array], Any]
           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Recursion r's router over its candidates (indices into T, causal order): keeps the top k
  by gate; sows aux_loss_r (BCE), z_loss_r and capacity_r. -> (candidate states, kept indices
  into the candidates, kept indices into T, gates of the candidates), kept indices in causal
  order."""
  B, T, _ = h_BTD.shape
  x_BND = _rows(h_BTD, cand_BN)
  logits_BN = router.expert_logits(x_BND, r)
  gate_BN = cfg.router_alpha * jax.nn.sigmoid(logits_BN)
  # Top-k by a stable sort: exact ties (equal tokens score equally before any layer mixes
  # them) go to the earlier token.
  top_BK = jnp.argsort(-gate_BN, axis=1, stable=True)[:, :k]
  top_BK = jnp.sort(top_BK, axis=1)                    # causal order among the kept tokens
  targets_BN = jnp.zeros_like(logits_BN).at[jnp.arange(B)[:, None], top_BK].set(1.0)
  bce = jnp.sum(optax.sigmoid_binary_cross_entropy(logits_BN, targets_BN)) / logits_BN.size
  sow(f'aux_loss_{r}', bce)
  sow(f'z_loss_{r}', z_loss(logits_BN[:, :, None]))
  sow(f'capacity_{r}', jnp.asarray(k / T, jnp.float32))
  return x_BND, top_BK, _rows(cand_BN, top_BK), gate_BN


class ExpertSteps(NamedTuple):
  """Per recursion of a bucket (the scanned input of its scan over recursions)."""
  r: jax.Array       # recursion index: the router row
  k: jax.Array       # k_r tokens it keeps
  n: jax.Array       # k_{r-1} candidates (the BCE's and z-loss's normaliser)
  first: jax.Array   # the bucket's first recursion, routed before the scan


class ExpertKept(NamedTuple):
  """A bucket's gathered tokens (broadcast across its scan over recursions)."""
  pos_BK: jax.Array | None   # their original positions (RoPE)
  base_BK: jax.Array         # their attention segments (packed documents, or 0)
  alone_BK: jax.Array        # -1 - k: a token out of the recursion is its own segment
  gate_BK: jax.Array         # the first recursion's gates


def expert_recursion(level: Callable, logits: Callable, alpha: float,
                     carry: tuple[jax.Array, jax.Array], step: ExpertSteps, kept: ExpertKept
                     ) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
  """Expert-choice recursion `step.r` on a bucket's gathered tokens, padded: of the tokens the
  previous recursion kept (`carry`'s mask), the top step.k by gate run `level`, attending among
  themselves (each other token is its own attention segment, its row discarded), and are
  updated by h + g f; the others keep their value. The bucket's first recursion was routed
  before the scan (every gathered token runs it, at the gates in `kept`). -> ((states, kept
  mask), (BCE aux loss, z-loss) over the candidates; both 0 for the first recursion, which
  `_route` sowed)."""
  x_BKD, active_BK = carry
  B, K = active_BK.shape
  logits_BK = logits(x_BKD, step.r)
  gate_BK = jnp.where(step.first, kept.gate_BK, alpha * jax.nn.sigmoid(logits_BK))
  # The same stable top-k as `_route`, as a rank among the candidates (k is traced here).
  order_BK = jnp.argsort(jnp.where(active_BK, -gate_BK, jnp.inf), axis=1, stable=True)
  rank_BK = jnp.zeros((B, K), jnp.int32).at[jnp.arange(B)[:, None], order_BK].set(
      jnp.arange(K, dtype=jnp.int32)[None])
  keep_BK = active_BK & (rank_BK < step.k)
  f_BKD, _ = level(x_BKD, kept.pos_BK, jnp.where(keep_BK, kept.base_BK, kept.alone_BK))
  g_BK1 = gate_BK[:, :, None].astype(f_BKD.dtype)
  x_BKD = jnp.where(keep_BK[:, :, None], x_BKD + g_BK1 * f_BKD, x_BKD)
  bce_BK = optax.sigmoid_binary_cross_entropy(logits_BK, keep_BK.astype(logits_BK.dtype))
  bce = jnp.sum(jnp.where(active_BK, bce_BK, 0.0)) / (B * step.n)
  z = jnp.sum(jnp.where(active_BK, jnp.square(logits_BK), 0.0)) / (B * step.n)
  losses = tuple(jnp.where(step.first, jnp.zeros_like(v), v) for v in (bce, z))
  return (x_BKD, keep_BK), losses


def expert_choice(h_BTD: jax.Array, positions_T: jax.Array | None,
                  segment_ids_BT: jax.Array | None, *, cfg: ModelConfig, router: Router,
                  level: Callable, sow: Callable[[str, jax.Array], Any],
                  recurse: Callable | None = None) -> jax.Array:
  """R expert-choice recursions of `level` (the K-layer scan: (x, positions, segment ids) ->
  (x, None)) over `h_BTD`; sows aux_loss_r (BCE), z_loss_r and capacity_r (k_r / T).

  model.routing.buckets=0: each recursion runs `level` on its own k_r gathered tokens (R static
  lengths). Otherwise the recursions of each bucket (cfg.expert_buckets) run as one scan at the
  bucket's first k, padded and masked (`expert_recursion`): `recurse(carry, steps, kept) ->
  (carry, (BCE, z-loss) per step)` is that scan (the model's, models/stack.py); without it a
  Python loop over `level` does.
  """
  B, T, _ = h_BTD.shape
  rows_B1 = jnp.arange(B)[:, None]
  pos_BT = None if positions_T is None else jnp.broadcast_to(positions_T[None], (B, T))
  cand_BN = jnp.broadcast_to(jnp.arange(T)[None], (B, T))   # candidates: indices into T
  ks = cfg.capacity_tokens(T)
  for bucket in cfg.expert_buckets:
    a = bucket[0]
    x_BND, top_BK, sel_BK, gate_BN = _route(h_BTD, cand_BN, a, ks[a], cfg=cfg, router=router,
                                            sow=sow)
    pos_BK = None if pos_BT is None else _rows(pos_BT, sel_BK)
    if not cfg.routing.buckets:     # one recursion per bucket, run at its own k_r
      f_BKD, _ = level(_rows(x_BND, top_BK), pos_BK,
                       None if segment_ids_BT is None else _rows(segment_ids_BT, sel_BK))
      g_BK1 = _rows(gate_BN, top_BK)[:, :, None].astype(f_BKD.dtype)
      h_BTD = h_BTD.at[rows_B1, sel_BK].add(g_BK1 * f_BKD)
      cand_BN = sel_BK
      continue
    K = ks[a]
    base_BK = (jnp.zeros((B, K), jnp.int32) if segment_ids_BT is None
               else _rows(segment_ids_BT, sel_BK))
    alone_BK = jnp.broadcast_to(-1 - jnp.arange(K, dtype=base_BK.dtype)[None], (B, K))
    kept = ExpertKept(pos_BK, base_BK, alone_BK, _rows(gate_BN, top_BK))
    steps = ExpertSteps(jnp.asarray(bucket, jnp.int32),
                        jnp.asarray([ks[r] for r in bucket], jnp.int32),
                        jnp.asarray([ks[r - 1] if r else T for r in bucket], jnp.float32),
                        jnp.arange(len(bucket)) == 0)
    carry = (_rows(x_BND, top_BK), jnp.ones((B, K), bool))
    if recurse is not None:
      carry, (bce_M, z_M) = recurse(carry, steps, kept)
    else:
      per_step = []
      for i in range(len(bucket)):
        carry, losses = expert_recursion(level, router.expert_logits, cfg.router_alpha, carry,
                                         jax.tree.map(lambda v: v[i], steps), kept)
        per_step.append(losses)
      bce_M, z_M = (jnp.stack(v) for v in zip(*per_step))
    for i, r in enumerate(bucket[1:], 1):
      sow(f'aux_loss_{r}', bce_M[i])
      sow(f'z_loss_{r}', z_M[i])
      sow(f'capacity_{r}', jnp.asarray(ks[r] / T, jnp.float32))
    x_BKD, keep_BK = carry
    h_BTD = h_BTD.at[rows_B1, sel_BK].set(x_BKD)
    # The last recursion's kept tokens (exactly k of them), in causal order.
    cand_BN = _rows(sel_BK, jnp.argsort(~keep_BK, axis=1, stable=True)[:, :ks[bucket[-1]]])
  return h_BTD


class TokenRoutes(NamedTuple):
  """What every token-choice recursion reads (broadcast across the scan over recursions)."""
  x_in_BTD: jax.Array    # the segment's input
  exit_BT: jax.Array     # exit recursion of each token
  w_BT1: jax.Array       # its gate alpha * p_exit
  base_BT: jax.Array     # attention segment of the active tokens (packed documents, or 0)
  alone_BT: jax.Array    # -1 - t: an exited token is its own attention segment


def token_recursion(level: Callable, r: jax.Array | int, carry: tuple[jax.Array, jax.Array],
                    routes: TokenRoutes, positions_T: jax.Array | None
                    ) -> tuple[jax.Array, jax.Array]:
  """Token-choice recursion r on (current states, outputs) at full length: the tokens whose
  exit is >= r run `level` attending among themselves (an exited token is its own segment, so
  no active token sees it; its own row is discarded); a token exiting at r leaves with
  x_in + g * f, the others carry f on."""
  cur_BTD, out_BTD = carry
  active_BT = routes.exit_BT >= r
  seg_BT = jnp.where(active_BT, routes.base_BT, routes.alone_BT)
  f_BTD, _ = level(cur_BTD, positions_T, seg_BT)
  out_BTD = jnp.where((routes.exit_BT == r)[:, :, None], routes.x_in_BTD + routes.w_BT1 * f_BTD,
                      out_BTD)
  return jnp.where(active_BT[:, :, None], f_BTD, cur_BTD), out_BTD


def token_route(h_BTD: jax.Array, *, cfg: ModelConfig, router: Router,
                bias_R: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Each token's exit from its own segment input (causal: training and cached decoding read
  the same): (logits (B, T, R), probabilities, exit recursion (B, T), gate alpha * p_exit
  (B, T, 1)); `bias_R` as in `token_choice`."""
  logits_BTR = router.token_logits(h_BTD)
  probs_BTR = jax.nn.softmax(logits_BTR, axis=-1)
  scores_BTR = cfg.router_alpha * probs_BTR
  if bias_R is not None:
    scores_BTR = scores_BTR + jax.lax.stop_gradient(bias_R).astype(scores_BTR.dtype)[None, None]
  exit_BT = jnp.argmax(scores_BTR, axis=-1)
  w_BT1 = cfg.router_alpha * jnp.take_along_axis(probs_BTR, exit_BT[:, :, None], axis=2)
  return logits_BTR, probs_BTR, exit_BT, w_BT1


def token_choice(h_BTD: jax.Array, positions_T: jax.Array | None,
                 segment_ids_BT: jax.Array | None, *, cfg: ModelConfig, router: Router,
                 sow: Callable[[str, jax.Array], Any], level: Callable | None = None,
                 recurse: Callable | None = None, bias_R: jax.Array | None = None
                 ) -> jax.Array:
  """R token-choice recursions (masked at full length); sows aux_loss_0 (balancing), z_loss_0,
  capacity_r (fraction of tokens that run recursion r) and exit_r (fraction exiting at r).

  `bias_R` (loss-free balancing): added to the scores alpha * p that pick each token's exit;
  the gate stays alpha * p_exit, unbiased, and no gradient reaches the bias (the reference's
  token_choice_router.py with balancing loss_free).

  `recurse(carry, routes, positions_T) -> out` runs all R `token_recursion`s (the model: one
  scan over recursions, models/stack.py); without it, a Python loop over `level` does.
  """
  B, T, _ = h_BTD.shape
  R = cfg.recursions
  logits_BTR, probs_BTR, exit_BT, w_BT1 = token_route(h_BTD, cfg=cfg, router=router, bias_R=bias_R)
  frac_R = jnp.mean(jax.nn.one_hot(exit_BT, R, dtype=jnp.float32), axis=(0, 1))
  for r in range(R):
    sow(f'exit_{r}', frac_R[r])
  # The reference's P_i averages its router_probs, alpha * softmax (token_choice_router.py).
  sow('aux_loss_0', R * jnp.sum(cfg.router_alpha * jnp.mean(probs_BTR, axis=(0, 1)) * frac_R))
  sow('z_loss_0', z_loss(logits_BTR))
  for r in range(R):
    sow(f'capacity_{r}', jnp.mean((exit_BT >= r).astype(jnp.float32)))
  base_BT = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
  alone_BT = jnp.broadcast_to(-1 - jnp.arange(T, dtype=base_BT.dtype)[None], (B, T))
  routes = TokenRoutes(h_BTD, exit_BT, w_BT1.astype(h_BTD.dtype), base_BT, alone_BT)
  if recurse is not None:
    return recurse((h_BTD, h_BTD), routes, positions_T)
  carry = (h_BTD, h_BTD)
  for r in range(R):
    carry = token_recursion(level, r, carry, routes, positions_T)
  return carry[1]


def update_balance(cfg: ModelConfig, balance: Any, metrics: dict[str, jax.Array]) -> Any:
  """One step of loss-free balancing (the reference's trainer_pt.py, after the optimizer step):
  b_i += bias_rate * sign(1/R - f_i), f_i the step's fraction of tokens exiting at depth i
  (metrics 'routing_exit_i', averaged over micro-batches and the global batch)."""
  R = cfg.recursions
  f_R = jnp.stack([metrics[f'routing_exit_{r}'] for r in range(R)]).astype(jnp.float32)
  step_R = cfg.routing.bias_rate * jnp.sign(1.0 / R - f_R)
  return jax.tree.map(lambda b: b + step_R.astype(b.dtype), balance)


def z_loss(logits_BNE: jax.Array) -> jax.Array:
  """Router z-loss (Zoph et al., ST-MoE, arXiv:2202.08906; the MoR reference's router_z_loss):
  the mean over tokens of logsumexp(logits)^2, the last axis the router's outputs (expert
  choice has one per token: its logit squared)."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits_BNE, axis=-1)))


def collected(routing_vars: Any) -> dict[str, jax.Array]:
  """{'aux_loss_r' / 'z_loss_r' / 'capacity_r' / 'exit_r': scalar} from the sown ROUTING
  collection."""
  out = {}
  for path, leaf in flatten_dict(routing_vars).items():
    values = leaf if isinstance(leaf, tuple) else (leaf,)
    out[path[-1]] = sum(values[1:], values[0])
  return out


def aux_loss(cfg: ModelConfig, routing_vars: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(aux coefficient x summed aux losses + z coefficient x summed z-losses, train metrics
  'routing_<name>', unweighted) of one forward pass."""
  vals = collected(routing_vars)
  summed = lambda prefix: sum((v for k, v in vals.items() if k.startswith(prefix)), jnp.zeros(()))
  metrics = {f'routing_{k}': v for k, v in vals.items()}
  return cfg.aux_loss_coeff * summed('aux_loss') + cfg.z_loss_coeff * summed('z_loss'), metrics
