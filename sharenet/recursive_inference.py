"""Inference for recursive (cycle-shared) models: per-sequence early exit after any loop of the
shared block, and continuous depth-wise batching.

Relaxed Recursive Transformers (Bae et al., arXiv:2410.20672, the section on "continuous
depth-wise batching and early exiting"): a cycle model applies the same K stored sets R times, so
one "loop" (one pass over the K sets) is the same function at every depth. After each loop the
shared readout (final norm + unembedding, the model's own) gives exit logits; a sequence whose
confidence (max softmax probability) reaches `exit_threshold` emits its greedy token from those
logits and skips the deeper loops for that token. `exit_threshold=1.0` never exits early (the
rule is disabled there, since float32 probabilities can round to exactly 1.0), which is plain
greedy decoding.

Skipped loops' keys and values: later tokens attend to every applied layer, so an exited token's
cache entries for the deeper loops must be filled. Here they are *copied* from the last loop it
computed (applied layer (r', k) gets the keys and values of (r, k) for every deeper loop r' > r).
With tied weights this equals propagating each block's last computed input state to the deeper
applications of the same block (CALM's "state propagation", Schuster et al., arXiv:2207.07502,
propagates the exited state instead); it costs a cache copy and no extra compute. The RRT paper
requires the missing caches to be filled but we do not claim to reproduce its exact policy.

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
ordinary cached forward of models/lm.py, right-padded to a power-of-two bucket); the last prompt
token then goes through the loops like a generated one, so the first new token exits early too.
A slot's cache row is indexed by absolute position (slot s holds position s).

Plans (ConfigError otherwise): any plan with one looped `cycle` segment (models/loops.py):
cycle, universal, groups, and middle_cycle, whose unique first layer (the prelude) runs when a
token starts and whose unique last layer (the coda) runs after every loop, before the shared
head, so the exit logits after loop r are those of the model evaluated at depth r. Depth-wise
LoRA and untied norms are per applied layer (the loops then differ, and each loop reads its own
parts), MASA blocks read the model's atoms; scanned or Python-loop stacks alike (the layers are
read from the parameters' structure metadata). Not served: routed models (their recursions
are per token already), the u-muP residual rule (its scale depends on the applied layer index)
and values-are-keys attention sharing. Greedy decoding only.
"""
from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharenet.errors import ConfigError
from sharenet.generate import bucket, check_prompts
from sharenet.models import DecoderLM, loops
from sharenet.models.lm import init_cache


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
                      f'{c.recurrence.injection!r} needs it (docs/recurrence.md); valid: none')
  if c.values_are_keys:
    raise ConfigError(f'recursive inference keeps keys and values per layer; model.'
                      f'attention_sharing={c.attention_sharing} stores no values; valid: none, '
                      f'qk_shared')
  return shape


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
  k_BLSKD: jax.Array       # keys per applied layer; cache slot s holds position s
  v_BLSKD: jax.Array
  key_pos_BS: jax.Array    # position held by each cache slot (-1: empty)
  active_B: jax.Array      # slot holds an unfinished request
  hold_B: jax.Array        # exited, waiting for the batch (sync mode only)
  out_BN: jax.Array        # emitted tokens
  count_B: jax.Array       # tokens emitted so far
  depth_sum_B: jax.Array   # sum over emitted tokens of the loops they used (1 .. R)


def empty_slots(model: DecoderLM, batch: int, num_positions: int, max_new_tokens: int) -> Slots:
  c = model.cfg
  L = c.num_layers
  shape = (batch, L, num_positions, c.kv_heads, c.d_head)
  zi = jnp.zeros((batch,), jnp.int32)
  return Slots(jnp.zeros((batch, c.d_model), jnp.dtype(c.dtype)), zi, zi,
               jnp.zeros(shape, jnp.dtype(c.dtype)), jnp.zeros(shape, jnp.dtype(c.dtype)),
               jnp.full((batch, num_positions), -1, jnp.int32), jnp.zeros((batch,), bool),
               jnp.zeros((batch,), bool), jnp.zeros((batch, max_new_tokens), jnp.int32), zi, zi)


