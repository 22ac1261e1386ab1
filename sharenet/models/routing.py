"""Mixture-of-Recursions routing (Bae et al., "Mixture-of-Recursions: Learning Dynamic Recursive
Depths for Adaptive Token-Level Computation", arXiv:2507.10524): each token gets its own number
of passes through the shared segment of a `cycle` / `middle_cycle` plan. Recursion r is one pass
through the segment's K stored sets (one inner scan, models/stack.py `RoutedSegment`).

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
in R); expert choice's subsets have R different static shapes, so R scans. Balancing:
Switch-style loss R * sum_i P_i f_i (P_i the mean router
probability of depth i, f_i the fraction of tokens exiting there). Shapes stay static by
running every token through every recursion with the inactive ones masked out of attention
(each its own attention segment) and discarded: the executed FLOPs are those of the plain
recursive model (models/accounting.py).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict

from sharenet.models.config import ModelConfig
from sharenet.params import param

ROUTING = 'routing'   # sown collection: per-recursion aux losses and realised capacities


class Router(nn.Module):
  """Router parameters with one row per recursion (leading 'repeats' axis), so the stored tree
  is the same whichever recursion uses a row.

  linear: w (R, D), no bias (the reference's LinearRouter). mlp: a 2-layer GELU MLP with hidden
  2 * d_model (expert choice: per recursion (R, D, 2D) and (R, 2D); token choice: one shared
  (D, 2D) and a (R, 2D) output with one row per depth).
  """
  cfg: ModelConfig

  def setup(self):
    c = self.cfg
    R, D, pdt = c.recursions, c.d_model, jnp.dtype(c.param_dtype)
    per_recursion = c.routing == 'expert_choice'
    if c.routing_router == 'linear':
      self.w = param(self, 'kernel', (R, D), ('repeats', 'embed'), 'reader', std=D ** -0.5,
                     dtype=pdt, num_in=1)
    else:
      shape, axes = ((R, D, 2 * D), ('repeats', 'embed', 'mlp')) if per_recursion else \
          ((D, 2 * D), ('embed', 'mlp'))
      self.w_in = param(self, 'hidden', shape, axes, 'reader', std=D ** -0.5, dtype=pdt,
                        num_in=1)
      self.w = param(self, 'kernel', (R, 2 * D), ('repeats', 'mlp'), 'reader',
                     std=(2 * D) ** -0.5, dtype=pdt, num_in=1)

  def expert_logits(self, x_BND: jax.Array, r: int) -> jax.Array:
    """Recursion r's router logits (B, N), in float32 (float64 stays float64)."""
    dt = jnp.promote_types(x_BND.dtype, jnp.float32)
    x = x_BND.astype(dt)
    if self.cfg.routing_router == 'mlp':
      x = nn.gelu(x @ self.w_in[r].astype(dt))
    return x @ self.w[r].astype(dt)

  def token_logits(self, x_BTD: jax.Array) -> jax.Array:
    """Logits over the R exit depths (B, T, R), in float32 (float64 stays float64)."""
    dt = jnp.promote_types(x_BTD.dtype, jnp.float32)
    x = x_BTD.astype(dt)
    if self.cfg.routing_router == 'mlp':
      x = nn.gelu(x @ self.w_in.astype(dt))
    return jnp.einsum('btd,rd->btr', x, self.w.astype(dt))


def _rows(x_BT: jax.Array, idx_BK: jax.Array) -> jax.Array:
  """x[b, idx[b, k]] for (B, T) or (B, T, D) `x`."""
  if x_BT.ndim == 2:
    return jnp.take_along_axis(x_BT, idx_BK, axis=1)
  return jnp.take_along_axis(x_BT, idx_BK[:, :, None], axis=1)


def expert_choice(h_BTD: jax.Array, positions_T: jax.Array | None,
                  segment_ids_BT: jax.Array | None, *, cfg: ModelConfig, router: Router,
                  level: Callable, sow: Callable[[str, jax.Array], Any]) -> jax.Array:
  """R expert-choice recursions of `level` (the K-layer scan: (x, positions, segment ids) ->
  (x, None)) over `h_BTD`; sows aux_loss_r (BCE) and capacity_r (k_r / T)."""
  B, T, _ = h_BTD.shape
  rows_B1 = jnp.arange(B)[:, None]
  pos_BT = None if positions_T is None else jnp.broadcast_to(positions_T[None], (B, T))
  cand_BN = jnp.broadcast_to(jnp.arange(T)[None], (B, T))   # candidates: indices into T
  for r, k in enumerate(cfg.capacity_tokens(T)):
    x_BND = _rows(h_BTD, cand_BN)
    logits_BN = router.expert_logits(x_BND, r)
    gate_BN = cfg.alpha * jax.nn.sigmoid(logits_BN)
    # Top-k by a stable sort: exact ties (equal tokens score equally before any layer mixes
    # them) go to the earlier token.
    top_BK = jnp.argsort(-gate_BN, axis=1, stable=True)[:, :k]
    top_BK = jnp.sort(top_BK, axis=1)                  # causal order among the kept tokens
    sel_BK = _rows(cand_BN, top_BK)                    # their positions in the sequence
    f_BKD, _ = level(_rows(x_BND, top_BK), None if pos_BT is None else _rows(pos_BT, sel_BK),
                     None if segment_ids_BT is None else _rows(segment_ids_BT, sel_BK))
    g_BK1 = _rows(gate_BN, top_BK)[:, :, None].astype(f_BKD.dtype)
    h_BTD = h_BTD.at[rows_B1, sel_BK].add(g_BK1 * f_BKD)
    targets_BN = jnp.zeros_like(logits_BN).at[rows_B1, top_BK].set(1.0)
    bce = jnp.sum(optax.sigmoid_binary_cross_entropy(logits_BN, targets_BN)) / logits_BN.size
    sow(f'aux_loss_{r}', bce)
    sow(f'capacity_{r}', jnp.asarray(k / T, jnp.float32))
    cand_BN = sel_BK
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


def token_choice(h_BTD: jax.Array, positions_T: jax.Array | None,
                 segment_ids_BT: jax.Array | None, *, cfg: ModelConfig, router: Router,
                 sow: Callable[[str, jax.Array], Any], level: Callable | None = None,
                 recurse: Callable | None = None) -> jax.Array:
  """R token-choice recursions (masked at full length); sows aux_loss_0 (balancing) and
  capacity_r (fraction of tokens that run recursion r).

  `recurse(carry, routes, positions_T) -> out` runs all R `token_recursion`s (the model: one
  scan over recursions, models/stack.py); without it, a Python loop over `level` does.
  """
  B, T, _ = h_BTD.shape
  R = cfg.recursions
  logits_BTR = router.token_logits(h_BTD)
  probs_BTR = jax.nn.softmax(logits_BTR, axis=-1)
  exit_BT = jnp.argmax(probs_BTR, axis=-1)
  w_BT1 = cfg.alpha * jnp.take_along_axis(probs_BTR, exit_BT[:, :, None], axis=2)
  frac_R = jnp.mean(jax.nn.one_hot(exit_BT, R, dtype=jnp.float32), axis=(0, 1))
  sow('aux_loss_0', R * jnp.sum(jnp.mean(probs_BTR, axis=(0, 1)) * frac_R))
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


def collected(routing_vars: Any) -> dict[str, jax.Array]:
  """{'aux_loss_r' / 'capacity_r': scalar} from the sown ROUTING collection."""
  out = {}
  for path, leaf in flatten_dict(routing_vars).items():
    values = leaf if isinstance(leaf, tuple) else (leaf,)
    out[path[-1]] = sum(values[1:], values[0])
  return out


def aux_loss(cfg: ModelConfig, routing_vars: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(coefficient x summed aux losses, train metrics 'routing_<name>') of one forward pass."""
  vals = collected(routing_vars)
  total = sum((v for k, v in vals.items() if k.startswith('aux_loss')), jnp.zeros(()))
  metrics = {f'routing_{k}': v for k, v in vals.items()}
  return cfg.aux_loss_coeff * total, metrics
