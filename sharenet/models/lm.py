"""Decoder-only language model: embed -> shared-weight stack -> final norm -> readout."""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax._src import config as jax_config   # trace_context: what jit keys its traces on
from flax.traverse_util import unflatten_dict
from jax.sharding import PartitionSpec

from sharenet.models.attention import DecodeStep, LayerCache
from sharenet.models.block import ACT_AXES, Shared, Stream
from sharenet.models.config import ModelConfig
from sharenet.models.layers import Dense, Embed, sow_l1
from sharenet.models.bank import ParameterBank
from sharenet.models.masa import MasaAtoms, atom_specs
from sharenet.models.moe import MOE
from sharenet.models.loops import Schedule, looped
from sharenet.models.stack import Stack, init_cache as init_layer_caches
from sharenet.models import embeddings, mpo, params
from sharenet.models.norm_stats import NORM_STATS
from sharenet.models.norms import Norm
from sharenet.models.params import PER_LAYER
from sharenet.models.routing import BALANCE
from sharenet.models.sections import STATS_NORMS

TRAINABLE = ('params', PER_LAYER)
# The stack's module name; only models/ reads it (tests/models/test_structure.py renames it).
STACK = 'stack'


class KVCache(NamedTuple):
  """The generation state of DecoderLM: keys and values of every applied layer (`layers`, one
  LayerCache per plan segment stacked over its applied layers: models/stack.py), the absolute
  position held in every slot (-1: empty or padding) and the next slot to write."""
  layers: tuple[LayerCache, ...]
  key_positions_BS: jax.Array   # (B, S) int32
  index: jax.Array              # () int32


def init_cache(cfg: ModelConfig, batch_size: int, num_slots: int,
               loops: int | None = None) -> KVCache:
  """An empty cache of `num_slots` positions per sequence, in the model's compute dtype;
  `loops`: for decoding at another depth (schedule=Schedule(loops=loops) on every call)."""
  return KVCache(init_layer_caches(cfg, batch_size, num_slots, loops_run=loops),
                 jnp.full((batch_size, num_slots), -1, jnp.int32), jnp.zeros((), jnp.int32))


def kv_cache_bytes_per_token(cfg: ModelConfig, loops: int | None = None) -> int:
  """Bytes of keys and values the decode cache (init_cache) holds per token of one sequence:
  every cached layer, in the compute dtype; values-are-keys attention sharing holds no values,
  model.kv_sharing=first one loop of the looped segment. `loops`: decoding at that depth.
  Slot positions (4 bytes per slot) are bookkeeping, not counted."""
  caches = jax.eval_shape(lambda: init_layer_caches(cfg, 1, 1, loops_run=loops))
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(caches))


