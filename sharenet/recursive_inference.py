"""Inference for recursive (cycle-shared) models: per-sequence early exit after any loop of the
shared block, and continuous depth-wise batching.

Relaxed Recursive Transformers (Bae et al., arXiv:2410.20672, the section on "continuous
depth-wise batching and early exiting"): a cycle model applies the same K stored sets R times, so
one "loop" (one pass over the K sets) is the same function at every depth. After each loop the
shared readout (final norm + unembedding, the model's own) gives exit logits; a sequence whose
exit criterion fires (sharenet/exits.py: `maxprob`, the confidence `exit_threshold` sets,
`entropy`, or the recurrent-depth criteria `kl` and `latent` of Geiping et al.,
arXiv:2502.05171) emits its token from those logits and skips the deeper loops for that token.
A criterion that never fires (`exit_threshold=1.0`, maxprob's rule disabled there since float32
probabilities can round to exactly 1.0) is plain full-depth decoding. Tokens are greedy or
sampled (temperature / top-k / top-p, sharenet/generate.py's sampler with its per-(request,
token) keys, so with the same `rng` a never-exiting run samples what `generate` samples).
`depth` serves another maximum number of loops M (sharenet/depth.py): the prefill runs at M
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
and values-are-keys attention sharing. The ticks live in sharenet/loop_ticks.py.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharenet import exits
from sharenet.errors import ConfigError
from sharenet.generate import bucket, check_prompts, check_sampling
from sharenet.loop_ticks import (Slots, _tick, at_depth, cache_rows,  # noqa: F401
                                 check_recursive, embed, empty_slots, insert_jit, readout,
                                 run_jit)
from sharenet.models import DecoderLM
from sharenet.models.lm import init_cache
from sharenet.models.loops import Schedule


def _prefill(variables, tokens_1P, positions_1P, *, model: DecoderLM, num_positions: int,
             loops_run: int | None):
  """Cached forward (every loop: the plan's, or `loops_run`) of a right-padded prompt prefix:
  (k, v) (L, S, Kh, Dh), key_pos."""
  cache = init_cache(model.cfg, 1, num_positions, loops=loops_run)
  schedule = Schedule() if loops_run is None else Schedule(loops=loops_run)
  _, cache = model.apply(variables, tokens_1P, cache=cache, positions_BT=positions_1P,
                         schedule=schedule)
  k_LSKD = jnp.concatenate([c.k_BSKD[:, 0] for c in cache.layers])   # segments in plan order
  v_LSKD = jnp.concatenate([c.v_BSKD[:, 0] for c in cache.layers])
  return k_LSKD, v_LSKD, cache.key_positions_BS[0]


_prefill_jit = jax.jit(_prefill, static_argnames=('model', 'num_positions', 'loops_run'))


def _prefilled(model: DecoderLM, variables: Any, prompt: Sequence[int], num_positions: int,
               loops_run: int | None):
  """(k, v, key_pos, last token, its position) of one prompt."""
  P = len(prompt)
  width = min(bucket(max(P - 1, 1)), num_positions)
  tokens = np.zeros((1, width), np.int32)
  positions = np.full((1, width), -1, np.int32)
  tokens[0, :P - 1] = prompt[:-1]
  positions[0, :P - 1] = np.arange(P - 1)
  k, v, key_pos = _prefill_jit(variables, jnp.asarray(tokens), jnp.asarray(positions),
                               model=model, num_positions=num_positions, loops_run=loops_run)
  return k, v, key_pos, jnp.int32(prompt[-1]), jnp.int32(P - 1)


def _exit_rule(exit: str | exits.Exit | None, exit_threshold: float) -> exits.Exit:
  """The criterion: `exit` ('kl:0.01', sharenet/exits.py) or maxprob:`exit_threshold`."""
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

  The exit rule is `exit` ('maxprob:0.9', 'entropy:0.5', 'kl:0.01', 'latent:0.01' or an
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
      from sharenet import depth as depth_lib
      depth_lib.check_depth(model.cfg, depth, 'depth')
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
                                        self.num_positions, self.loops_run), jnp.int32(i),
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

  The exit rule: `exit` (sharenet/exits.py) or `exit_threshold` in [0, 1], maxprob: a sequence
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
