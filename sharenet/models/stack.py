"""The layer stack: stores each plan segment's unique sets; the loop runner applies them.

Storage. Each plan segment is a module (`Segment`) whose parameters are created, at init, by
nested nn.scans: a collection *broadcast* across a scan is tied, one with `variable_axes` is per
iteration. 'params' is stacked over the K unique sets and broadcast over the R repeats;
PER_LAYER (untied norm gains, depth-wise LoRA) is scanned at every level, so it holds one entry
per applied layer: (R, K, ...) for a cycle, (K, R, ...) for a sequence, (L, ...) for an
explicit pattern (stored as a pool of its sets, first user of each). Under
model.sharing.lora_layers='shared' (the default) a segment that shares no set (the unique first /
last layers of middle schemes) is built without LoRA. `model.scan_layers=False` stores one
module per unique set instead (the Python-loop baseline).

Application. Every call (training, evaluation, cached generation, routed recursions) hands the
stored arrays to models/loops.py `run_segment`, the one place layers are applied:
`model.scan_lowering` nested or flat (the stored tree is identical, so checkpoints move freely
between the two; flat costs R*K transient copies of the set weights and buys one loop instead of
two, docs/performance.md; benchmarks/step_bench.py and benchmarks/compile_bench.py measure both),
unrolled for the Python-loop baseline. A `loops.Schedule` changes the looped segment's loops
per call (another depth, a no-grad prefix, per-loop outputs).

Generation passes a KV cache through the same runner (sharenet/inference/generate.py): one
`LayerCache`
per applied layer, never per stored set (tied layers share weights, not keys and values), each
segment's stacked along a leading axis of its applied layers (under model.kv_sharing=first the
looped segment's later loops share its first loop's, models/kv_sharing.py: it holds K). The
step information (`DecodeStep`) reaches every layer in block.Shared.

MASA atoms (models/masa.py) are parameters of DecoderLM, outside the stack; the Stack takes them
in block.Shared, so they are stored once whatever the plan and lowering.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sharenet.errors import ConfigError
from sharenet.models import kv_sharing, loops, recurrence, routed_decoding, routing
from sharenet.models.attention import LayerCache
from sharenet.models.block import Block, Scanned, Shared, Stream
from sharenet.models.config import ModelConfig
from sharenet.models.layers import INTERMEDIATES
from sharenet.models.norm_stats import NORM_STATS
from sharenet.models.params import PER_LAYER
from sharenet.models.params import placed
from sharenet.models.sharing import Segment, SharingPlan

# Module names of the stack's tree. Nothing outside this package reads them: consumers find a
# leaf's segment, stored sets and applied layers in its metadata (sharenet/models/params.py), and
# tests/models/test_structure.py renames these to show it.
NAMES = {'segment': 'segment_{}', 'level': 'level', 'block': 'block', 'set': 'set_{}',
         'router': 'router', 'adapter': 'adapter'}


def _scan(target, length: int, stacked: bool, axis_name: str):
  """nn.scan of `target` creating the stored tree: stacked -> params per iteration, else
  params broadcast (tied); PER_LAYER per iteration either way. The body takes (carry: Stream,
  shared: Shared, scanned: Scanned), `shared` broadcast."""
  if stacked:
    return nn.scan(target, variable_axes={'params': 0, PER_LAYER: 0, NORM_STATS: 0,
                                          INTERMEDIATES: 0},
                   split_rngs={'params': True, PER_LAYER: True}, in_axes=(nn.broadcast, 0),
                   length=length, metadata_params={nn.PARTITION_NAME: axis_name})
  return nn.scan(target, variable_axes={PER_LAYER: 0, NORM_STATS: 0, INTERMEDIATES: 0},
                 variable_broadcast='params', split_rngs={'params': False, PER_LAYER: True},
                 in_axes=(nn.broadcast, 0), length=length,
                 metadata_params={nn.PARTITION_NAME: axis_name})


class _Create(nn.Module):
  """Creates a regular segment's stored tree (init only): one nn.scan per level of `levels`
  ((length, stacked, axis name), outermost first), the Block innermost."""
  cfg: ModelConfig
  levels: tuple[tuple[int, bool, str], ...]

  @nn.compact
  def __call__(self, carry: Stream, shared: Shared, scanned: Scanned = Scanned()):
    return _create_levels(self.cfg, self.levels)(carry, shared, scanned)


def _create_levels(cfg: ModelConfig, levels) -> nn.Module:
  """The scan of the outermost of `levels`, named as the stored tree names it."""
  (length, stacked, axis), rest = levels[0], levels[1:]
  if rest:
    return _scan(_Create, length, stacked, axis)(cfg, rest, name=NAMES['level'])
  return _scan(Block, length, stacked, axis)(cfg, name=NAMES['block'])


def _create_pool(cfg: ModelConfig, pattern: tuple[int, ...]) -> nn.Module:
  """An explicit pattern's stored tree (init only): the Block scanned over the applied layers,
  its params reduced to the pool (the first user of each set), PER_LAYER kept per applied
  layer."""
  first_use = np.asarray([pattern.index(u) for u in range(max(pattern) + 1)])

  def take(index):
    def fn(vs):
      out = dict(vs)
      if 'params' in vs:
        out['params'] = _map_leading(vs['params'], lambda p: jnp.take(p, index, axis=0))
      return out
    return fn

  body = _scan(Block, len(pattern), True, 'layers')
  mapped = nn.map_variables(body, ['params', PER_LAYER, NORM_STATS],
                            trans_in_fn=take(np.asarray(pattern)),
                            trans_out_fn=take(first_use), init=True)
  return mapped(cfg, name=NAMES['block'])


def _map_leading(tree, value_fn):
  """Maps every leaf's value, keeping logical-partitioning boxes."""
  def leaf(x):
    return x.replace(value=value_fn(x.value)) if isinstance(x, nn.Partitioned) else value_fn(x)
  return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


