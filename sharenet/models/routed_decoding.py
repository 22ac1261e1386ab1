"""Cached decoding of a Mixture-of-Recursions model with recursion-wise KV caching.

Bae et al., "Mixture-of-Recursions" (arXiv:2507.10524), recursion-wise KV caching: a token's
keys and values exist only at the recursions it was routed through. The routed segment's cache
(`RoutedCache`) holds its R recursions' K layers each, as a plain cycle segment's, plus the
number of recursions each slot's token ran (`depth_BS`). At recursion r:

* a query attends only to the cached tokens that reached r (a slot with depth <= r has its
  key position hidden, as if empty), itself included when it runs r;
* the new tokens that do not run r are not written: their entries at r's K layers keep what
  the slot held (zeros in a fresh cache), so a token leaving after recursion r has nothing in
  the caches of the recursions after r.

The K layers of recursion r are the loop runner's pass (`loops.one_loop`) at full length,
every new token through them (static shapes); the tokens that do not run r discard the result.

Which tokens run recursion r:

* token choice: the exit of `routing.token_route` (each token's own segment input: causal),
  exactly as in training, whose attention at recursion r hides the tokens not routed to r
  (each its own segment). Cached greedy decoding therefore equals the full forward's argmax
  (tests/models/test_routed_decoding.py).
* expert choice: training keeps the top k_r of the sequence, which reads later tokens. Decoding
  decides per token: a token that ran r-1 runs r when its router's BCE-trained probability
  sigmoid(logit_r) >= 0.5 (the membership prediction the reference's `sampling: aux_loss`
  trains and scores, model/mor_model/expert_choice_router.py); a recursion of capacity 1 keeps
  every candidate, as its top-k does in training. docs/routing.md says how this differs.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from sharenet.errors import ConfigError
from sharenet.models import routing
from sharenet.models.attention import DecodeStep, LayerCache
from sharenet.models.block import Stream
from sharenet.models.config import ModelConfig

# sigmoid(logit) >= 0.5: the BCE-trained membership prediction (module docstring).
KEEP_PROBABILITY = 0.5


class RoutedCache(NamedTuple):
  """The routed segment's cache: its R*K applied layers' keys and values (a LayerCache stacked
  over them, recursion-major) and the recursions each slot's token ran (B, S) int32 (0: none,
  or an empty slot)."""
  kv: LayerCache
  depth_BS: jax.Array


def with_depths(cfg: ModelConfig, caches: tuple[LayerCache, ...]) -> tuple:
  """init_cache's per-segment caches with the routed segment's wrapped in a RoutedCache (no
  change without routing)."""
  i = cfg.routed_segment
  if i is None:
    return caches
  k = caches[i].k_BSKD
  return caches[:i] + (RoutedCache(caches[i], jnp.zeros(k.shape[1:3], jnp.int32)),) + \
      caches[i + 1:]


def _keep_unrouted(old_K, new_K, active_BT: jax.Array, index: jax.Array):
  """`new_K` with the entries of this call's tokens that did not run the recursion (slots
  index.. index+T) restored from `old_K`: those tokens are not written."""
  T = active_BT.shape[1]

  def leaf(old, new):   # (K, B, S, Kh, Dh)
    cut = lambda a: jax.lax.dynamic_slice_in_dim(a, index, T, axis=2)
    kept = jnp.where(active_BT[None, :, :, None, None], cut(new), cut(old))
    return jax.lax.dynamic_update_slice_in_dim(new, kept, index, axis=2)

  return jax.tree.map(leaf, old_K, new_K)


def _recursion(loop_at: Callable, step: DecodeStep, depth_BS: jax.Array, r: jax.Array,
               x_BTD: jax.Array, active_BT: jax.Array, kv_K) -> tuple[jax.Array, LayerCache]:
  """Recursion r's K layers on the new tokens at full length: keys of the tokens that did not
  reach r hidden, entries of the new tokens that do not run r left unwritten. -> (output
  stream, the recursion's updated K layers)."""
  reached_BS = jax.lax.dynamic_update_slice_in_dim(depth_BS > r, active_BT, step.index, axis=1)
  step_r = step._replace(key_positions_BS=jnp.where(reached_BS, step.key_positions_BS, -1))
  out, (new_K, _) = loop_at(step_r)(Stream(x_BTD), (None, kv_K))
  return out.x_BTD, _keep_unrouted(kv_K, new_K, active_BT, step.index)


def decode(cfg: ModelConfig, router: routing.Router, loop_at: Callable, x_BTD: jax.Array,
           step: DecodeStep, cache: RoutedCache, bias_R: jax.Array | None = None
           ) -> tuple[jax.Array, RoutedCache]:
  """The routed segment's cached pass over this call's tokens (module docstring): (stream out,
  updated cache). `loop_at(step)` is the runner's pass through the K stored sets under a
  decode step (loops.one_loop); `bias_R` token choice's loss-free balancing bias."""
  if not isinstance(cache, RoutedCache):
    raise ConfigError(f'model.routing.kind={cfg.routing.kind!r} decodes with recursion-wise '
                      f'caches; valid: lm.init_cache(cfg, ...) of the routed model\'s own config')
  R = cfg.recursions
  kv_R = jax.tree.map(lambda a: a.reshape((R, -1) + a.shape[1:]), cache.kv)
  run = lambda r, x, active, kv_K: _recursion(loop_at, step, cache.depth_BS, r, x, active, kv_K)
  if cfg.routing.kind == 'token_choice':
    x_in_BTD = x_BTD
    _, _, exit_BT, w_BT1 = routing.token_route(x_in_BTD, cfg=cfg, router=router, bias_R=bias_R)
    w_BT1 = w_BT1.astype(x_in_BTD.dtype)

    def token_body(carry, xs):   # routing.token_recursion's update, on the cached pass
      (cur_BTD, out_BTD), (r, kv_K) = carry, xs
      active_BT = exit_BT >= r
      f_BTD, kv_K = run(r, cur_BTD, active_BT, kv_K)
      out_BTD = jnp.where((exit_BT == r)[:, :, None], x_in_BTD + w_BT1 * f_BTD, out_BTD)
      return (jnp.where(active_BT[:, :, None], f_BTD, cur_BTD), out_BTD), kv_K

    (_, x_BTD), kv_R = jax.lax.scan(token_body, (x_in_BTD, x_in_BTD), (jnp.arange(R), kv_R))
    depth_BT = (exit_BT + 1).astype(jnp.int32)
  else:
    weights = router.expert_weights()
    keep_all_R = jnp.asarray([c >= 1.0 for c in cfg.capacities])
    threshold = jnp.log(KEEP_PROBABILITY / (1 - KEEP_PROBABILITY))   # sigmoid(l) >= p

    def expert_body(carry, xs):   # h <- h + g f(h) for the tokens that run recursion r
      (h_BTD, ran_BT), (r, kv_K) = carry, xs
      logits_BT = routing.expert_logits(weights, h_BTD, r)
      active_BT = ran_BT & (keep_all_R[r] | (logits_BT >= threshold))
      f_BTD, kv_K = run(r, h_BTD, active_BT, kv_K)
      g_BT1 = (cfg.router_alpha * jax.nn.sigmoid(logits_BT))[:, :, None].astype(f_BTD.dtype)
      h_BTD = jnp.where(active_BT[:, :, None], h_BTD + g_BT1 * f_BTD, h_BTD)
      return (h_BTD, active_BT), (kv_K, active_BT)

    ran_BT = jnp.ones(x_BTD.shape[:2], bool)
    (x_BTD, _), (kv_R, active_RBT) = jax.lax.scan(expert_body, (x_BTD, ran_BT),
                                                  (jnp.arange(R), kv_R))
    depth_BT = jnp.sum(active_RBT, axis=0, dtype=jnp.int32)
  kv = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), kv_R)
  depth_BS = jax.lax.dynamic_update_slice_in_dim(cache.depth_BS, depth_BT, step.index, axis=1)
  return x_BTD, RoutedCache(kv, depth_BS)


def held_layers(cache: RoutedCache, held_BS: jax.Array, num_sets: int) -> jax.Array:
  """Applied layers whose keys and values the routed segment holds per held token (slots
  `held_BS`): K times the mean recursions those tokens ran."""
  n = jnp.maximum(jnp.sum(held_BS), 1)
  return num_sets * jnp.sum(jnp.where(held_BS, cache.depth_BS, 0)) / n
