"""The layer stack: one nested nn.scan per plan segment, so tying is a scan setting.

Inside a segment, a collection that is *broadcast* across a scan is tied and a collection
with `variable_axes` is per iteration. 'params' is stacked over the K unique
sets and broadcast over the R repeats; PER_LAYER (untied norm gains, depth-wise LoRA) is
scanned at every level, so it holds one entry per applied layer. Compile time therefore does
not grow with R. Under model.sharing.lora_layers='shared' (the default) a segment that shares
no set (the unique first / last layers of middle schemes) is built without LoRA.

`model.scan_lowering='flat'` lowers the same regular segment as one scan over its R*K applied
layers instead: the K stored sets are gathered into an applied-depth stack for the forward pass
(the gather's gradient sums the per-use gradients) and the per-layer parts are reshaped, so the
stored tree is identical to the nested one and checkpoints move freely between the two. It costs
R*K transient copies of the set weights (and their per-use gradients) and buys one loop instead
of two; compile time stays flat in R as well (README "Results"; benchmarks/step_bench.py and
benchmarks/compile_bench.py measure both).

Generation passes a KV cache through the same scans (sharenet/generate.py): one `LayerCache`
per applied layer, never per stored set (tied layers share weights, not keys and values). Each
segment's caches are stacked along a leading axis of its applied layers and scanned like
PER_LAYER: reshaped to the nesting's (outer, inner) lengths for nested scans, flat for the
gathered lowering. The step information (`DecodeStep`) is broadcast to every level.

MASA atoms (models/masa.py) are parameters of DecoderLM, outside the stack; the Stack takes them
as an argument (`masa`, {target: atoms}) and broadcasts them through every scan level to the
blocks, so they are stored once whatever the plan and lowering.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sharenet.models.attention import DecodeStep, LayerCache
from sharenet.models.block import Block, Scanned, Shared, Stream
from sharenet.errors import ConfigError
from sharenet.models import routing
from sharenet.models.config import ModelConfig
from sharenet.models.layers import INTERMEDIATES
from sharenet.norms import PER_LAYER
from sharenet.params import placed
from sharenet.sharing import Segment, SharingPlan

# Module names of the stack's tree. Nothing outside this package reads them: consumers find a
# leaf's segment, stored sets and applied layers in its metadata (sharenet/params.py), and
# tests/test_structure.py renames these to show it.
NAMES = {'segment': 'segment_{}', 'level': 'level', 'block': 'block', 'set': 'set_{}',
         'router': 'router'}

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


def _block_cls(cfg: ModelConfig):
  if cfg.remat == 'none':
    return Block
  # prevent_cse is unnecessary inside scan (jax.checkpoint docstring) and costs speed.
  return nn.remat(Block, policy=remat_policy(cfg.remat), prevent_cse=False)


def _scan(target, length: int, stacked: bool, axis_name: str, unroll: int,
          split_transpose: bool = True):
  """Scan `target` `length` times; stacked -> params per iteration, else params broadcast.

  The body takes (carry: Stream, shared: Shared, scanned: Scanned): `shared` is broadcast to
  every iteration, `scanned` (the KV caches, when decoding) is sliced along its leading axis,
  one entry per iteration, and the updated caches come back stacked as the scan's output.

  `split_transpose` (jax's experimental lax.scan option) moves the weight-gradient part of the
  backward scan into a map after the loop, which makes the scanned train step faster on
  XLA:CPU (README "Results", benchmarks/step_bench.py).
  """
  in_axes = (nn.broadcast, 0)
  if stacked:
    return nn.scan(target, variable_axes={'params': 0, PER_LAYER: 0, INTERMEDIATES: 0},
                   split_rngs={'params': True, PER_LAYER: True}, in_axes=in_axes,
                   length=length, unroll=min(unroll, length),
                   metadata_params={nn.PARTITION_NAME: axis_name},
                   _split_transpose=split_transpose)
  return nn.scan(target, variable_axes={PER_LAYER: 0, INTERMEDIATES: 0},
                 variable_broadcast='params',
                 split_rngs={'params': False, PER_LAYER: True}, in_axes=in_axes,
                 length=length, unroll=min(unroll, length),
                 metadata_params={nn.PARTITION_NAME: axis_name})


def _reshape_leading(cache: LayerCache | None, n_lead: int, shape: tuple[int, ...]):
  """Regroups the first `n_lead` axes of every cache leaf as `shape` (None stays None)."""
  if cache is None:
    return None
  return jax.tree.map(lambda a: a.reshape(shape + a.shape[n_lead:]), cache)   # v None: kept


def _map_leading(tree, value_fn, names_fn):
  """Maps the leading axes of every leaf, keeping logical-partitioning boxes consistent."""
  def leaf(x):
    if isinstance(x, nn.Partitioned):
      return x.replace(value=value_fn(x.value), names=names_fn(tuple(x.names)))
    return value_fn(x)
  return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def on_stream(layers, masa=None):
  """(x, positions, segment ids) -> (x, None): a scan over blocks as routing calls it."""
  def run(x_BTD, positions_T, segment_ids_BT=None):
    carry, _ = layers(Stream(x_BTD), Shared(positions_T, segment_ids_BT, masa=masa), Scanned())
    return carry.x_BTD, None
  return run


class _Level(nn.Module):
  """One scan level; the innermost level scans the (remat'd) Block."""
  cfg: ModelConfig
  levels: tuple[tuple[int, bool, str], ...]   # (length, stacked, axis_name), outermost first

  @nn.compact
  def __call__(self, carry: Stream, shared: Shared, scanned: Scanned = Scanned()):
    """-> (carry, updated cache or None); a cache has leading axes = the level lengths."""
    (length, stacked, axis), rest = self.levels[0], self.levels[1:]
    lengths = tuple(n for n, _, _ in self.levels)
    if rest and self.cfg.scan_lowering == 'flat':
      # One scan over the applied layers; stored layout unchanged (see module docstring).
      (pos,) = [i for i, (_, s, _) in enumerate(self.levels) if s]
      pattern = np.unravel_index(np.arange(math.prod(lengths)), lengths)[pos]
      flat = Scanned(_reshape_leading(scanned.cache, len(lengths), (math.prod(lengths),)))
      gather = GatherSegment(self.cfg, tuple(int(k) for k in pattern),
                             tuple((n, a) for n, _, a in self.levels), name=NAMES['level'])
      carry, cache = gather(carry, shared, flat)
      return carry, _reshape_leading(cache, 1, lengths)
    c = self.cfg
    if rest:
      body = _scan(_Level, length, stacked, axis, c.scan_unroll, c.scan_split_transpose)(
          c, rest, name=NAMES['level'])
    else:
      body = _scan(_block_cls(c), length, stacked, axis, c.scan_unroll,
                   c.scan_split_transpose)(c, name=NAMES['block'])
    return body(carry, shared, scanned)


class GatherSegment(nn.Module):
  """One scan over applied layers whose sets are gathered from a pool.

  Serves explicit index lists and, with `per_layer_levels`, regular plans under
  `scan_lowering='flat'`. At init the freshly created L-stack is reduced to the pool (first user
  of each set); in the forward pass `take` gathers, and its gradient scatter-adds the per-use
  gradients. PER_LAYER is stored with leading axes `per_layer_levels` ((length, axis name),
  default one 'layers' axis of length L) and flattened to L for the scan.
  """
  cfg: ModelConfig
  pattern: tuple[int, ...]                        # applied layer -> stored set
  per_layer_levels: tuple[tuple[int, str], ...] = ()

  @nn.compact
  def __call__(self, carry: Stream, shared: Shared, scanned: Scanned = Scanned()):
    """-> (carry, updated cache or None); a cache has one leading applied-layer axis."""
    L = len(self.pattern)
    levels = self.per_layer_levels or ((L, 'layers'),)
    lengths, axes = tuple(n for n, _ in levels), tuple(a for _, a in levels)
    first_use = tuple(self.pattern.index(u) for u in range(max(self.pattern) + 1))
    identity = self.pattern == tuple(range(L))

    def remap(set_idx, n_lead, lead_shape, lead_names):
      """params: gather sets along axis 0; PER_LAYER: regroup the n_lead leading axes."""
      def fn(vs):
        out = dict(vs)
        if 'params' in vs:
          gather = (lambda p: p) if identity else (lambda p: jnp.take(p, np.asarray(set_idx),
                                                                      axis=0))
          out['params'] = _map_leading(vs['params'], gather, lambda n: n)
        if PER_LAYER in vs:
          out[PER_LAYER] = _map_leading(
              vs[PER_LAYER], lambda p: p.reshape(lead_shape + p.shape[n_lead:]),
              lambda n: lead_names + n[n_lead:])
        return out
      return fn

    body = _scan(_block_cls(self.cfg), L, True, 'layers', self.cfg.scan_unroll,
                 self.cfg.scan_split_transpose)
    # init only while initializing: with init=True flax treats *any* mutable collection (e.g.
    # sown 'intermediates') as initialization and runs the scan on the un-gathered pool.
    mapped = nn.map_variables(
        body, ['params', PER_LAYER],
        trans_in_fn=remap(self.pattern, len(lengths), (L,), ('layers',)),
        trans_out_fn=remap(first_use, 1, lengths, axes), init=self.is_initializing())
    return mapped(self.cfg, name=NAMES['block'])(carry, shared, scanned)


class RoutedSegment(nn.Module):
  """A cycle segment whose R recursions are routed per token (models/routing.py).

  The K stacked sets are stored exactly as in the plain nested segment (segment_i/level/block),
  the routers beside them (segment_i/router). Expert choice calls the inner scan over the K sets
  once per recursion on that recursion's subset, R static lengths, so the program holds R scans
  (compile time grows with R), or, with model.routing.buckets = n, one scan over the recursions
  of each of n buckets at the bucket's first length (compile time grows with n, not R); token
  choice runs all recursions at full length, so one scan over the recursions around the inner
  scan, as the plain segment.
  """
  cfg: ModelConfig
  seg: Segment

  @nn.compact
  def __call__(self, x_BTD: jax.Array, positions_T: jax.Array | None, segment_ids_BT=None,
               masa=None):
    c = self.cfg
    if c.umup_residual:
      raise ConfigError(f'model.routing.kind={c.routing.kind!r}: the u-muP residual rule is not '
                        f'routed; valid: another parametrization.kind')
    sow = lambda name, value: self.sow(routing.ROUTING, name, value)
    router = routing.Router(c, name=NAMES['router'])
    if c.routing.kind == 'expert_choice' and not c.routing.buckets:
      inner = _Level(c, segment_levels(self.seg)[1:], name=NAMES['level'])
      level = on_stream(inner, masa)
      return routing.expert_choice(x_BTD, positions_T, segment_ids_BT, cfg=c, router=router,
                                   level=level, sow=sow)
    if c.routing.kind == 'expert_choice':
      # Bucketed: one scan over each bucket's recursions (its length from the scanned steps),
      # the router rows broadcast into the body; the same instance runs every bucket.
      body, weights = _recursions(c, self.seg.num_sets), router.expert_weights()
      return routing.expert_choice(
          x_BTD, positions_T, segment_ids_BT, cfg=c, router=router, level=None, sow=sow,
          recurse=lambda carry, steps, kept: body(carry, steps, kept, weights, masa))
    # Token choice: every recursion has the full shape, so one scan over them (params
    # broadcast, as the plain nested segment's outer scan over repeats).
    body = _recursions(c, self.seg.num_sets, self.seg.repeats)

    def recurse(carry, routes, positions):
      (_, out_BTD), _ = body(carry, jnp.arange(self.seg.repeats), routes, positions, masa)
      return out_BTD
    return routing.token_choice(x_BTD, positions_T, segment_ids_BT, cfg=c, router=router,
                                sow=sow, recurse=recurse, bias_R=router.exit_bias())


def _recursions(cfg: ModelConfig, num_sets: int, length: int | None = None):
  """A scan over routed recursions (RoutedSegment): params broadcast, as the plain nested
  segment's outer scan over repeats; scanned input first, then three broadcast arguments (the
  last the MASA atoms or None); the length from the scanned input unless given."""
  return nn.scan(_Recursion, variable_axes={PER_LAYER: 0, INTERMEDIATES: 0},
                 variable_broadcast='params', split_rngs={'params': False, PER_LAYER: True},
                 in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=length,
                 metadata_params={nn.PARTITION_NAME: 'repeats'})(cfg, num_sets,
                                                                 name=NAMES['level'])


class _Recursion(nn.Module):
  """One routed recursion, the body of `_recursions`: the K-layer scan, stored as the plain
  nested segment's (segment_i/level/block), inside token choice's update (scanned: the
  recursion index; broadcast: the routes, the positions) or expert choice's (scanned: the
  bucket's steps; broadcast: its kept tokens, the router weights); models/routing.py."""
  cfg: ModelConfig
  num_sets: int

  @nn.compact
  def __call__(self, carry, scanned, a, b, masa=None):
    c = self.cfg
    scan = _scan(_block_cls(c), self.num_sets, True, 'layers', c.scan_unroll,
                 c.scan_split_transpose)(c, name=NAMES['block'])
    block = on_stream(scan, masa)
    if c.routing.kind == 'token_choice':
      return routing.token_recursion(block, scanned, carry, a, b), None
    return routing.expert_recursion(block, functools.partial(routing.expert_logits, b),
                                    c.router_alpha, carry, scanned, a)


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
               dtype: jnp.dtype | None = None) -> tuple[LayerCache, ...]:
  """An empty KV cache: per plan segment, a LayerCache stacked over its applied layers
  (leaves (applied layers, B, S, kv heads, head_dim)), so sum of the leading axes is
  cfg.num_layers whatever the sharing plan. Values-are-keys sharing (model.attention_sharing
  kv_shared | qkv_shared) holds K only: v is None."""
  dt = jnp.dtype(dtype or cfg.dtype)
  def one(n):
    shape = (n, batch_size, num_slots, cfg.kv_heads, cfg.d_head)
    return LayerCache(jnp.zeros(shape, dt), None if cfg.values_are_keys else jnp.zeros(shape, dt))
  return tuple(one(seg.num_applied) for seg in cfg.plan.segments)


class Stack(nn.Module):
  """Applies cfg.num_layers layers, storing only the plan's unique sets.

  (carry, shared, caches) -> (carry, updated caches): `shared` (block.Shared: positions,
  segment ids, the decode step, the MASA atoms) reaches every block; `caches` (init_cache's
  structure, None without generation) is sliced per applied layer.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, carry: Stream, shared: Shared, caches: tuple[LayerCache, ...] | None = None
               ) -> tuple[Stream, tuple[LayerCache, ...] | None]:
    if not self.cfg.scan_layers:
      return self._python_loop(carry, shared, caches)
    new_caches = []
    for i, seg in enumerate(self.cfg.plan.segments):
      cfg = self.cfg.segment_cfg(seg)   # no LoRA on unshared segments under lora_layers=shared
      name = NAMES['segment'].format(i)
      with placed(**placement(self.cfg.plan, i)):
        if i == self.cfg.routed_segment:
          if caches is not None:
            raise ConfigError(f'model.routing.kind={cfg.routing.kind!r}: cached generation of a '
                              f'routed model is not implemented; valid: routing.kind=none')
          x_BTD = RoutedSegment(cfg, seg, name=name)(carry.x_BTD, shared.positions_T,
                                                     shared.segment_ids_BT, shared.masa)
          carry, cache = carry._replace(x_BTD=x_BTD), None
        elif seg.order == 'gather':
          carry, cache = GatherSegment(cfg, seg.pattern, name=name)(
              carry, shared, Scanned(None if caches is None else caches[i]))
        else:
          levels = segment_levels(seg)
          lengths = tuple(n for n, _, _ in levels)
          nested = None if caches is None else _reshape_leading(caches[i], 1, lengths)
          carry, cache = _Level(cfg, levels, name=name)(carry, shared, Scanned(nested))
          cache = _reshape_leading(cache, len(lengths), (seg.num_applied,))
      new_caches.append(cache)
    return carry, None if caches is None else tuple(new_caches)

  def _python_loop(self, carry: Stream, shared: Shared, caches):
    """The Python-loop baseline (benchmarks): one module per unique set, reused where tied."""
    plan = self.cfg.plan
    blocks = [_block_cls(self.cfg)(self.cfg, name=NAMES['set'].format(u))
              for u in range(plan.num_unique)]
    layer, new_caches = 0, []
    for i, seg in enumerate(plan.segments):
      layer_caches = []
      for j in range(seg.num_applied):
        u = plan.index[layer]
        layer += 1
        one = None if caches is None else jax.tree.map(lambda a: a[j], caches[i])
        with placed(segment=i, sets=(u,), uses=(len(plan.uses(u)),), layers=()):
          carry, one = blocks[u](carry, shared, Scanned(one))
        layer_caches.append(one)
      if caches is not None:
        new_caches.append(jax.tree.map(lambda *a: jnp.stack(a), *layer_caches))
    return carry, None if caches is None else tuple(new_caches)
