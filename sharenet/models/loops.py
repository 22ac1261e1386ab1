"""The loop runner: the one place a segment's stored sets are applied to the stream.

A plan segment stores K sets (params stacked on a leading axis) and, with depth-wise LoRA or
untied norms, per-layer parts (one entry per applied layer). `run_segment` applies it, as a pure
function of those arrays, in one of three lowerings of the same computation:

  nested    a `cycle` segment is an outer scan over its R loops (the sets closed over: tied)
            around an inner scan over the K sets; `sequence` the reverse nesting. Compile time
            does not grow with R.
  flat      one scan over the R*K applied layers, the sets gathered into an applied-depth stack
            (the gather's gradient sums the per-use gradients); explicit patterns always run so.
  unrolled  a Python loop over the applied layers (the `model.scan_layers=False` baseline).

Every caller goes through it: training and evaluation (models/stack.py), cached decoding (the KV
caches ride along as per-layer scanned inputs), routed recursions (`one_loop`, driven by
models/routing.py) and loop-by-loop serving (models/layer_store.py `run_layers`, one token
through a dynamically placed range of applied layers). A `Schedule` changes the loops of a
looped (`cycle`) segment per call: run `loops` of them instead of R (evaluate or decode at
another depth: a KV cache then holds the `loops` loops' layers, lm.init_cache(loops=...)), run a
prefix of `no_grad` loops without gradient first (a traced count allowed: one compiled program
for every prefix; nothing of the prefix is stored for the backward pass) and `collect` the
stream after each loop. A recurrent-depth segment (models/recurrence.py) re-enters its input at
the start of every loop (`inject`) in every lowering and schedule; under model.kv_sharing=first
its later loops attend to the first loop's keys and values (models/kv_sharing.py drives
`one_loop` for that).

The layer itself is `Block.apply` on the gathered variables (`layer_fn`), rematerialised by the
model's remat policy; what the blocks sow (coordinate checks) comes back stacked like the
layers that sowed it.

A plan with one looped segment reads as prelude (the applied layers before it), R loops of K
layers, and coda (the layers after it): `cycle` / `universal` have no prelude or coda,
`middle_cycle` one unique layer each (Relaxed Recursive Transformers, arXiv:2410.20672).
`LayerStore` gathers what applied layer l needs from the stored tree by the parameters'
structure metadata (sharenet/models/params.py) for loop-by-loop serving (models/layer_store.py).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharenet.errors import ConfigError
from sharenet.models.block import Block, Scanned, Shared, Stream
from sharenet.models.config import ModelConfig
from sharenet.models.layers import INTERMEDIATES
from sharenet.models.norm_stats import NORM_STATS
from sharenet.models.sharing import Segment

LOWERINGS = ('nested', 'flat', 'unrolled')
PER_LOOP = 'per_loop'   # sown collection: the stream after each loop (Schedule.collect)
SAVE_NAMES = ('query_proj', 'key_proj', 'value_proj', 'out_proj', 'mlp_hidden', 'mlp_out')


def remat_policy(name: str):
  """Named remat policies -> jax.checkpoint_policies (None = no remat at all)."""
  cp = jax.checkpoint_policies
  return {
      'none': None,
      'full': cp.nothing_saveable,
      'dots': cp.dots_saveable,
      'dots_no_batch': cp.dots_with_no_batch_dims_saveable,
      'save_names': cp.save_only_these_names(*SAVE_NAMES),
      'offload_dots': cp.offload_dot_with_no_batch_dims('device', 'pinned_host'),
      # Save every residual except the (T, T) attention arrays, which are cheap to recompute.
      'except_attn': cp.save_anything_except_these_names('attn_logits', 'attn_probs'),
  }[name]


class Schedule(NamedTuple):
  """The loops one call runs of a looped segment (module docstring); the default is the plan's.

  loops: loops run with gradient (None: the plan's R). no_grad: loops run before them without
  gradient (an int, or a traced int32 scalar). collect: also return the stream after each of
  the gradient loops, stacked (loops, B, T, D).
  """
  loops: int | None = None
  no_grad: Any = 0
  collect: bool = False

  @property
  def is_default(self) -> bool:
    return (self.loops is None and not self.collect and isinstance(self.no_grad, int)
            and self.no_grad == 0)


Layer = Callable[[dict, Stream, Shared, Scanned], tuple[Stream, tuple[Any, Any]]]


def layer_fn(cfg: ModelConfig, observe: bool = False, capture: Any = False,
             emit_kv: bool = False, train_stats: bool = False) -> Layer:
  """One applied layer as a pure function: (variables, carry, shared, scanned) -> (carry,
  (updated cache or None, what the block sowed or None)); `observe` collects the sown
  intermediates, `capture` is the caller's capture_intermediates (flax: True or a filter),
  applied to the block's modules as if they were called in place; `emit_kv` returns the
  layer's keys and values in the cache's place where it has no cache (model.kv_sharing's first
  loop, models/kv_sharing.py). `train_stats`: a statistics norm's collection is mutable, so
  it normalises in training mode (sharenet/models/norm_stats.py; its statistics leave by cotangents,
  never as outputs). Rematerialised under cfg.remat (prevent_cse is unnecessary inside scan,
  jax.checkpoint's docstring, and costs speed)."""
  block = Block(cfg, emit_kv=emit_kv)
  observe = observe or bool(capture)
  stats = [NORM_STATS] if train_stats else []

  def layer(variables, carry, shared, scanned):
    if not observe:
      if not stats:
        carry, cache = block.apply(variables, carry, shared, scanned)
      else:
        (carry, cache), _ = block.apply(variables, carry, shared, scanned, mutable=stats)
      return carry, (cache, None)
    (carry, cache), state = block.apply(variables, carry, shared, scanned,
                                        mutable=[INTERMEDIATES] + stats,
                                        capture_intermediates=capture)
    return carry, (cache, state.get(INTERMEDIATES, {}))

  if cfg.remat == 'none':
    return layer
  return jax.checkpoint(layer, policy=remat_policy(cfg.remat), prevent_cse=False)


def outer_capture() -> Any:
  """The capture_intermediates of the flax apply being traced (False outside one): the runner
  applies blocks functionally, so it hands the caller's choice on. Reads flax's context."""
  from flax.linen import module as flax_module
  stack = flax_module._context.capture_stack
  return stack[-1] if stack else False


def _take(tree: Any, i) -> Any:
  return jax.tree.map(lambda a: a[i], tree)


def _regroup(tree: Any, shape: tuple[int, ...]) -> Any:
  """The leading axis of every leaf regrouped as `shape` (None stays None)."""
  return jax.tree.map(lambda a: a.reshape(shape + a.shape[1:]), tree)


def _ungroup(tree: Any, n_lead: int) -> Any:
  return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[n_lead:]), tree)


