"""KV across loops: recursive KV sharing of the looped segment (model.kv_sharing=first).

Bae et al., "Mixture-of-Recursions: Learning Dynamic Recursive Depths for Adaptive Token-Level
Computation" (arXiv:2507.10524), section 2.2.2, KV caching strategies, *recursive KV sharing*:
the keys and values are computed at the first recursion only and every later recursion reuses
them; all tokens pass through the first recursion, so the keys and values of every position
exist and a later recursion's queries attend to the whole causal context. The reference code
(raymin0223/mixture_of_recursions, model/kv_caches/cache_utils.py `RecursiveDynamicCache`)
keeps cache slots for the first pass through the block only (middle_cycle: and for the unique
first and last layers) and hands block position k's first-recursion cache to that position in
every later recursion, in training as in decoding.

Here: the plan's looped segment applies K stored sets R times (models/loops.py `looped`).
Applied layer (r, k), r > 1, projects its own queries from its own input and attends to the keys
and values applied layer (1, k) computed (same stored set, block position k of the first
loop), and projects no keys or values of its own. A query at position t reads the first loop's
keys at positions <= t (and within its document under segment ids) in the full forward as in
cached decoding, so cached greedy decoding equals the full forward's argmax. What is shared is
the attention's input in the cache's format: keys after QK-norm and RoPE, and values (under
values-are-keys attention sharing the raw key projection, placed again by the reading layer,
whose QK-norm is the first loop's own tied one). The prelude and coda (middle_cycle's unique
layers) keep their own. The decode cache of the looped segment holds K layers instead of R * K
(lm.init_cache; lm.kv_cache_bytes_per_token), at any test-time depth.

Later loops' parts that only feed keys or values (depth-wise LoRA or MASA coefficients of the
k / v kernels of loops 2..R) are never read and get no gradient.

Lowering: the first loop, then one scan over the later loops with the first loop's keys and
values closed over (each layer slicing its set's entry); the nested computation whatever the
model's lowering (flat and unrolled give the same function; the sown intermediates come back in
the lowering's layout), so compile time does not grow with R.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sharenet.errors import ConfigError
from sharenet.models.block import Shared, Stream
from sharenet.models.loops import Layer, Schedule, one_loop
from sharenet.models.sharing import Segment


def _at(tree: Any, i) -> Any:
  """Entry (or slice) `i` of every leaf's leading axis (None stays None)."""
  return jax.tree.map(lambda a: a[i], tree)


def _check(seg: Segment, schedule: Schedule, n: int, per_layer: Any, cache: Any) -> None:
  """One ConfigError line for what recursive KV sharing cannot run."""
  R, K = seg.repeats, seg.num_sets
  if seg.order != 'cycle' or R < 2:
    raise ConfigError('model.kv_sharing=first shares the first loop\'s keys and values of a '
                      'looped cycle segment; valid schemes: cycle, universal, middle_cycle, '
                      'groups, sandwich')
  if not isinstance(schedule.no_grad, int) or schedule.no_grad:
    raise ConfigError('model.kv_sharing=first: a no-grad prefix would hold the first loop, '
                      'whose keys and values every later loop reads; valid: no_grad=0')
  if n < 1 or (per_layer is not None and n > R):
    raise ConfigError(f'loop schedule: loops={n}; valid: 1 .. {R} with per-layer parts '
                      f'(depth-wise LoRA, untied norms), any loops >= 1 without')
  if cache is not None and jax.tree.leaves(cache)[0].shape[0] != K:
    raise ConfigError(f'model.kv_sharing=first: the cache holds '
                      f'{jax.tree.leaves(cache)[0].shape[0]} layers of the looped segment, '
                      f'one loop is {K}; valid: lm.init_cache of this model')


def run_shared(layer: Layer, emit_layer: Layer, seg: Segment, lowering: str, sets: Any,
               per_layer: Any, carry: Stream, shared: Shared, cache: Any = None,
               schedule: Schedule = Schedule(), *, unroll: int = 1, split_transpose: bool = True,
               inject: Any = None):
  """loops.run_segment of a looped segment under kv_sharing=first -> (carry, caches (K, ...)
  or None, sown, per-loop streams or None): the first loop by `emit_layer` (its keys and values
  come back in the cache's place; with a `cache`, the updated cache of its K layers), the
  later ones by `layer` attending to them. `schedule`: its loops (and collect) apply."""
  R, K = seg.repeats, seg.num_sets
  n = R if schedule.loops is None else schedule.loops
  _check(seg, schedule, n, per_layer, cache)
  if isinstance(sets, tuple):   # the unrolled lowering's per-set trees
    sets = jax.tree.map(lambda *a: jnp.stack(a), *sets)
  per_loop = jax.tree.map(lambda a: a.reshape((R, K) + a.shape[1:]), per_layer)
  run = dict(unroll=unroll, split_transpose=split_transpose, inject=inject)
  first = one_loop(emit_layer, sets, shared, **run)
  carry, (kv, sown_1) = first(carry, (_at(per_loop, 0), cache))
  later = one_loop(layer, sets, shared, shared_kv=kv, **run)

  def body(carry, per_layer_K):
    carry, (_, sown) = later(carry, (per_layer_K, None))
    return carry, (carry.x_BTD if schedule.collect else None, sown)

  stream_1 = carry.x_BTD
  rest = _at(per_loop, slice(1, n))
  carry, (streams, sown) = jax.lax.scan(body, carry, rest, length=n - 1,
                                        unroll=max(1, min(unroll, n - 1)))
  if schedule.collect:
    streams = jnp.concatenate([stream_1[None], streams])
  sown = None if sown_1 is None or not schedule.is_default else _layout(
      jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), sown_1, sown), lowering, R * K)
  return carry, None if cache is None else kv, sown, streams


def _layout(sown_RK: Any, lowering: str, L: int) -> Any:
  """The sown intermediates (R, K, ...) in `lowering`'s layout (loops.run_segment)."""
  if lowering == 'nested':
    return sown_RK
  sown_L = jax.tree.map(lambda a: a.reshape((L,) + a.shape[2:]), sown_RK)
  if lowering == 'unrolled':
    return tuple(_at(sown_L, l) for l in range(L))
  return sown_L