def _slot_tick(cfg, shape: loops.Looped, store, h_D, depth, pos, run, k_LSKD, v_LSKD,
               key_pos_S):
  """One slot, one tick: the prelude when the token starts (depth 0), loop `depth`, and the
  coda for the exit logits. Writes the prelude's and the loop's cache columns where the slot
  runs; returns the coda's columns uncommitted (written only when the token exits)."""
  key_pos_S = jnp.where(run, key_pos_S.at[pos].set(pos), key_pos_S)
  apply = lambda x, first, n, k, v: loops.run_layers(cfg, store, x, first, n, k, v, pos,
                                                     key_pos_S)
  if shape.start:
    pre_D, k_N, v_N = apply(h_D, jnp.int32(0), shape.start, k_LSKD, v_LSKD)
    starts = run & (depth == 0)
    k_LSKD = loops.write_columns(k_LSKD, jnp.int32(0), pos, k_N, starts)
    v_LSKD = loops.write_columns(v_LSKD, jnp.int32(0), pos, v_N, starts)
    h_D = jnp.where(depth == 0, pre_D, h_D)
  first = shape.start + depth * shape.num_sets
  h_D, k_N, v_N = apply(h_D, first, shape.num_sets, k_LSKD, v_LSKD)
  k_LSKD = loops.write_columns(k_LSKD, first, pos, k_N, run)
  v_LSKD = loops.write_columns(v_LSKD, first, pos, v_N, run)
  out_D, coda = h_D, None
  if shape.coda < shape.num_layers:
    out_D, k_N, v_N = apply(h_D, jnp.int32(shape.coda), shape.num_layers - shape.coda, k_LSKD,
                            v_LSKD)
    coda = (k_N, v_N)
  return h_D, out_D, k_LSKD, v_LSKD, key_pos_S, coda


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


def _store(model: DecoderLM, variables) -> loops.LayerStore:
  """Every applied layer's parts, gathered once per program (not once per tick)."""
  return loops.layer_store(model.cfg, variables, model.apply(variables, method='atoms'))


def _tick(variables, st: Slots, threshold, eos_id, *, model: DecoderLM, sync: bool,
          store: loops.LayerStore | None = None) -> Slots:
  """One loop for every running slot; exits, emits and starts next tokens (jit-able)."""
  shape = check_recursive(model, variables)
  R, N = shape.loops, st.out_BN.shape[1]
  store = _store(model, variables) if store is None else store
  run_B = st.active_B & ~st.hold_B
  tick = jax.vmap(functools.partial(_slot_tick, model.cfg, shape, store))
  h_BD, out_BD, k_BLSKD, v_BLSKD, key_pos_BS, coda = tick(
      st.h_BD, st.depth_B, st.pos_B, run_B, st.k_BLSKD, st.v_BLSKD, st.key_pos_BS)
  logits_BV = readout(model, variables, out_BD[:, None])[:, 0]
  conf_B = jnp.max(jax.nn.softmax(logits_BV, axis=-1), axis=-1)
  token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  confident_B = (conf_B >= threshold) & (threshold < 1.0)
  exit_B = run_B & (confident_B | (st.depth_B == R - 1))
  if coda is not None:   # the coda's keys and values are the exiting token's
    write = jax.vmap(loops.write_columns, in_axes=(0, None, 0, 0, 0))
    k_BLSKD = write(k_BLSKD, jnp.int32(shape.coda), st.pos_B, coda[0], exit_B)
    v_BLSKD = write(v_BLSKD, jnp.int32(shape.coda), st.pos_B, coda[1], exit_B)
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
  hold_B = st.hold_B
  if sync:   # a static batch: the exited wait until every running member has exited
    hold_B = (hold_B | exit_B) & active_B
    hold_B = jnp.where(jnp.all(hold_B == active_B), False, hold_B)
  return Slots(h_BD, depth_B, pos_B, k_BLSKD, v_BLSKD, key_pos_BS, active_B, hold_B, out_BN,
               count_B, depth_sum_B)


def _run(variables, st: Slots, threshold, eos_id, until_free, *, model: DecoderLM, sync: bool):
  """Ticks until no slot is active, or (`until_free`) until some slot finishes.

  Returns (slots, ticks run, slot-ticks that did work)."""
  def cond(carry):
    st, ticks, busy, freed = carry
    return jnp.any(st.active_B) & ~(until_free & freed)

  store = _store(model, variables)

  def body(carry):
    st, ticks, busy, freed = carry
    running = jnp.sum(st.active_B & ~st.hold_B)
    new = _tick(variables, st, threshold, eos_id, model=model, sync=sync, store=store)
    return new, ticks + 1, busy + running, jnp.any(st.active_B & ~new.active_B)

  zero = jnp.zeros((), jnp.int32)
  st, ticks, busy, _ = jax.lax.while_loop(cond, body, (st, zero, zero, jnp.zeros((), bool)))
  return st, ticks, busy


_run_jit = jax.jit(_run, static_argnames=('model', 'sync'))


def _prefill(variables, tokens_1P, positions_1P, *, model: DecoderLM, num_positions: int):
  """Cached full-depth forward of a right-padded prompt prefix: (k, v) (L, S, Kh, Dh), key_pos."""
  cache = init_cache(model.cfg, 1, num_positions)
  _, cache = model.apply(variables, tokens_1P, cache=cache, positions_BT=positions_1P)
  k_LSKD = jnp.concatenate([c.k_BSKD[:, 0] for c in cache.layers])   # segments in plan order
  v_LSKD = jnp.concatenate([c.v_BSKD[:, 0] for c in cache.layers])
  return k_LSKD, v_LSKD, cache.key_positions_BS[0]