class DecoderLM(nn.Module):
  """tokens (B, T) int -> logits (B, T, V) float32, in three parts that serving code calls
  directly: `embed` (tokens -> the stream entering the trunk), `trunk` (the plan's segments,
  models/stack.py) and `head` (final norm and readout); `atoms` gives the MASA atoms the
  trunk's blocks read (None without MASA).

  With a `cache` (init_cache) the call is one step of cached generation: `tokens_BT` are the
  next T tokens of each sequence, `positions_BT` their absolute positions (-1 marks padding,
  e.g. the left-padding of a shorter prompt); it returns (logits, updated cache), and each
  token attends to itself and the cached tokens of lower position of its own sequence.

  `segment_ids_BT` (optional, int): attention stays within equal ids (packed documents,
  sharenet/data/arrayrecord.py). Positions stay 0..T-1 across the window either way.

  `schedule` (models/loops.py Schedule) runs the looped segment another number of loops and
  a prefix of them without gradient (with a cache: decoding at another depth, the cache made
  by init_cache(loops=...)); with `collect`, the stream after each loop is sown into the
  `loops.PER_LOOP` collection (apply with mutable=[PER_LOOP]); `exit_logits` reads those
  streams out through the coda and the head (trained exits, sharenet/train/sampled_depth.py).
  """
  cfg: ModelConfig

  def setup(self):
    c = self.cfg
    dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    if c.embed_dim:   # factorized: a (vocab, E) table lifted to d_model (models/embeddings.py)
      self.embedder = Embed(c.vocab_size, c.embed_dim, c.embed_init_std, c.norm.fixnorm, dt,
                            pdt, axis=embeddings.FACTOR_AXIS, name='embed')
      self.embed_proj = embeddings.EmbedProjection(c, name='embed_proj')
    else:
      self.embedder = Embed(c.vocab_size, c.d_model, c.embed_init_std, c.norm.fixnorm, dt, pdt,
                            name='embed')
    if c.position == 'learned':
      self.pos_table = params.param(self, 'pos_embed', (c.max_len, c.d_model),
                                    ('length', 'embed'), 'pos_embed', std=0.02, dtype=pdt,
                                    num_in=1, writes=True)
    # MASA atoms (models/masa.py) or the parameter bank's templates (models/bank.py): stored
    # here once, handed to every applied layer.
    self.masa_atoms = MasaAtoms(c, name='masa') if c.atom_kernels else None
    self.bank = ParameterBank(c, name='bank') if c.bank_kernels else None
    self.mpo_central = (mpo.MpoCentral(tuple(mpo.kernel_dims(
        atom_specs(c, c.mpo_kernels)).items()), c.mpo.cores, c.mpo.bond, pdt, name='mpo')
        if c.mpo_kernels else None)
    self.stack = Stack(c, name=STACK)
    self.final_norm = None
    if c.norm.placement != 'post':
      self.final_norm = Norm(c.norm.kind, c.norm.eps, param_dtype=pdt,
                             dyt_alpha=c.norm.dyt_alpha, p=c.norm.p, role='norm_out',
                             kernels=c.kernels, stats=c.norm,
                             name='final_norm')
    self.readout = None
    if not c.tie_embeddings:
      self.readout = Dense((c.vocab_size,), ('embed',), ('vocab',), role='readout',
                           use_bias=c.reader_bias, dtype=dt, param_dtype=pdt, float32_out=True,
                           dense_grad=c.dense_grad, name='readout')
    elif c.embed_dim:   # the tied table read through W_down (D -> E)
      self.readout_proj = embeddings.readout_projection(c)
    if c.tie_embeddings and c.reader_bias:
      self.logits_bias = params.param(self, 'logits_bias', (c.vocab_size,), ('vocab',), 'bias',
                                      init=nn.initializers.zeros, dtype=pdt)

  def embed(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
            segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """The stream entering the trunk (B, T, D); `positions_BT` (absolute, >= 0) for learned
    positions in cached generation (default 0..T-1); `segment_ids_BT`: packed documents (the
    self-attentive factorized embedding attends within each)."""
    c = self.cfg
    x_BTD = self.embedder(tokens_BT)
    if c.embed_dim:
      x_BTD = self.embed_proj(x_BTD, segment_ids_BT)
    if c.embed_scale != 1.0:   # Gemma's sqrt(d_model); the tied readout reads the raw table
      x_BTD = x_BTD * jnp.asarray(c.embed_scale, x_BTD.dtype)
    if c.position == 'learned':
      if positions_BT is None:
        x_BTD = x_BTD + self.pos_table[None, :tokens_BT.shape[1]].astype(x_BTD.dtype)
      else:
        x_BTD = x_BTD + jnp.take(self.pos_table, positions_BT, axis=0).astype(x_BTD.dtype)
    if c.center_embedding:   # zero-mean writer for tied tables
      x_BTD = x_BTD - jnp.mean(x_BTD, axis=-1, keepdims=True)
    x_BTD = nn.with_logical_constraint(x_BTD, ACT_AXES)
    # A zero-valued hook so tests and coordinate checks can take d(out)/d(embedded input).
    x_BTD = self.perturb('embedded', x_BTD)
    sow_l1(self, 'embed_out', x_BTD)
    return x_BTD

  def atoms(self) -> dict[str, jax.Array] | None:
    """The atoms {kernel name: atoms} every block reads: MASA's, or the parameter bank's
    templates (None without either; the compatibility table refuses both at once)."""
    if self.bank is not None:
      return self.bank()
    if self.mpo_central is not None:   # MPO central tensors (models/mpo.py)
      return self.mpo_central()
    return None if self.masa_atoms is None else self.masa_atoms()

  def trunk(self, x_BTD: jax.Array, positions_T: jax.Array | None, segment_ids_BT=None,
            layer_caches: tuple | None = None, step: DecodeStep | None = None,
            schedule: Schedule = Schedule()):
    """The plan's segments over the stream: x, or (x, updated layer caches) with a cache;
    `schedule` changes the looped segment's loops (models/loops.py)."""
    # u-muP's residual rule and sliced loops carry the applied layer index (block.py).
    layer = (jnp.zeros((), jnp.int32) if self.cfg.umup_residual or self.cfg.slice_lens
             else None)
    # model.moe: the experts' aux losses ride in the carry (block.Stream), sown as MOE
    aux = jnp.zeros((), jnp.float32) if self.cfg.moe.aux and step is None else None
    shared = Shared(positions_T, segment_ids_BT, step, self.atoms())
    carry, layer_caches = self.stack(Stream(x_BTD, layer, aux), shared, layer_caches, schedule)
    if aux is not None:
      self.sow(MOE, 'aux_loss', carry.aux)
    return carry.x_BTD if layer_caches is None else (carry.x_BTD, layer_caches)

  def head(self, x_BTD: jax.Array) -> jax.Array:
    """Final norm and readout: the stream (B, T, D) -> logits (B, T, V), float32 or wider."""
    c = self.cfg
    if self.final_norm is not None:
      x_BTD = self.final_norm(x_BTD)
      sow_l1(self, 'final_norm_out', x_BTD)
    if self.readout is None:
      logits_BTV = self.embedder.attend(self.readout_proj(x_BTD) if c.embed_dim else x_BTD)
      if c.reader_bias:
        logits_BTV = logits_BTV + self.logits_bias[None, None].astype(logits_BTV.dtype)
    else:
      logits_BTV = self.readout(x_BTD)
    if c.logits_mult != 1.0:   # muP readout multiplier (microsoft/mup MuReadout)
      logits_BTV = logits_BTV * c.logits_mult
    if c.logit_softcap:        # Gemma 2's final_logit_softcapping
      cap = c.logit_softcap
      logits_BTV = cap * jnp.tanh(logits_BTV.astype(jnp.promote_types(logits_BTV.dtype,
                                                                      jnp.float32)) / cap)
    sow_l1(self, 'logits', logits_BTV)
    # float32 logits: a low-precision model's readout already returns them unrounded
    # (layers.einsum_f32); float64 stays float64 (exactness tests).
    logits_BTV = logits_BTV.astype(jnp.promote_types(logits_BTV.dtype, jnp.float32))
    return nn.with_logical_constraint(
        logits_BTV, ('activation_batch', 'activation_length', 'activation_vocab'))

  def exit_logits(self, streams_NBTD: jax.Array, segment_ids_BT: jax.Array | None = None
                  ) -> jax.Array:
    """Logits (N, B, T, V) at N loop exits: each stream after a loop of the looped segment
    (Schedule.collect) through the segments after it (the coda: middle_cycle's unique last
    layer, as loop_by_loop.py exits) and the head."""
    N, B, T, D = streams_NBTD.shape
    x_BTD = streams_NBTD.reshape(N * B, T, D)   # the exits batched: one pass of the coda
    first = looped(self.cfg).segment + 1
    if first < len(self.cfg.plan.segments):
      seg_BT = None if segment_ids_BT is None else jnp.tile(segment_ids_BT, (N, 1))
      shared = Shared(jnp.arange(T), seg_BT, None, self.atoms())
      carry, _ = self.stack(Stream(x_BTD), shared, None, Schedule(), first)
      x_BTD = carry.x_BTD
    logits_BTV = self.head(x_BTD)
    return logits_BTV.reshape((N, B) + logits_BTV.shape[1:])

  def __call__(self, tokens_BT: jax.Array, segment_ids_BT: jax.Array | None = None,
               cache: KVCache | None = None, positions_BT: jax.Array | None = None,
               schedule: Schedule = Schedule(), rows_B: jax.Array | None = None):
    """Logits (B, T, V); with `cache`, (logits, the updated cache). `rows_B` (cached only):
    the batch row each sequence draws a random initial state as (attention.DecodeStep)."""
    T = tokens_BT.shape[1]
    if cache is None:
      x_BTD = self.trunk(self.embed(tokens_BT, segment_ids_BT=segment_ids_BT), jnp.arange(T),
                         segment_ids_BT, schedule=schedule)
      return self.head(x_BTD)
    key_pos_BS = jax.lax.dynamic_update_slice_in_dim(cache.key_positions_BS, positions_BT,
                                                     cache.index, axis=1)
    step = DecodeStep(cache.index, jnp.maximum(positions_BT, 0), key_pos_BS, rows_B=rows_B)
    x_BTD = self.embed(tokens_BT, step.positions_BT)
    # cached generation: positions come with the step
    x_BTD, layer_caches = self.trunk(x_BTD, None, segment_ids_BT, cache.layers, step,
                                     schedule)
    return self.head(x_BTD), KVCache(layer_caches, key_pos_BS, cache.index + T)


def init_boxed(model: DecoderLM, rng: jax.Array, batch_size: int = 1, seq_len: int = 8):
  """Trainable collections with their logical-axis boxes (use under jax.eval_shape)."""
  return _trainable(_init_all(model, rng, batch_size, seq_len))


def _init_all(model: DecoderLM, rng: jax.Array, batch_size: int, seq_len: int):
  """Every collection the init creates: the trainable ones, boxed, and the state ones (a
  statistics norm's, loss-free balancing's)."""
  k_params, k_layer = jax.random.split(rng)
  tokens = jnp.zeros((batch_size, seq_len), jnp.int32)
  return dict(model.init({'params': k_params, PER_LAYER: k_layer}, tokens))


def _trainable(variables: dict[str, Any]) -> dict[str, Any]:
  return {c: variables[c] for c in TRAINABLE if c in variables}


def init_variables(model: DecoderLM, rng: jax.Array, batch_size: int = 1, seq_len: int = 8):
  """Initializes the trainable collections ('params' and the per-layer one) as plain arrays.

  One compiled program (op by op, an init compiles each scan and each initializer shape
  separately) that evaluates the init's traced program (`_init_trace`, cached with the role
  table: the flax modules are traced once per config, not once per table and once per init).
  """
  return _init_trace(model.cfg, batch_size, seq_len, _aval(rng), _trace_key()).init(rng)


def initial_state(cfg: ModelConfig) -> dict[str, Any]:
  """The model's non-trainable state at init, as TrainState.tstate holds it: {routing.BALANCE:
  loss-free balancing's zero bias} and {norm_stats.NORM_STATS: a statistics norm's running
  statistics}, each only where the config has it."""
  out = {}
  if cfg.loss_free:
    out[BALANCE] = init_collection(cfg, BALANCE)
  if cfg.norm.kind in STATS_NORMS:
    out[NORM_STATS] = init_collection(cfg, NORM_STATS)
  return out


def init_collection(cfg: ModelConfig, name: str) -> Any:
  """The init's non-trainable collection `name` (norm_stats.NORM_STATS, routing.BALANCE) at
  key 0, from the init's cached trace (no second trace of the flax modules). Inside a jit or
  eval_shape it is part of that program; the rest of the init is dead code there."""
  key = jax.random.key(0)
  return _init_trace(cfg, 1, 8, _aval(key), _trace_key()).collection(key, name)


class _InitTrace:
  """The flax init of one config as a traced program (every collection): `boxed` is its
  output's shapes with the parameters' boxes; calling it evaluates the program on a key.
  `init` is its jitted, unboxed trainable part, `table` the role table read from the boxes,
  `collection(key, name)` one state collection.
  """

  def __init__(self, jaxpr: Any, boxed: Any):
    self.jaxpr, self.boxed = jaxpr, boxed
    self.init = jax.jit(lambda key: nn.unbox(_trainable(self(key))))
    self.collection = jax.jit(lambda key, name: self(key)[name], static_argnums=1)

  @functools.cached_property
  def table(self) -> dict[tuple[str, ...], params.ParamInfo]:
    return params.table(_trainable(self.boxed))

  def __call__(self, rng: jax.Array):
    out = jax.core.eval_jaxpr(self.jaxpr.jaxpr, self.jaxpr.consts, rng)
    return jax.tree.unflatten(jax.tree.structure(self.boxed), out)


def _aval(rng: jax.Array) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(rng.shape, rng.dtype)


@functools.cache
def _default_key(impl: Any) -> jax.ShapeDtypeStruct:
  """The aval of jax.random.key(0) under the default PRNG implementation `impl` (made once,
  not on every role-table lookup)."""
  return _aval(jax.random.key(0))


def _trace_key() -> tuple:
  """What a trace of the init depends on beyond the config: the abstract mesh and the logical
  rules (activation constraints are traced under them) and jax's trace-time settings (x64,
  rank promotion, ...), so a program traced under one never serves another."""
  rules = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                for name, axes in nn.get_logical_axis_rules())
  return jax.sharding.get_abstract_mesh(), rules, jax_config.trace_context()