def _variables(params: Any, per_layer: Any) -> dict:
  """A block's variables: its set's params and its applied layer's parts ({collection:
  tree}: PER_LAYER, NORM_STATS)."""
  return {'params': params} if per_layer is None else {'params': params, **per_layer}


def _scan_layers(layer: Layer, carry: Stream, shared: Shared, params: Any, per_layer: Any,
                 cache: Any, unroll: int, split_transpose: bool, inject: Any = None,
                 starts: Any = None, shared_kv: Any = None):
  """One scan over stacked layers: params, per-layer parts, caches and shared keys and values
  sliced per step; with `inject`, the layers where `starts` (bool per layer) is true take the
  injection first."""
  n = jax.tree.leaves(params)[0].shape[0]

  def body(carry, xs):
    p, pl, c, kv, start = xs
    if inject is not None:   # a cond: the injection (concat: the adapter) runs once per loop
      carry = carry._replace(x_BTD=jax.lax.cond(start, lambda x: inject(x), lambda x: x,
                                                carry.x_BTD))
    return layer(_variables(p, pl), carry, shared, Scanned(c, kv))

  return jax.lax.scan(body, carry, (params, per_layer, cache, shared_kv, starts),
                      unroll=min(unroll, n), _split_transpose=split_transpose)


def one_loop(layer: Layer, sets: Any, shared: Shared, *, unroll: int = 1,
             split_transpose: bool = True, inject: Any = None, shared_kv: Any = None
             ) -> Callable:
  """(carry, (per-layer parts (K, ...) or None, caches (K, ...) or None)) -> (carry, (caches,
  sown)): one pass through a cycle segment's K stored sets, the body of every loop; `inject`
  (models/recurrence.py Injection, or None) first re-enters the segment's input; `shared_kv`
  (K, ...) the first loop's keys and values its layers attend to (models/kv_sharing.py)."""
  def run(carry, xs):
    per_layer, cache = xs
    if inject is not None:
      carry = carry._replace(x_BTD=inject(carry.x_BTD))
    return _scan_layers(layer, carry, shared, sets, per_layer, cache, unroll, split_transpose,
                        shared_kv=shared_kv)
  return run


