"""Inference for recursive (cycle-shared) models: per-sequence early exit after any loop of the
shared block, and continuous depth-wise batching.

Relaxed Recursive Transformers (Bae et al., arXiv:2410.20672, the section on "continuous
depth-wise batching and early exiting"): a cycle model applies the same K stored sets R times, so
one "loop" (one pass over the K sets) is the same function at every depth. After each loop the
shared readout (final norm + unembedding, the model's own) gives exit logits; a sequence whose
exit criterion fires (sharenet/inference/exits.py: `maxprob`, the confidence `exit_threshold` sets,
`entropy`, or the recurrent-depth criteria `entropy_change`, `kl`, `argmax_stable`, `latent`
and `cosine` of Geiping et al., arXiv:2502.05171) emits its token from those logits and skips the
deeper loops for that token. A recurrent-depth model (models/recurrence.py) is served as it
trains: the stream entering the looped segment re-enters every loop, and the first loop starts
from the plan's initial state, a request drawing its random state as its row in `generate`.
A criterion that never fires (`exit_threshold=1.0`, maxprob's rule disabled there since float32
probabilities can round to exactly 1.0) is plain full-depth decoding. Tokens are greedy or
sampled (temperature / top-k / top-p, sharenet/inference/generate.py's sampler with its
per-(request, token) keys, so with the same `rng` a never-exiting run samples what `generate`
samples).
`depth` serves another maximum number of loops M (sharenet/inference/test_time_depth.py): the
prefill runs at M
loops and a token that never exits runs M.

Skipped loops' keys and values: later tokens attend to every applied layer, so an exited token's
cache entries for the deeper loops must be filled. Here they are *copied* from the last loop it
computed (applied layer (r', k) gets the keys and values of (r, k) for every deeper loop r' > r).
With tied weights this equals propagating each block's last computed input state to the deeper
applications of the same block (CALM's "state propagation", Schuster et al., arXiv:2207.07502,
propagates the exited state instead); it costs a cache copy and no extra compute. The RRT paper
requires the missing caches to be filled but we do not claim to reproduce its exact policy.
Under model.kv_sharing=first (Mixture-of-Recursions' recursive KV sharing,
sharenet/models/kv_sharing.py) nothing is missing: a slot holds one loop's rows of the looped
segment, written by the token's first loop, which every later loop (of this token and of the
later ones) reads, so an exit copies nothing.

The unit of work is a *tick*: one jitted application of one loop to every slot of a fixed-size
batch, each slot at its own depth, position and cache (the per-slot computation is vmapped, so
slots never interact; the weights are shared, so one application serves all depths). A slot
whose token exits embeds its next token and starts it at loop 0 on the next tick:

* `generate_early_exit`: the prompts form one batch that decodes in lock step; an exited
  sequence waits for the slowest member of the batch before starting its next token
  (`sync=True`), as a static batch must.
* `DepthwiseScheduler`: continuous depth-wise batching. No waiting: every slot starts its next
  token as soon as the current one exits, finished requests (max_new_tokens or eos_id) leave,
  and waiting requests are prefilled one at a time and take their slot.

Prefill: a request's prompt minus its last token runs through the full model (every loop, the
ordinary cached forward of models/lm.py at the served depth, right-padded to a power-of-two
bucket); the last prompt token then goes through the loops like a generated one, so the first
new token exits early too. A slot's cache row is indexed by absolute position (slot s holds
position s).

Plans (ConfigError otherwise): any plan with one looped `cycle` segment (models/loops.py):
cycle, universal, groups, and middle_cycle, whose unique first layer (the prelude) runs when a
token starts and whose unique last layer (the coda) runs after every loop, before the shared
head, so the exit logits after loop r are those of the model evaluated at depth r. Depth-wise
LoRA and untied norms are per applied layer (the loops then differ, and each loop reads its own
parts), MASA blocks read the model's atoms; scanned or Python-loop stacks alike (the layers are
read from the parameters' structure metadata). Not served: routed models (their recursions
are per token already), the u-muP residual rule (its scale depends on the applied layer index)
and values-are-keys attention sharing.

The ticks: the decode state of a fixed number of slots (`Slots`), and one loop of the looped
segment for every slot at its own depth. A tick runs, per slot (vmapped: slots never interact), the
prelude when the slot's token starts,
loop `depth` of the looped segment, and the coda for the exit logits; the shared head reads
them; the exit criterion (sharenet/inference/exits.py) or the last loop ends the token, which is
then
sampled (sharenet/inference/generate.py `sample_rows`: greedy at temperature 0, else temperature /
top-k /
top-p with the key of (request, token index), so a token draws what full-depth `generate` draws
for it). The loops served are the plan's R, or another maximum depth M (`at_depth`: the applied
layers are renumbered as prelude + M loops + coda, every layer reading its stored set, and
per-layer parts only for M <= R, sharenet/inference/test_time_depth.py). Under
model.kv_sharing=first a slot's cache
holds one loop's rows of the looped segment (`cache_rows`): the first loop writes them, the
later loops attend to them (their own keys and values computed and dropped), and an exit copies
nothing.
"""
from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharenet.inference import exits, test_time_depth
from sharenet.config import compat
from sharenet.errors import ConfigError
from sharenet.inference.generate import bucket, check_prompts, check_sampling, row_keys, sample_rows
from sharenet.models import DecoderLM, layer_store, loops, recurrence
from sharenet.models.lm import init_cache
from sharenet.models.loops import Schedule