@functools.lru_cache(maxsize=64)
def _init_trace(cfg: ModelConfig, batch_size: int, seq_len: int, rng: jax.ShapeDtypeStruct,
                context: tuple) -> _InitTrace:
  del context   # part of the cache key only
  jaxpr, boxed = jax.make_jaxpr(
      lambda key: _init_all(DecoderLM(cfg), key, batch_size, seq_len), return_shape=True)(rng)
  return _InitTrace(jaxpr, boxed)


def abstract_variables(model: DecoderLM):
  """init_variables' tree as ShapeDtypeStructs, read from the role table (no second trace)."""
  return unflatten_dict({path: jax.ShapeDtypeStruct(info.shape, info.dtype)
                         for path, info in param_table(model.cfg).items()})


def logical_axes(model: DecoderLM):
  """Pytree of logical axis names (PartitionSpec) matching init_variables' tree: read from the
  role table (every leaf is a `params.Param` box), so no second trace of the init."""
  return unflatten_dict(
      {path: PartitionSpec(*info.axes) for path, info in param_table(model.cfg).items()})


def param_table(cfg: ModelConfig) -> dict[tuple[str, ...], params.ParamInfo]:
  """The role table {path (collection first): ParamInfo} of DecoderLM(cfg), from the init's
  trace (no computation).

  Cached per config with that trace: clear it (`param_table.cache_clear()`) after patching
  model modules.
  """
  key = _default_key(jax.config.jax_default_prng_impl)
  return _init_trace(cfg, 1, 8, key, _trace_key()).table


param_table.cache_clear = _init_trace.cache_clear