class StoredSegment(nn.Module):
  """Plan segment `index`: its stored sets (created at init) applied by the loop runner.

  (carry, shared, cache, schedule) -> (carry, updated cache or None). The routed segment of a
  Mixture-of-Recursions model (models/routing.py) stores its sets as a plain cycle segment and
  its routers beside them; its recursions call the runner's pass through the K sets.
  """
  cfg: ModelConfig
  index: int

  @nn.compact
  def __call__(self, carry: Stream, shared: Shared, cache: LayerCache | None = None,
               schedule: loops.Schedule = loops.Schedule()):
    c, seg = self.cfg, self.cfg.plan.segments[self.index]
    routed = self.index == c.routed_segment
    recurrent = self.index == c.recurrent_segment
    if self.is_initializing():
      created = self._create(seg, carry, shared)
      if recurrent:
        _create_adapter(c, carry)
      elif not routed and schedule.is_default and cache is None:
        return created, None   # the creating scans computed this segment's output already
    variables = nn.unbox(self.variables)
    sets, per_layer, stored = self._stored(seg, variables)
    run = dict(unroll=c.scan_unroll, split_transpose=c.scan_split_transpose)
    if routed:
      if not schedule.is_default:
        raise ConfigError(f'model.routing.kind={c.routing.kind!r}: a loop schedule (depth, '
                          f'no-grad prefix) of a routed model is not implemented; valid: '
                          f'routing.kind=none')
      x_BTD, cache = self._routed(seg, sets, carry.x_BTD, shared, run, cache)
      return carry._replace(x_BTD=x_BTD), cache
    observe = self.is_mutable_collection(INTERMEDIATES)
    layer = loops.layer_fn(c, observe, loops.outer_capture() if observe else False,
                           train_stats=self.is_mutable_collection(NORM_STATS))
    lowering = 'flat' if c.scan_lowering == 'flat' else 'nested'
    inject = None
    if recurrent:
      carry, inject = _recurrent_input(self, c, carry, shared,
                                       variables['params'].get(NAMES['adapter']))
    carry, cache, sown, streams = _run_segment(
        layer, _emit_layer(c, self.index, observe), seg, lowering, sets, per_layer, carry,
        shared, cache, schedule, inject=inject, **run)
    if streams is not None:
      self.sow(loops.PER_LOOP, 'streams', streams)
    if observe and sown is not None:
      self.put_variable(INTERMEDIATES, stored[0], _nest(stored[1:], sown))
    return carry, cache

  def _create(self, seg, carry: Stream, shared: Shared) -> Stream:
    if seg.order == 'gather':
      out, _ = _create_pool(self.cfg, seg.pattern)(carry, shared, Scanned())
    else:
      out, _ = _create_levels(self.cfg, segment_levels(seg))(carry, shared, Scanned())
    return out

  def _stored(self, seg, variables):
    """(sets (K, ...), per-layer parts in applied order (L_seg, ...) or None, the stored
    path of the blocks) by this module's own names."""
    path = (NAMES['block'],) if seg.order == 'gather' else (NAMES['level'], NAMES['block'])
    def at(collection):
      tree = variables.get(collection)
      for k in path:
        if tree is None or k not in tree:
          return None
        tree = tree[k]
      return tree
    # per applied layer: the per-layer parts and a statistics norm's running statistics
    per_layer = {c: at(c) for c in (PER_LAYER, NORM_STATS) if at(c) is not None} or None
    if per_layer is not None and seg.order != 'gather':
      per_layer = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), per_layer)
    return at('params'), per_layer, path

  def _routed(self, seg, sets, x_BTD: jax.Array, shared: Shared, run: dict, cache=None):
    """Mixture-of-Recursions over the segment's K sets: the routers pick each recursion's
    tokens; each recursion is one runner pass (compile time: expert choice R passes or one scan
    per bucket, token choice one scan over the R recursions). -> (x, None), or with a cache
    (routed_decoding.RoutedCache) one cached step: (x, updated cache)."""
    c = self.cfg
    sow = lambda name, value: self.sow(routing.ROUTING, name, value)
    router = routing.Router(c, name=NAMES['router'])
    if cache is not None:   # recursion-wise KV caching (models/routed_decoding.py)
      layer = loops.layer_fn(c)
      loop_at = lambda step: loops.one_loop(layer, sets, shared._replace(step=step), **run)
      bias_R = router.exit_bias() if c.routing.kind == 'token_choice' else None
      return routed_decoding.decode(c, router, loop_at, x_BTD, shared.step, cache, bias_R)
    level = loops.stream_pass(loops.layer_fn(c), sets, shared.masa, **run)
    positions_T, segment_ids_BT = shared.positions_T, shared.segment_ids_BT
    if c.routing.kind == 'expert_choice':
      recurse = None
      if c.routing.buckets:
        weights = router.expert_weights()
        logits = functools.partial(routing.expert_logits, weights)

        def recurse(carry, steps, kept):
          step = lambda carry, s: routing.expert_recursion(level, logits, c.router_alpha, carry, s,
                                                             kept)
          return jax.lax.scan(step, carry, steps)
      return routing.expert_choice(x_BTD, positions_T, segment_ids_BT, cfg=c, router=router,
                                   level=level, sow=sow, recurse=recurse), None

    def recurse(carry, routes, positions):
      step = lambda carry, r: (routing.token_recursion(level, r, carry, routes, positions), None)
      (_, out_BTD), _ = jax.lax.scan(step, carry, jnp.arange(seg.repeats))
      return out_BTD
    return routing.token_choice(x_BTD, positions_T, segment_ids_BT, cfg=c, router=router,
                                sow=sow, recurse=recurse, bias_R=router.exit_bias()), None