GREEDY = (0.0, 0, 1.0)   # (temperature, top_k, top_p)


def check_recursive(model: DecoderLM, variables: Any) -> loops.Looped:
  """The plan read as prelude + R loops + coda (models/loops.py); one ConfigError line for a
  feature loop-by-loop inference refuses (config/compat.py) or a plan without such a loop."""
  compat.check_action('loop_inference', model.cfg.table_config(), 'loop-by-loop inference')
  return loops.looped(model.cfg)


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
  e_BD: jax.Array          # the stream that entered the looped segment (the injection's input)
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
  track: exits.Track       # the previous loop's readings the exit criterion compares with
  req_B: jax.Array         # the request's index: the row of its sampling keys and initial state


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
  zh = jnp.zeros((batch, c.d_model), jnp.dtype(c.dtype))
  return Slots(zh, zh, zi, zi,
               jnp.zeros(shape, jnp.dtype(c.dtype)), jnp.zeros(shape, jnp.dtype(c.dtype)),
               jnp.full((batch, num_positions), -1, jnp.int32), jnp.zeros((batch,), bool),
               jnp.zeros((batch,), bool), jnp.zeros((batch, max_new_tokens), jnp.int32), zi, zi,
               exits.start(batch, c.vocab_size), zi)


def _slot_tick(cfg, shape: loops.Looped, store, h_D, e_D, depth, pos, req, run, k_LSKD, v_LSKD,
               key_pos_S):
  """One slot, one tick: the prelude when the token starts (depth 0), loop `depth`, and the
  coda for the exit logits. Writes the prelude's and the loop's cache columns where the slot
  runs; returns the coda's columns uncommitted (written only when the token exits), and the
  state entering the loop (the latent criteria's h_{r-1}). Under model.recurrence the stream
  that entered the looped segment (`e_D`, kept from the token's start) re-enters at the start
  of every loop, and the first loop starts from the plan's initial state, drawn as batch row
  `req` (models/recurrence.py)."""
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
  e_D = jnp.where(depth == 0, h_D, e_D)
  rc = cfg.recurrence
  if rc.init != 'embed':
    s0_D = recurrence.initial_state(cfg, e_D[None, None], None, pos[None, None], req[None])
    h_D = jnp.where(depth == 0, s0_D[0, 0], h_D)
  h_in_D = h_D
  x_D = h_D
  if rc.injection != 'none':
    inject = recurrence.injection(cfg, e_D[None, None], store.adapter)
    x_D = inject(h_D[None, None])[0, 0]
  first = shape.start + depth * shape.num_sets
  row, write = (jnp.int32(shape.start), depth == 0) if kv else (first, None)
  h_D, k_N, v_N = apply(x_D, first, shape.num_sets, k_LSKD, v_LSKD, row, write)
  commit = run & (depth == 0) if kv else run   # kv: a later loop's columns are the held ones
  k_LSKD = layer_store.write_columns(k_LSKD, row, pos, k_N, commit)
  v_LSKD = layer_store.write_columns(v_LSKD, row, pos, v_N, commit)
  out_D, coda = h_D, None
  if shape.coda < shape.num_layers:
    out_D, k_N, v_N = apply(h_D, jnp.int32(shape.coda), shape.num_layers - shape.coda, k_LSKD,
                            v_LSKD, jnp.int32(_coda_row(cfg, shape)))
    coda = (k_N, v_N)
  return h_in_D, h_D, e_D, out_D, k_LSKD, v_LSKD, key_pos_S, coda


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
  per-layer parts for M <= R; deeper loops exist only without them: test_time_depth.py)."""
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
  `criterion` (sharenet/inference/exits.py) with the traced `threshold`; `sampling`: (temperature,
  top_k, top_p); `rng` the generation's key (unused when greedy)."""
  shape = check_recursive(model, variables) if shape is None else shape
  R, N = shape.loops, st.out_BN.shape[1]
  store = store_at(model, variables, shape) if store is None else store
  rng = jax.random.key(0) if rng is None else rng
  run_B = st.active_B & ~st.hold_B
  tick = jax.vmap(functools.partial(_slot_tick, model.cfg, shape, store))
  h_in_BD, h_BD, e_BD, out_BD, k_BLSKD, v_BLSKD, key_pos_BS, coda = tick(
      st.h_BD, st.e_BD, st.depth_B, st.pos_B, st.req_B, run_B, st.k_BLSKD, st.v_BLSKD,
      st.key_pos_BS)
  logits_BV = readout(model, variables, out_BD[:, None])[:, 0]
  logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  value_B, track = exits.measure(criterion, logp_BV, h_BD, h_in_BD, st.track)
  fire_B = exits.fires(criterion, threshold, value_B)
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
  track = _select(exit_B, exits.start(*logp_BV.shape), _select(run_B, track, st.track))
  e_BD = jnp.where(run_B[:, None], e_BD, st.e_BD)
  hold_B = st.hold_B
  if sync:   # a static batch: the exited wait until every running member has exited
    hold_B = (hold_B | exit_B) & active_B
    hold_B = jnp.where(jnp.all(hold_B == active_B), False, hold_B)
  return Slots(h_BD, e_BD, depth_B, pos_B, k_BLSKD, v_BLSKD, key_pos_BS, active_B, hold_B,
               out_BN, count_B, depth_sum_B, track, st.req_B)