def stream_pass(layer: Layer, sets: Any, masa: Any, *, unroll: int = 1,
                split_transpose: bool = True) -> Callable:
  """(x, positions, segment ids) -> (x, None): one pass through K stacked sets, as the routed
  recursions of models/routing.py call it (each with its own tokens, positions and segments)."""
  def run(x_BTD, positions_T, segment_ids_BT=None):
    carry, _ = _scan_layers(layer, Stream(x_BTD), Shared(positions_T, segment_ids_BT, masa=masa),
                            sets, None, None, unroll, split_transpose)
    return carry.x_BTD, None
  return run


def run_segment(layer: Layer, seg: Segment, lowering: str, sets: Any, per_layer: Any,
                carry: Stream, shared: Shared, cache: Any = None,
                schedule: Schedule = Schedule(), *, unroll: int = 1,
                split_transpose: bool = True, inject: Any = None):
  """Applies plan segment `seg` -> (carry, caches, sown, per-loop streams or None).

  `sets`: the segment's stored block params, stacked (K, ...), or under `unrolled` a tuple of
  per-set trees; `per_layer` and `cache`: one entry per applied layer in applied order
  (L_seg, ...), or None. The returned caches have the same layout; the sown intermediates keep
  the lowering's leading axes ((R, K) nested cycle, (K, R) nested sequence, (L_seg,) flat;
  under `unrolled` a tuple, one per applied layer). `inject` (a looped cycle segment's
  models/recurrence.py Injection, or None) runs at the start of every loop in every lowering.
  A looped segment under model.kv_sharing=first runs through models/kv_sharing.py instead
  (`run_shared`, which applies this module's loops).
  """
  if lowering not in LOWERINGS:
    raise ConfigError(f'loop lowering {lowering!r} is unknown; valid: {", ".join(LOWERINGS)}')
  if not schedule.is_default:
    return _run_schedule(layer, seg, sets, per_layer, carry, shared, cache, schedule,
                         unroll=unroll, split_transpose=split_transpose, inject=inject)
  pattern = seg.local_indices()
  if inject is not None and (seg.order != 'cycle' or seg.repeats < 2):
    raise ConfigError('an injection (model.recurrence.injection) re-enters a looped cycle '
                      'segment; valid schemes: cycle, universal, middle_cycle, groups, sandwich')
  if lowering == 'unrolled':
    return _run_unrolled(layer, seg, sets, per_layer, carry, shared, cache, inject)
  if lowering == 'flat' or seg.order == 'gather':
    params = sets if pattern == tuple(range(len(pattern))) else jax.tree.map(
        lambda a: jnp.take(a, np.asarray(pattern), axis=0), sets)
    starts = None if inject is None else jnp.asarray(_loop_starts(seg))
    carry, (cache, sown) = _scan_layers(layer, carry, shared, params, per_layer, cache, unroll,
                                        split_transpose, inject, starts)
    return carry, cache, sown, None
  return _run_nested(layer, seg, sets, per_layer, carry, shared, cache, unroll=unroll,
                     split_transpose=split_transpose, inject=inject)