def _run_segment(layer: loops.Layer, emit_layer: loops.Layer | None, *args: Any,
                 **kwargs: Any):
  """loops.run_segment; with an `emit_layer` (model.kv_sharing=first on the looped segment)
  kv_sharing.run_shared, whose later loops attend to the first loop's keys and values."""
  if emit_layer is None:
    return loops.run_segment(layer, *args, **kwargs)
  return kv_sharing.run_shared(layer, emit_layer, *args, **kwargs)


def _emit_layer(cfg: ModelConfig, index: int, observe: bool) -> loops.Layer | None:
  """Segment `index`'s first-loop layer under model.kv_sharing=first (models/kv_sharing.py),
  returning its keys and values; None for every other segment and without kv sharing."""
  if index != cfg.kv_segment:
    return None
  return loops.layer_fn(cfg, observe, loops.outer_capture() if observe else False, emit_kv=True)


def _create_adapter(cfg: ModelConfig, carry: Stream) -> None:
  """Creates concat's adapter (models/recurrence.py) at init, with the segment that loops."""
  if cfg.recurrence.injection == 'concat':
    recurrence.adapter(cfg, name=NAMES['adapter'])(
        jnp.zeros((1, 1, 2 * cfg.d_model), carry.x_BTD.dtype))


def _recurrent_input(module: nn.Module, cfg: ModelConfig, carry: Stream, shared: Shared,
                     adapter_params) -> tuple[Stream, recurrence.Injection | None]:
  """The looped segment's initial state and the injection of its input (model.recurrence).
  The `normal` state is drawn from the call's 'recurrence' rng where given (training)."""
  e_BTD = carry.x_BTD
  key = None
  if cfg.recurrence.init == 'normal' and module.has_rng(recurrence.RNG):
    key = module.make_rng(recurrence.RNG)
  step = shared.step
  positions_BT = shared.positions_T[None] if step is None else step.positions_BT
  x_BTD = recurrence.initial_state(cfg, e_BTD, key, positions_BT,
                                   None if step is None else step.rows_B)
  return carry._replace(x_BTD=x_BTD), recurrence.injection(cfg, e_BTD, adapter_params)