def _select(where_B: jax.Array, a, b):
  """Per row: `a` where `where_B`, else `b` (pytrees of arrays with a leading batch axis)."""
  return jax.tree.map(lambda x, y: jnp.where(where_B.reshape((-1,) + (1,) * (x.ndim - 1)), x, y),
                      a, b)


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
  track = jax.tree.map(lambda a, x: a.at[slot].set(x[0]), st.track,
                       exits.start(1, st.track.logp_BV.shape[1]))
  return Slots(st.h_BD.at[slot].set(h_D.astype(st.h_BD.dtype)), st.e_BD,
               st.depth_B.at[slot].set(0),
               st.pos_B.at[slot].set(last_pos), st.k_BLSKD.at[slot].set(k_LSKD),
               st.v_BLSKD.at[slot].set(v_LSKD), st.key_pos_BS.at[slot].set(key_pos_S),
               st.active_B.at[slot].set(True), st.hold_B.at[slot].set(False),
               st.out_BN.at[slot].set(0), st.count_B.at[slot].set(0),
               st.depth_sum_B.at[slot].set(0), track, st.req_B.at[slot].set(req))


insert_jit = jax.jit(insert, static_argnames=('model',))


def _prefill(variables, tokens_1P, positions_1P, req, *, model: DecoderLM, num_positions: int,
             loops_run: int | None):
  """Cached forward (every loop: the plan's, or `loops_run`) of a right-padded prompt prefix,
  drawn as batch row `req`: (k, v) (L, S, Kh, Dh), key_pos."""
  cache = init_cache(model.cfg, 1, num_positions, loops=loops_run)
  schedule = Schedule() if loops_run is None else Schedule(loops=loops_run)
  _, cache = model.apply(variables, tokens_1P, cache=cache, positions_BT=positions_1P,
                         schedule=schedule, rows_B=req[None])
  k_LSKD = jnp.concatenate([c.k_BSKD[:, 0] for c in cache.layers])   # segments in plan order
  v_LSKD = jnp.concatenate([c.v_BSKD[:, 0] for c in cache.layers])
  return k_LSKD, v_LSKD, cache.key_positions_BS[0]


_prefill_jit = jax.jit(_prefill, static_argnames=('model', 'num_positions', 'loops_run'))


def _prefilled(model: DecoderLM, variables: Any, prompt: Sequence[int], num_positions: int,
               loops_run: int | None, req: int):
  """(k, v, key_pos, last token, its position) of one prompt, request `req`."""
  P = len(prompt)
  width = min(bucket(max(P - 1, 1)), num_positions)
  tokens = np.zeros((1, width), np.int32)
  positions = np.full((1, width), -1, np.int32)
  tokens[0, :P - 1] = prompt[:-1]
  positions[0, :P - 1] = np.arange(P - 1)
  k, v, key_pos = _prefill_jit(variables, jnp.asarray(tokens), jnp.asarray(positions),
                               jnp.int32(req), model=model, num_positions=num_positions, loops_run=loops_run)
  return k, v, key_pos, jnp.int32(prompt[-1]), jnp.int32(P - 1)