def _loop_starts(seg: Segment) -> list[bool]:
  """Whether each applied layer of `seg` is the first of its loop."""
  return [l % seg.num_sets == 0 for l in range(seg.num_applied)]


def _run_unrolled(layer: Layer, seg: Segment, sets: Any, per_layer: Any, carry: Stream,
                  shared: Shared, cache: Any, inject: Any):
  """The `unrolled` lowering: a Python loop over the applied layers."""
  outs = []
  for l, (u, first) in enumerate(zip(seg.local_indices(), _loop_starts(seg))):
    if inject is not None and first:
      carry = carry._replace(x_BTD=inject(carry.x_BTD))
    params = sets[u] if isinstance(sets, tuple) else _take(sets, u)
    carry, out = layer(_variables(params, None if per_layer is None else _take(per_layer, l)),
                       carry, shared, Scanned(None if cache is None else _take(cache, l)))
    outs.append(out)
  caches = [c for c, _ in outs]
  stacked = None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *caches)
  return carry, stacked, tuple(s for _, s in outs), None


def _run_nested(layer: Layer, seg: Segment, sets: Any, per_layer: Any, carry: Stream,
                shared: Shared, cache: Any, *, unroll: int, split_transpose: bool, inject: Any):
  """The `nested` lowering: a cycle's R loops outside its K sets, a sequence the reverse."""
  R, K = seg.repeats, seg.num_sets
  if seg.order == 'cycle':   # loops outside, the K sets inside (closed over: tied)
    loop = one_loop(layer, sets, shared, unroll=unroll, split_transpose=split_transpose,
                    inject=inject)
    xs = (None if per_layer is None else _regroup(per_layer, (R, K)),
          None if cache is None else _regroup(cache, (R, K)))
    carry, (cache, sown) = jax.lax.scan(loop, carry, xs, length=R, unroll=min(unroll, R))
  else:                      # sequence: each set applied R times in a row
    def set_body(carry, xs):
      params, pl_R, c_R = xs
      def repeat(carry, xs):
        pl, c = xs
        return layer(_variables(params, pl), carry, shared, Scanned(c))
      return jax.lax.scan(repeat, carry, (pl_R, c_R), length=R, unroll=min(unroll, R))
    xs = (sets, None if per_layer is None else _regroup(per_layer, (K, R)),
          None if cache is None else _regroup(cache, (K, R)))
    carry, (cache, sown) = jax.lax.scan(set_body, carry, xs, unroll=min(unroll, K),
                                        _split_transpose=split_transpose)
  return carry, None if cache is None else _ungroup(cache, 2), sown, None