def _nest(path: tuple[str, ...], value):
  for k in reversed(path):
    value = {k: value}
  return value


def placement(plan: SharingPlan, i: int) -> dict:
  """The structure fields (params.Placement) of plan segment i's parameters."""
  seg = plan.segments[i]
  offset = sum(s.num_applied for s in plan.segments[:i])
  sets = tuple(range(seg.first_set, seg.first_set + seg.num_sets))
  return dict(segment=i, sets=sets, uses=tuple(len(plan.uses(u)) for u in sets),
              layers=tuple(range(offset, offset + seg.num_applied)))


def segment_levels(seg: Segment) -> tuple[tuple[int, bool, str], ...]:
  """Nesting of a regular segment: cycle = repeats(outer, tied) x sets; sequence = reverse."""
  if seg.order == 'cycle':
    return ((seg.repeats, False, 'repeats'), (seg.num_sets, True, 'layers'))
  return ((seg.num_sets, True, 'layers'), (seg.repeats, False, 'repeats'))


def init_cache(cfg: ModelConfig, batch_size: int, num_slots: int,
               dtype: jnp.dtype | None = None, loops_run: int | None = None
               ) -> tuple[LayerCache, ...]:
  """An empty KV cache: per plan segment, a LayerCache stacked over its applied layers
  (leaves (applied layers, B, S, kv heads, head_dim)), so sum of the leading axes is
  cfg.num_layers whatever the sharing plan. Values-are-keys sharing (model.attention_sharing
  kv_shared | qkv_shared) holds K only: v is None. `loops_run`: decoding at another depth
  (loops.Schedule(loops=n)), the looped segment holds n loops of its K layers. Under
  model.kv_sharing=first the looped segment holds its first loop's K layers only (the later
  loops read them: models/kv_sharing.py), whatever the depth. A routed segment's entry is a
  routed_decoding.RoutedCache (its layers and each slot's recursions)."""
  dt = jnp.dtype(dtype or cfg.dtype)
  def one(n):
    shape = (n, batch_size, num_slots, cfg.kv_heads, cfg.d_head)
    return LayerCache(jnp.zeros(shape, dt), None if cfg.values_are_keys else jnp.zeros(shape, dt))
  def layers(i, seg):
    if i == cfg.kv_segment:   # model.kv_sharing=first: one loop's K layers at any depth
      return seg.num_sets
    return loops_run * seg.num_sets if i == looped else seg.num_applied
  looped = None if loops_run is None else loops.looped(cfg).segment
  caches = tuple(one(layers(i, seg)) for i, seg in enumerate(cfg.plan.segments))
  return routed_decoding.with_depths(cfg, caches)   # a routed segment's recursion-wise cache