def _exit_rule(exit: str | exits.Exit | None, exit_threshold: float) -> exits.Exit:
  """The criterion: `exit` ('kl:0.01', sharenet/inference/exits.py) or maxprob:`exit_threshold`."""
  if exit is None:
    if not 0.0 <= exit_threshold <= 1.0:
      raise ConfigError(f'exit_threshold={exit_threshold} must be in [0, 1] (1: never exit '
                        f'early)')
    return exits.Exit('maxprob', float(exit_threshold))
  if exit_threshold != 1.0:
    raise ConfigError(f'exit={exit!r} and exit_threshold={exit_threshold} both set the exit '
                      f'rule; valid: one of them (exit_threshold=t is exit=maxprob:t)')
  return exits.parse(exit)


def _validate(model: DecoderLM, prompts, max_new_tokens: int, num_positions: int,
              eos_id: int | None):
  c = model.cfg
  if max_new_tokens < 1:
    raise ConfigError(f'max_new_tokens={max_new_tokens} must be >= 1')
  check_prompts(c, prompts, eos_id)
  for p in prompts:
    if len(p) + max_new_tokens - 1 > num_positions:
      raise ConfigError(f'a prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} needs '
                        f'{len(p) + max_new_tokens - 1} cache positions, have {num_positions}')
    if c.position != 'none' and len(p) + max_new_tokens > c.max_len:
      raise ConfigError(f'a prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds '
                        f'model.max_len={c.max_len}')


class RecursiveGeneration(NamedTuple):
  """Tokens per request (eos and after removed), exit depths and the schedule's cost."""
  tokens: list[list[int]]
  exit_depths: list[float]       # per request: mean loops used per emitted token (1 .. R)
  emitted: list[int]             # per request: tokens emitted (an eos included)
  seconds: float                 # wall time of prefill + ticks (compiled programs warm or not)
  ticks: int                     # jitted loop applications (each over all slots)
  busy_slot_ticks: int           # slot-ticks that computed (occupancy = busy / (ticks * slots))
  slots: int

  @property
  def mean_exit_depth(self) -> float:
    """Loops per emitted token over all requests (R without early exit)."""
    return float(np.dot(self.exit_depths, self.emitted) / max(sum(self.emitted), 1))

  @property
  def occupancy(self) -> float:
    return self.busy_slot_ticks / max(self.ticks * self.slots, 1)

  @property
  def tokens_per_sec(self) -> float:
    return sum(len(t) for t in self.tokens) / max(self.seconds, 1e-9)


def _harvest(host: dict, b: int, eos_id: int | None) -> tuple[list[int], float, int]:
  """(tokens without eos, mean exit depth, tokens emitted) of slot b."""
  count = int(host['count'][b])
  row = host['out'][b, :count].tolist()
  depth = float(host['depth_sum'][b]) / max(count, 1)
  if eos_id is not None and eos_id in row:
    row = row[:row.index(eos_id)]
  return row, depth, count


