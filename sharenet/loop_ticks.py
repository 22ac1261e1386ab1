"""The ticks of recursive inference (sharenet/recursive_inference.py): the decode state of a fixed
number of slots, and one loop of the looped segment for every slot at its own depth.

A tick runs, per slot (vmapped: slots never interact), the prelude when the slot's token starts,
loop `depth` of the looped segment, and the coda for the exit logits; the shared head reads
them; the exit criterion (sharenet/exits.py) or the last loop ends the token, which is then
sampled (sharenet/generate.py `sample_rows`: greedy at temperature 0, else temperature / top-k /
top-p with the key of (request, token index), so a token draws what full-depth `generate` draws
for it). The loops served are the plan's R, or another maximum depth M (`at_depth`: the applied
layers are renumbered as prelude + M loops + coda, every layer reading its stored set, and
per-layer parts only for M <= R, sharenet/depth.py). Under model.kv_sharing=first a slot's cache
holds one loop's rows of the looped segment (`cache_rows`): the first loop writes them, the
later loops attend to them (their own keys and values computed and dropped), and an exit copies
nothing.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharenet import exits
from sharenet.errors import ConfigError
from sharenet.generate import row_keys, sample_rows
from sharenet.models import DecoderLM, layer_store, loops

GREEDY = (0.0, 0, 1.0)   # (temperature, top_k, top_p)


def check_recursive(model: DecoderLM, variables: Any) -> loops.Looped:
  """The plan read as prelude + R loops + coda (models/loops.py); one ConfigError otherwise."""
  c = model.cfg
  shape = loops.looped(c)
  if c.routing.kind != 'none':
    raise ConfigError(f'recursive inference runs every loop on every token; model.routing.kind='
                      f'{c.routing.kind!r} routes them (docs/routing.md); valid: routing.kind=none')
  if c.umup_residual:
    raise ConfigError('recursive inference does not support parametrization.kind=umup (its '
                      'residual rule depends on the applied layer index); valid: sp, mup')
  if c.recurrence.injection != 'none':
    raise ConfigError(f'recursive inference applies the stored layers one token at a time '
                      f'without re-entering the input; model.recurrence.injection='
                      f'{c.recurrence.injection!r} needs it (docs/loops.md); valid: none')
  if c.values_are_keys:
    raise ConfigError(f'recursive inference keeps keys and values per layer; model.'
                      f'attention_sharing={c.attention_sharing} stores no values; valid: none, '
                      f'qk_shared')
  return shape


def at_depth(shape: loops.Looped, max_loops: int | None) -> loops.Looped:
  """The plan read with `max_loops` loops (None: the plan's R)."""
  if max_loops is None or max_loops == shape.loops:
    return shape
  return shape._replace(loops=max_loops,
                        num_layers=shape.num_layers + (max_loops - shape.loops) * shape.num_sets)


def embed(model: DecoderLM, variables: Any, tokens_BT: jax.Array,
          positions_BT: jax.Array) -> jax.Array:
  """The model's own input side (embedding, positions): the hidden state entering the trunk."""
  return model.apply(variables, tokens_BT, positions_BT, method='embed')


def readout(model: DecoderLM, variables: Any, h_BTD: jax.Array) -> jax.Array:
  """The shared exit head: the model's final norm and unembedding applied to `h_BTD`."""
  return model.apply(variables, h_BTD, method='head')


class Slots(NamedTuple):
  """The decode state of a fixed number of slots (B). L applied layers, S positions."""
  h_BD: jax.Array          # the token's stream: embedded at depth 0, else entering loop depth
  depth_B: jax.Array       # next loop to run (0 .. R-1)
  pos_B: jax.Array         # position of the token being computed
  k_BLSKD: jax.Array       # keys per cache row (cache_rows); cache slot s holds position s
  v_BLSKD: jax.Array
  key_pos_BS: jax.Array    # position held by each cache slot (-1: empty)
  active_B: jax.Array      # slot holds an unfinished request
  hold_B: jax.Array        # exited, waiting for the batch (sync mode only)
  out_BN: jax.Array        # emitted tokens
  count_B: jax.Array       # tokens emitted so far
  depth_sum_B: jax.Array   # sum over emitted tokens of the loops they used (1 .. R)
  logp_BV: jax.Array       # the previous loop's next-token log-probs (uniform at a start): kl
  req_B: jax.Array         # the request's index: the row of its sampling keys


def cache_rows(cfg, shape: loops.Looped) -> int:
  """Cache rows of a slot: one per applied layer at the served depth, or under
  model.kv_sharing=first one loop of the looped segment (the later loops read its rows)."""
  return shape.num_layers - (shape.loops - 1) * shape.num_sets * (cfg.kv_segment is not None)


def empty_slots(model: DecoderLM, batch: int, num_positions: int, max_new_tokens: int,
                num_layers: int | None = None) -> Slots:
  """`num_layers`: cache rows at the served depth (`cache_rows`; default the plan's layers)."""
  c = model.cfg
  L = c.num_layers if num_layers is None else num_layers
  shape = (batch, L, num_positions, c.kv_heads, c.d_head)
  zi = jnp.zeros((batch,), jnp.int32)
  return Slots(jnp.zeros((batch, c.d_model), jnp.dtype(c.dtype)), zi, zi,
               jnp.zeros(shape, jnp.dtype(c.dtype)), jnp.zeros(shape, jnp.dtype(c.dtype)),
               jnp.full((batch, num_positions), -1, jnp.int32), jnp.zeros((batch,), bool),
               jnp.zeros((batch,), bool), jnp.zeros((batch, max_new_tokens), jnp.int32), zi, zi,
               exits.uniform_logp(batch, c.vocab_size), zi)


def _slot_tick(cfg, shape: loops.Looped, store, h_D, depth, pos, run, k_LSKD, v_LSKD,
               key_pos_S):
  """One slot, one tick: the prelude when the token starts (depth 0), loop `depth`, and the
  coda for the exit logits. Writes the prelude's and the loop's cache columns where the slot
  runs; returns the coda's columns uncommitted (written only when the token exits), and the
  stream entering the loop (the latent criterion's h_{r-1})."""
  key_pos_S = jnp.where(run, key_pos_S.at[pos].set(pos), key_pos_S)
  apply = lambda x, first, n, k, v, row=None, write=None: layer_store.run_layers(
      cfg, store, x, first, n, k, v, pos, key_pos_S, row, write)
  kv = cfg.kv_segment is not None   # the later loops attend to the first loop's rows
  if shape.start:
    pre_D, k_N, v_N = apply(h_D, jnp.int32(0), shape.start, k_LSKD, v_LSKD)
    starts = run & (depth == 0)
    k_LSKD = layer_store.write_columns(k_LSKD, jnp.int32(0), pos, k_N, starts)
    v_LSKD = layer_store.write_columns(v_LSKD, jnp.int32(0), pos, v_N, starts)
    h_D = jnp.where(depth == 0, pre_D, h_D)
  h_in_D = h_D
  first = shape.start + depth * shape.num_sets
  row, write = (jnp.int32(shape.start), depth == 0) if kv else (first, None)
  h_D, k_N, v_N = apply(h_D, first, shape.num_sets, k_LSKD, v_LSKD, row, write)
  commit = run & (depth == 0) if kv else run   # kv: a later loop's columns are the held ones
  k_LSKD = layer_store.write_columns(k_LSKD, row, pos, k_N, commit)
  v_LSKD = layer_store.write_columns(v_LSKD, row, pos, v_N, commit)
  out_D, coda = h_D, None
  if shape.coda < shape.num_layers:
    out_D, k_N, v_N = apply(h_D, jnp.int32(shape.coda), shape.num_layers - shape.coda, k_LSKD,
                            v_LSKD, jnp.int32(_coda_row(cfg, shape)))
    coda = (k_N, v_N)
  return h_in_D, h_D, out_D, k_LSKD, v_LSKD, key_pos_S, coda


def _coda_row(cfg, shape: loops.Looped) -> int:
  """The cache row of the coda's first layer (`cache_rows`)."""
  return shape.coda - (shape.num_layers - cache_rows(cfg, shape))


def _copy_deeper(kv_LSKD, depth, pos, exited, shape: loops.Looped):
  """If `exited`: fills the cache of the loops after `depth` at `pos` with loop `depth`'s."""
  L, K = kv_LSKD.shape[0], shape.num_sets
  at = (0, pos, 0, 0)
  col_L1KD = jax.lax.dynamic_slice(kv_LSKD, at, (L, 1) + kv_LSKD.shape[2:])
  layer_L = jnp.arange(L)
  looped_L = (layer_L >= shape.start) & (layer_L < shape.coda)
  src_L = jnp.where(looped_L, shape.start + depth * K + (layer_L - shape.start) % K, layer_L)
  deeper_L = exited & looped_L & (layer_L >= shape.start + (depth + 1) * K)
  filled_L1KD = jnp.where(deeper_L[:, None, None, None], col_L1KD[src_L], col_L1KD)
  return jax.lax.dynamic_update_slice(kv_LSKD, filled_L1KD, at)


def store_at(model: DecoderLM, variables,
             shape: loops.Looped | None = None) -> layer_store.LayerStore:
  """Every applied layer's parts at the served depth, gathered once per program (not per tick):
  applied layer l of prelude + M loops + coda reads the plan's layer of its set (loop l's own
  per-layer parts for M <= R; deeper loops exist only without them, sharenet/depth.py)."""
  store = layer_store.layer_store(model.cfg, variables, model.apply(variables, method='atoms'))
  plan = loops.looped(model.cfg)
  if shape is None or shape.loops == plan.loops:
    return store
  M, R, K = shape.loops, plan.loops, plan.num_sets
  src = np.r_[0:plan.start, plan.start + (np.arange(M * K) if M <= R else np.arange(M * K) % K),
              plan.coda:plan.num_layers]
  return store._replace(set_of_L=store.set_of_L[src],
                        per_layer={p: v[src] for p, v in store.per_layer.items()})


def _tick(variables, st: Slots, threshold, eos_id, rng=None, *, model: DecoderLM, sync: bool,
          store: layer_store.LayerStore | None = None, shape: loops.Looped | None = None,
          criterion: str = 'maxprob', sampling: tuple = GREEDY) -> Slots:
  """One loop for every running slot; exits, emits and starts next tokens (jit-able).
  `criterion` (sharenet/exits.py) with the traced `threshold`; `sampling`: (temperature,
  top_k, top_p); `rng` the generation's key (unused when greedy)."""
  shape = check_recursive(model, variables) if shape is None else shape
  R, N = shape.loops, st.out_BN.shape[1]
  store = store_at(model, variables, shape) if store is None else store
  rng = jax.random.key(0) if rng is None else rng
  run_B = st.active_B & ~st.hold_B
  tick = jax.vmap(functools.partial(_slot_tick, model.cfg, shape, store))
  h_in_BD, h_BD, out_BD, k_BLSKD, v_BLSKD, key_pos_BS, coda = tick(
      st.h_BD, st.depth_B, st.pos_B, run_B, st.k_BLSKD, st.v_BLSKD, st.key_pos_BS)
  logits_BV = readout(model, variables, out_BD[:, None])[:, 0]
  logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  fire_B = exits.fires(criterion, threshold, logp_BV, st.logp_BV, h_BD, h_in_BD)
  exit_B = run_B & (fire_B | (st.depth_B == R - 1))
  token_B = sample_rows(logits_BV, row_keys(rng, st.req_B, st.count_B), *sampling)
  if coda is not None:   # the coda's keys and values are the exiting token's
    write = jax.vmap(layer_store.write_columns, in_axes=(0, None, 0, 0, 0))
    coda_row = jnp.int32(_coda_row(model.cfg, shape))
    k_BLSKD = write(k_BLSKD, coda_row, st.pos_B, coda[0], exit_B)
    v_BLSKD = write(v_BLSKD, coda_row, st.pos_B, coda[1], exit_B)
  if model.cfg.kv_segment is None:   # kv sharing: the deeper loops read the first loop's rows
    copy = jax.vmap(functools.partial(_copy_deeper, shape=shape))
    k_BLSKD = copy(k_BLSKD, st.depth_B, st.pos_B, exit_B)
    v_BLSKD = copy(v_BLSKD, st.depth_B, st.pos_B, exit_B)

  out_BN = jnp.where(exit_B[:, None] & (jnp.arange(N)[None] == st.count_B[:, None]),
                     token_B[:, None], st.out_BN)
  count_B = st.count_B + exit_B
  depth_sum_B = st.depth_sum_B + jnp.where(exit_B, st.depth_B + 1, 0)
  finished_B = exit_B & ((count_B >= N) | (token_B == eos_id))
  active_B = st.active_B & ~finished_B
  next_pos_B = st.pos_B + 1
  h0_BD = embed(model, variables, token_B[:, None], next_pos_B[:, None])[:, 0].astype(h_BD.dtype)
  h_BD = jnp.where(exit_B[:, None], h0_BD, jnp.where(run_B[:, None], h_BD, st.h_BD))
  depth_B = jnp.where(exit_B, 0, st.depth_B + run_B)
  pos_B = jnp.where(exit_B, next_pos_B, st.pos_B)
  uniform_BV = exits.uniform_logp(*logp_BV.shape)
  logp_BV = jnp.where(exit_B[:, None], uniform_BV,
                      jnp.where(run_B[:, None], logp_BV, st.logp_BV))
  hold_B = st.hold_B
  if sync:   # a static batch: the exited wait until every running member has exited
    hold_B = (hold_B | exit_B) & active_B
    hold_B = jnp.where(jnp.all(hold_B == active_B), False, hold_B)
  return Slots(h_BD, depth_B, pos_B, k_BLSKD, v_BLSKD, key_pos_BS, active_B, hold_B, out_BN,
               count_B, depth_sum_B, logp_BV, st.req_B)


def _run(variables, st: Slots, threshold, eos_id, until_free, rng, *, model: DecoderLM,
         sync: bool, shape: loops.Looped, criterion: str, sampling: tuple):
  """Ticks until no slot is active, or (`until_free`) until some slot finishes.

  Returns (slots, ticks run, slot-ticks that did work)."""
  def cond(carry):
    st, ticks, busy, freed = carry
    return jnp.any(st.active_B) & ~(until_free & freed)

  store = store_at(model, variables, shape)

  def body(carry):
    st, ticks, busy, freed = carry
    running = jnp.sum(st.active_B & ~st.hold_B)
    new = _tick(variables, st, threshold, eos_id, rng, model=model, sync=sync, store=store,
                shape=shape, criterion=criterion, sampling=sampling)
    return new, ticks + 1, busy + running, jnp.any(st.active_B & ~new.active_B)

  zero = jnp.zeros((), jnp.int32)
  st, ticks, busy, _ = jax.lax.while_loop(cond, body, (st, zero, zero, jnp.zeros((), bool)))
  return st, ticks, busy


run_jit = jax.jit(_run, static_argnames=('model', 'sync', 'shape', 'criterion', 'sampling'))


def insert(variables, st: Slots, slot, k_LSKD, v_LSKD, key_pos_S, last_token, last_pos, req, *,
           model: DecoderLM) -> Slots:
  """Puts a prefilled request (index `req`) into `slot`: its last prompt token starts at loop
  0."""
  h_D = embed(model, variables, last_token[None, None], last_pos[None, None])[0, 0]
  return Slots(st.h_BD.at[slot].set(h_D.astype(st.h_BD.dtype)), st.depth_B.at[slot].set(0),
               st.pos_B.at[slot].set(last_pos), st.k_BLSKD.at[slot].set(k_LSKD),
               st.v_BLSKD.at[slot].set(v_LSKD), st.key_pos_BS.at[slot].set(key_pos_S),
               st.active_B.at[slot].set(True), st.hold_B.at[slot].set(False),
               st.out_BN.at[slot].set(0), st.count_B.at[slot].set(0),
               st.depth_sum_B.at[slot].set(0),
               st.logp_BV.at[slot].set(exits.uniform_logp(1, st.logp_BV.shape[1])[0]),
               st.req_B.at[slot].set(req))


insert_jit = jax.jit(insert, static_argnames=('model',))