class Stack(nn.Module):
  """Applies cfg.num_layers layers, storing only the plan's unique sets.

  (carry, shared, caches, schedule) -> (carry, updated caches): `shared` (block.Shared:
  positions, segment ids, the decode step, the MASA atoms) reaches every block; `caches`
  (init_cache's structure, None without generation) holds one entry per applied layer;
  `schedule` (loops.Schedule) applies to the plan's looped segment. `first` > 0 runs the
  segments from that one on (the coda of a loop's exit, DecoderLM.exit_logits; not at init).
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, carry: Stream, shared: Shared, caches: tuple[LayerCache, ...] | None = None,
               schedule: loops.Schedule = loops.Schedule(), first: int = 0
               ) -> tuple[Stream, tuple[LayerCache, ...] | None]:
    looped = None if schedule.is_default else loops.looped(self.cfg).segment
    if not self.cfg.scan_layers:
      return self._python_loop(carry, shared, caches, schedule, looped, first)
    new_caches = []
    for i, seg in enumerate(self.cfg.plan.segments):
      if i < first:
        new_caches.append(None)
        continue
      cfg = self.cfg.segment_cfg(seg)   # no LoRA on unshared segments under lora_layers=shared
      with placed(**placement(self.cfg.plan, i)):
        carry, cache = StoredSegment(cfg, i, name=NAMES['segment'].format(i))(
            carry, shared, None if caches is None else caches[i],
            schedule if i == looped else loops.Schedule())
      new_caches.append(cache)
    return carry, None if caches is None else tuple(new_caches)

  def _python_loop(self, carry: Stream, shared: Shared, caches, schedule, looped, first: int):
    """The Python-loop baseline (benchmarks): one module per unique set, each applied layer
    unrolled (loops.run_segment's `unrolled` lowering)."""
    plan, recurrent = self.cfg.plan, self.cfg.recurrent_segment
    if self.is_initializing():
      blocks = [Block(self.cfg, name=NAMES['set'].format(u)) for u in range(plan.num_unique)]
      for i, seg in enumerate(plan.segments):
        for u in seg.local_indices():
          u += seg.first_set
          with placed(segment=i, sets=(u,), uses=(len(plan.uses(u)),), layers=()):
            blocks[u](carry, shared, Scanned())
      if recurrent is not None:
        with placed(segment=recurrent):
          _create_adapter(self.cfg, carry)
    params = nn.unbox(self.variables)['params']
    stored = tuple(params[NAMES['set'].format(u)] for u in range(plan.num_unique))
    observe = self.is_mutable_collection(INTERMEDIATES)
    layer = loops.layer_fn(self.cfg, observe, loops.outer_capture() if observe else False)
    new_caches, sown = [], {}
    for i, seg in enumerate(plan.segments):
      if i < first:
        new_caches.append(None)
        continue
      sets = stored[seg.first_set:seg.first_set + seg.num_sets]
      inject = None
      if i == recurrent:
        carry, inject = _recurrent_input(self, self.cfg, carry, shared,
                                         params.get(NAMES['adapter']))
      carry, cache, per_layer_sown, streams = _run_segment(
          layer, _emit_layer(self.cfg, i, observe), seg, 'unrolled', sets, None, carry, shared,
          None if caches is None else caches[i],
          schedule if i == looped else loops.Schedule(), unroll=self.cfg.scan_unroll,
          inject=inject)
      if streams is not None:
        self.sow(loops.PER_LOOP, 'streams', streams)
      new_caches.append(cache)
      for u, tree in zip(seg.local_indices(), per_layer_sown if observe else ()):
        name = NAMES['set'].format(seg.first_set + u)
        sown[name] = tree if name not in sown else _append(sown[name], tree)
    for name, tree in sown.items():   # as sow stores repeated calls: one tuple entry per use
      if tree:
        self.put_variable(INTERMEDIATES, name, tree)
    return carry, None if caches is None else tuple(new_caches)


def _append(a, b):
  """Two sown trees merged as repeated sow calls would store them (tuples concatenated)."""
  if isinstance(a, dict):
    return {k: _append(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k))
            for k in {**a, **b}}
  return tuple(a) + tuple(b)