def _run_schedule(layer: Layer, seg: Segment, sets: Any, per_layer: Any, carry: Stream,
                  shared: Shared, cache: Any, schedule: Schedule, *, unroll: int,
                  split_transpose: bool, inject: Any = None):
  """A looped segment under a non-default Schedule: the no-grad prefix, then the gradient
  loops (nested lowering whatever the model's: the same computation)."""
  R, K = seg.repeats, seg.num_sets
  n, p = R if schedule.loops is None else schedule.loops, schedule.no_grad
  if isinstance(sets, tuple):   # the unrolled lowering's per-set trees
    sets = jax.tree.map(lambda *a: jnp.stack(a), *sets)
  dynamic = not isinstance(p, int)
  if seg.order != 'cycle' or R < 2:
    raise ConfigError('a loop schedule (depth, no-grad prefix, per-loop outputs) applies to a '
                      'looped cycle segment; valid schemes: cycle, universal, middle_cycle, '
                      'groups')
  if cache is not None and (dynamic or p or schedule.collect):
    raise ConfigError('cached generation runs whole loops at another depth; valid: a schedule '
                      'with no_grad=0 and collect=False')
  if cache is not None and jax.tree.leaves(cache)[0].shape[0] != n * K:
    raise ConfigError(f'the cache holds {jax.tree.leaves(cache)[0].shape[0]} layers of the '
                      f'looped segment, a schedule of {n} loops writes {n * K}; valid: '
                      f'lm.init_cache(..., loops={n})')
  if n < 1 or (not dynamic and p < 0):
    raise ConfigError(f'loop schedule: loops={n}, no_grad={p}; valid: loops >= 1, no_grad >= 0')
  if per_layer is not None and (dynamic or p + n > R):
    raise ConfigError(f'per-layer parts (depth-wise LoRA, untied norms, per-layer routers) '
                      f'exist for the plan\'s {R} loops only; got {p} + {n}; valid: a static '
                      f'no_grad + loops <= {R}, or lora_rank=0, untie_norms=False and '
                      f'moe.router_per_layer=False')
  # the Euler step of model.recurrence.ode_step (models/block.py): R / the loops run
  shared = shared._replace(step_size=R / (p + n))
  loop = one_loop(layer, sets, shared, unroll=unroll, split_transpose=split_transpose,
                  inject=inject)
  per_loop = None if per_layer is None else _regroup(per_layer, (R, K))
  if dynamic or p:   # the prefix reads nothing with a tangent (no tangent work in its loop)
    frozen = one_loop(layer, jax.lax.stop_gradient(sets),
                      shared._replace(masa=jax.lax.stop_gradient(shared.masa)), unroll=unroll,
                      split_transpose=split_transpose,
                      inject=None if inject is None else inject.frozen())
    carry = jax.lax.stop_gradient(carry)
    if dynamic:
      carry = jax.lax.fori_loop(0, p, lambda _, c: frozen(c, (None, None))[0], carry)
    else:
      prefix = None if per_loop is None else _take(per_loop, slice(0, p))
      carry, _ = jax.lax.scan(frozen, carry, (prefix, None), length=p)
    carry = jax.lax.stop_gradient(carry)
  if per_loop is not None:
    per_loop = _take(per_loop, slice(p, p + n))

  def body(carry, xs):
    carry, (c, _) = loop(carry, xs)
    return carry, (carry.x_BTD if schedule.collect else None, c)

  # A cache (cached generation at another depth) holds the n loops' K layers each.
  caches = None if cache is None else _regroup(cache, (n, K))
  carry, (streams, caches) = jax.lax.scan(body, carry, (per_loop, caches), length=n)
  return carry, None if cache is None else _ungroup(caches, 2), None, streams


class Looped(NamedTuple):
  """A plan read as prelude + R loops of K layers + coda (applied-layer counts)."""
  start: int        # first applied layer of the looped segment (= prelude layers)
  num_sets: int     # K layers per loop
  loops: int        # R
  num_layers: int   # L, all applied layers
  segment: int = 0  # its index among the plan's segments

  @property
  def coda(self) -> int:
    """First applied layer after the loops."""
    return self.start + self.num_sets * self.loops


def looped(cfg: ModelConfig) -> Looped:
  """The plan's looped segment; one ConfigError line when it has none or several."""
  segs = cfg.plan.segments
  loops = [i for i, s in enumerate(segs) if s.order == 'cycle' and s.repeats > 1]
  if len(loops) != 1:
    raise ConfigError(f'loop-by-loop serving needs exactly one looped cycle segment; '
                      f'model.sharing.scheme={cfg.sharing.scheme!r} has {len(loops)}; valid '
                      f'schemes: cycle, universal, middle_cycle, groups')
  i = loops[0]
  start = sum(s.num_applied for s in segs[:i])
  return Looped(start, segs[i].num_sets, segs[i].repeats, cfg.num_layers, i)