class DepthwiseScheduler:
  """Continuous depth-wise batching over `num_slots` slots (see the module docstring).

  `run(requests)` serves the requests (token lists) first come first served: whenever a slot's
  request finishes, the next waiting request is prefilled alone and takes the slot; between
  refills one jitted program ticks all slots until some slot finishes.
  `sync=True` is the static-batch baseline instead: a batch of `num_slots` requests decodes in
  lock step (the exited wait for the slowest member), and the next batch starts when the whole
  batch has finished.

  The exit rule is `exit` ('maxprob:0.9', 'kl:0.01', ... sharenet/inference/exits.py, or an
  exits.Exit) or, equivalently, `exit_threshold=t` (maxprob:t); `depth` the maximum loops (None:
  the plan's R); `temperature` (0: greedy), `top_k`, `top_p` and `rng` sample as
  generate.generate does, request i drawing with row i's keys.
  """

  def __init__(self, model: DecoderLM, variables: Any, *, num_slots: int, max_new_tokens: int,
               num_positions: int, exit_threshold: float = 1.0, eos_id: int | None = None,
               sync: bool = False, exit: str | exits.Exit | None = None,
               depth: int | None = None, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, rng: jax.Array | None = None):
    if num_slots < 1:
      raise ConfigError(f'num_slots={num_slots} must be >= 1')
    self.rule = _exit_rule(exit, exit_threshold)
    shape = check_recursive(model, variables)
    if depth is not None:
      test_time_depth.check_depth(model.cfg, depth, 'depth')
    self.shape = at_depth(shape, depth)
    self.loops_run = depth
    check_sampling(model.cfg, temperature, top_k, top_p)
    self.sampling = (float(temperature), int(top_k), float(top_p))
    self.rng = jax.random.key(0) if rng is None else rng
    _validate(model, [], max_new_tokens, num_positions, eos_id)
    self.model, self.variables = model, variables
    self.num_slots, self.max_new_tokens, self.num_positions = num_slots, max_new_tokens, \
        num_positions
    self.threshold = jnp.float32(self.rule.threshold)
    self.eos_id, self.sync = eos_id, sync
    self.eos = jnp.int32(-1 if eos_id is None else eos_id)

  def run(self, requests: Sequence[Sequence[int]]) -> RecursiveGeneration:
    requests = [list(map(int, p)) for p in requests]
    _validate(self.model, requests, self.max_new_tokens, self.num_positions, self.eos_id)
    t0 = time.perf_counter()
    st = empty_slots(self.model, self.num_slots, self.num_positions, self.max_new_tokens,
                     cache_rows(self.model.cfg, self.shape))
    owner = [-1] * self.num_slots   # request index per slot
    tokens: list[Any] = [None] * len(requests)
    depths: list[Any] = [None] * len(requests)
    emitted: list[Any] = [None] * len(requests)
    waiting = list(range(len(requests)))
    ticks = busy = 0
    while True:
      if not self.sync or all(o < 0 for o in owner):
        for b in range(self.num_slots):
          if owner[b] < 0 and waiting:
            i = waiting.pop(0)
            st = insert_jit(self.variables, st, jnp.int32(b),
                            *_prefilled(self.model, self.variables, requests[i],
                                        self.num_positions, self.loops_run, i), jnp.int32(i),
                            model=self.model)
            owner[b] = i
      if all(o < 0 for o in owner):
        break
      until_free = jnp.asarray(bool(waiting) and not self.sync)
      st, n, m = run_jit(self.variables, st, self.threshold, self.eos, until_free, self.rng,
                         model=self.model, sync=self.sync, shape=self.shape,
                         criterion=self.rule.criterion, sampling=self.sampling)
      ticks, busy = ticks + int(n), busy + int(m)
      host = {'active': np.asarray(st.active_B), 'out': np.asarray(st.out_BN),
              'count': np.asarray(st.count_B), 'depth_sum': np.asarray(st.depth_sum_B)}
      for b in range(self.num_slots):
        if owner[b] >= 0 and not host['active'][b]:
          tokens[owner[b]], depths[owner[b]], emitted[owner[b]] = _harvest(host, b,
                                                                            self.eos_id)
          owner[b] = -1
    seconds = time.perf_counter() - t0
    return RecursiveGeneration(tokens, depths, emitted, seconds, ticks, busy, self.num_slots)


def generate_early_exit(model: DecoderLM, variables: Any, prompts: Sequence[Sequence[int]],
                        max_new_tokens: int, *, exit_threshold: float = 1.0,
                        eos_id: int | None = None, exit: str | exits.Exit | None = None,
                        depth: int | None = None, temperature: float = 0.0, top_k: int = 0,
                        top_p: float = 1.0, rng: jax.Array | None = None
                        ) -> RecursiveGeneration:
  """Decoding of `prompts` as one static batch with per-sequence early exit.

  The exit rule: `exit` (sharenet/inference/exits.py) or `exit_threshold` in [0, 1], maxprob: a
  sequence
  exits after a loop whose readout's max probability is >= the threshold (1.0: never early,
  identical to `generate.generate`; 0: always after the first loop). `depth`: the maximum loops
  (default the plan's). Greedy by default; `temperature` / `top_k` / `top_p` / `rng` sample as
  `generate.generate` does. The batch steps in lock step (each token waits for its slowest
  member).
  """
  prompts = [list(map(int, p)) for p in prompts]
  if not prompts:
    raise ConfigError('generation needs at least one prompt')
  positions = max(len(p) for p in prompts) + max_new_tokens - 1
  return DepthwiseScheduler(model, variables, num_slots=len(prompts),
                            max_new_tokens=max_new_tokens, num_positions=positions,
                            exit_threshold=exit_threshold, eos_id=eos_id, sync=True, exit=exit,
                            depth=depth, temperature=temperature, top_k=top_k, top_p=top_p,
                            rng=rng).run(prompts)