_prefill_jit = jax.jit(_prefill, static_argnames=('model', 'num_positions'))


def _insert(variables, st: Slots, slot, k_LSKD, v_LSKD, key_pos_S, last_token, last_pos, *,
            model: DecoderLM) -> Slots:
  """Puts a prefilled request into `slot`: its last prompt token starts at loop 0."""
  h_D = embed(model, variables, last_token[None, None], last_pos[None, None])[0, 0]
  return Slots(st.h_BD.at[slot].set(h_D.astype(st.h_BD.dtype)), st.depth_B.at[slot].set(0),
               st.pos_B.at[slot].set(last_pos), st.k_BLSKD.at[slot].set(k_LSKD),
               st.v_BLSKD.at[slot].set(v_LSKD), st.key_pos_BS.at[slot].set(key_pos_S),
               st.active_B.at[slot].set(True), st.hold_B.at[slot].set(False),
               st.out_BN.at[slot].set(0), st.count_B.at[slot].set(0),
               st.depth_sum_B.at[slot].set(0))


_insert_jit = jax.jit(_insert, static_argnames=('model',))


def _prefilled(model: DecoderLM, variables: Any, prompt: Sequence[int], num_positions: int):
  """(k, v, key_pos, last token, its position) of one prompt."""
  P = len(prompt)
  width = min(bucket(max(P - 1, 1)), num_positions)
  tokens = np.zeros((1, width), np.int32)
  positions = np.full((1, width), -1, np.int32)
  tokens[0, :P - 1] = prompt[:-1]
  positions[0, :P - 1] = np.arange(P - 1)
  k, v, key_pos = _prefill_jit(variables, jnp.asarray(tokens), jnp.asarray(positions),
                               model=model, num_positions=num_positions)
  return k, v, key_pos, jnp.int32(prompt[-1]), jnp.int32(P - 1)


def _validate(model: DecoderLM, variables: Any, prompts, max_new_tokens: int,
              exit_threshold: float, num_positions: int, eos_id: int | None):
  check_recursive(model, variables)
  c = model.cfg
  if not 0.0 <= exit_threshold <= 1.0:
    raise ConfigError(f'exit_threshold={exit_threshold} must be in [0, 1] (1: never exit early)')
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
  """

  def __init__(self, model: DecoderLM, variables: Any, *, num_slots: int, max_new_tokens: int,
               num_positions: int, exit_threshold: float = 1.0, eos_id: int | None = None,
               sync: bool = False):
    if num_slots < 1:
      raise ConfigError(f'num_slots={num_slots} must be >= 1')
    _validate(model, variables, [], max_new_tokens, exit_threshold, num_positions, eos_id)
    self.model, self.variables = model, variables
    self.num_slots, self.max_new_tokens, self.num_positions = num_slots, max_new_tokens, \
        num_positions
    self.threshold = jnp.float32(exit_threshold)
    self.eos_id, self.sync = eos_id, sync
    self.eos = jnp.int32(-1 if eos_id is None else eos_id)

  def run(self, requests: Sequence[Sequence[int]]) -> RecursiveGeneration:
    requests = [list(map(int, p)) for p in requests]
    _validate(self.model, self.variables, requests, self.max_new_tokens,
              float(self.threshold), self.num_positions, self.eos_id)
    t0 = time.perf_counter()
    st = empty_slots(self.model, self.num_slots, self.num_positions, self.max_new_tokens)
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
            st = _insert_jit(self.variables, st, jnp.int32(b),
                             *_prefilled(self.model, self.variables, requests[i],
                                         self.num_positions), model=self.model)
            owner[b] = i
      if all(o < 0 for o in owner):
        break
      until_free = jnp.asarray(bool(waiting) and not self.sync)
      st, n, m = _run_jit(self.variables, st, self.threshold, self.eos, until_free,
                          model=self.model, sync=self.sync)
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
                        eos_id: int | None = None) -> RecursiveGeneration:
  """Greedy decoding of `prompts` as one static batch with per-sequence early exit.

  `exit_threshold` in [0, 1]: a sequence exits after a loop whose readout's max probability is
  >= the threshold (1.0: never early, identical to greedy `generate.generate`; 0: always after
  the first loop). The batch steps in lock step (each token waits for its slowest member).
  """
  prompts = [list(map(int, p)) for p in prompts]
  if not prompts:
    raise ConfigError('generation needs at least one prompt')
  positions = max(len(p) for p in prompts) + max_new_tokens - 1
  return DepthwiseScheduler(model, variables, num_slots=len(prompts),
                            max_new_tokens=max_new_tokens, num_positions=positions,
                            exit_threshold=exit_threshold, eos_id=eos_id, sync=True).run(prompts)
