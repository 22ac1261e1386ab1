"""Text generation: prefill the prompts, then decode one token per step with a KV cache.

`generate(model, variables, prompts, max_new_tokens, ...)` is the library function behind
`python eval.py --workdir DIR --prompt ...` (docs/generation.md) and for notebooks.
`variables` are the variables the model *applies*: for a trained workdir that is
`trainer.effective_params` (reparameterizations and parametrization forward multipliers
resolved once, not per token); `eval_workdir.load_for_generation` returns them.

The cache holds one entry per *applied* layer (models/stack.py): tied layers share weights, not
keys and values, so a cycle plan applying 2 sets 3 times keeps 6. Prompts of different lengths
are left-padded to a power-of-two bucket and run as one batch; positions are per sequence (pads
carry position -1 and are never attended to), so a prompt decodes exactly as it would alone.
The whole loop is one compiled program per (prompt bucket, batch size, settings): the prefill,
then a `lax.while_loop` that stops after `max_new_tokens` or once every sequence has produced
`eos_id`.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then the top-k
filter (the k largest logits) and the nucleus filter (top-p: the smallest set of most likely
tokens whose probability reaches p; Holtzman et al., "The Curious Case of Neural Text
Degeneration", arXiv:1904.09751), renormalized by the softmax of the surviving logits. Token i
of row b draws with its own key, fold_in(fold_in(rng, b), i) (`row_keys`), so a draw does not
depend on the batch it runs in or the tick it is emitted at: loop_by_loop.py's early
exit, which emits rows at different ticks, draws the same tokens.

Depth: `loops=n` decodes a looped model at n loops of its looped segment (models/loops.py
Schedule, sharenet/inference/test_time_depth.py), the cache holding those loops' layers.

KV across loops: under model.kv_sharing=first the looped segment's later loops attend to its
first loop's keys and values (models/kv_sharing.py), so the cache holds one loop of it at any
depth (lm.kv_cache_bytes_per_token: the bytes a cache allocates per token of one sequence).

Routed models (Mixture-of-Recursions, model.routing): the routed segment keeps recursion-wise
caches (models/routed_decoding.py): a token's keys and values only at the recursions it ran;
token choice decodes as it trains, expert choice by its router's BCE-trained threshold
(docs/routing.md "Decoding"). `Generation.kv_bytes_per_token` (`kv_cache_bytes_held`) counts
the keys and values the final cache holds per token; eval.py --prompt prints it.

Position limit: learned positions have model.max_len rows; RoPE would extrapolate past the
lengths it was trained on, so generation holds every position below model.max_len for both
(model.position=none has no limit). prompt + max_new_tokens > model.max_len is a ConfigError.

Recursive models: the decode step `_step` applies every applied layer of the plan to every
sequence. sharenet/inference/loop_by_loop.py serves cycle models loop by loop instead: per-sequence
early exit after any loop of the shared block (Relaxed Recursive Transformers, arXiv:2410.20672)
and continuous depth-wise batching (slots at different loop depths in one batched application of
the shared block), filling the caches of skipped loops by copying the last computed loop's keys
and values. With exit_threshold=1.0 it gives this module's greedy tokens.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharenet.data.tokenizer import ByteTokenizer
from sharenet.config import compat
from sharenet.errors import ConfigError
from sharenet.inference import test_time_depth
from sharenet.models import DecoderLM
from sharenet.models.lm import KVCache, init_cache
from sharenet.models.routed_decoding import RoutedCache, held_layers
from sharenet.models.loops import Schedule


class Generation(NamedTuple):
  """Generated tokens per prompt (the end token and everything after it removed), timing, and
  the keys and values the final cache holds per token of one sequence (kv_cache_bytes_held)."""
  tokens: list[list[int]]
  seconds: float           # running the compiled program (prefill and decode)
  compile_seconds: float   # tracing and compiling it (0 when cached)
  kv_bytes_per_token: float = 0.0   # kv_cache_bytes_held of the final cache

  @property
  def tokens_per_sec(self) -> float:
    return sum(len(t) for t in self.tokens) / max(self.seconds, 1e-9)


def filter_logits(logits_BV: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Sets logits outside the top-k / top-p sets to -inf (0 and 1.0: no filter).

  Ties at the boundary survive together. Top-p keeps the most likely tokens up to and including
  the first one at which the cumulative probability reaches `top_p` (so always at least one).
  """
  logits_BV = logits_BV.astype(jnp.float32)
  neg = jnp.array(-jnp.inf, jnp.float32)
  if top_k:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV >= kth_B1, logits_BV, neg)
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV   # mass of the more likely tokens
    kept_BV = before_BV < top_p
    threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV >= threshold_B1, logits_BV, neg)
  return logits_BV


def sample(logits_BV: jax.Array, rng: jax.Array, temperature: float, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
  """One token per row: argmax at temperature 0, else a draw from the filtered softmax."""
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = filter_logits(logits_BV.astype(jnp.float32) / temperature, top_k, top_p)
  return jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)


def row_keys(rng: jax.Array, rows_B: jax.Array, steps_B: jax.Array) -> jax.Array:
  """The key of token `steps_B[b]` of request `rows_B[b]`: (B,) keys."""
  return jax.vmap(lambda r, i: jax.random.fold_in(jax.random.fold_in(rng, r), i))(rows_B, steps_B)


def sample_rows(logits_BV: jax.Array, keys_B: jax.Array, temperature: float, top_k: int = 0,
                top_p: float = 1.0) -> jax.Array:
  """`sample` with one key per row (row_keys)."""
  one = lambda logits_V, key: sample(logits_V[None], key, temperature, top_k, top_p)[0]
  return jax.vmap(one)(logits_BV, keys_B)


def bucket(n: int) -> int:
  """Prompt length bucket: the next power of two (one compiled program per bucket)."""
  return 1 << max(0, n - 1).bit_length()


def left_pad(prompts: Sequence[Sequence[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens (B, length), positions (B, length)): prompts right-aligned, pads at position -1."""
  tokens = np.zeros((len(prompts), length), np.int32)
  positions = np.full((len(prompts), length), -1, np.int32)
  for b, p in enumerate(prompts):
    if p:
      tokens[b, length - len(p):] = p
      positions[b, length - len(p):] = np.arange(len(p))
  return tokens, positions


def _step(model: DecoderLM, variables: Any, tokens_BT, cache, positions_BT,
          schedule: Schedule = Schedule()):
  """One cached forward pass: (last position's logits (B, V), updated cache)."""
  logits_BTV, cache = model.apply(variables, tokens_BT, cache=cache, positions_BT=positions_BT,
                                  schedule=schedule)
  return logits_BTV[:, -1], cache


def _generate_padded(variables, tokens_BP, positions_BP, rng, *, model: DecoderLM,
                     max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                     eos_id: int | None, loops: int | None = None):
  """The compiled program: prefill, then the while_loop; (tokens (B, N), steps run)."""
  B, P = tokens_BP.shape
  N = max_new_tokens
  schedule = Schedule() if loops is None else Schedule(loops=loops)
  # the last sampled token is never fed back
  cache = init_cache(model.cfg, B, P + N - 1, loops=loops)
  logits_BV, cache = _step(model, variables, tokens_BP, cache, positions_BP, schedule)

  def draw(i, logits_BV, done_B):
    keys_B = row_keys(rng, jnp.arange(B), jnp.full((B,), i))
    token_B = sample_rows(logits_BV, keys_B, temperature, top_k, top_p)
    if eos_id is None:
      return token_B, done_B
    token_B = jnp.where(done_B, eos_id, token_B)
    return token_B, done_B | (token_B == eos_id)

  token_B, done_B = draw(0, logits_BV, jnp.zeros((B,), bool))
  out_BN = jnp.zeros((B, N), jnp.int32).at[:, 0].set(token_B)
  pos_B = positions_BP[:, -1] + 1

  def cond(state):
    i, _, _, _, _, done_B = state
    return (i < N) & ~jnp.all(done_B)

  def body(state):
    i, token_B, out_BN, cache, pos_B, done_B = state
    logits_BV, cache = _step(model, variables, token_B[:, None], cache, pos_B[:, None],
                             schedule)
    token_B, done_B = draw(i, logits_BV, done_B)
    out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, token_B[:, None], i, axis=1)
    return i + 1, token_B, out_BN, cache, pos_B + 1, done_B

  state = (jnp.ones((), jnp.int32), token_B, out_BN, cache, pos_B, done_B)
  steps, _, out_BN, cache, _, _ = jax.lax.while_loop(cond, body, state)
  return out_BN, steps, kv_cache_bytes_held(model, cache)


def kv_cache_bytes_held(model: DecoderLM, cache: KVCache) -> jax.Array:
  """Bytes of keys and values `cache` holds per token it holds, in its dtype: every cached
  layer's, but a routed segment's recursion r only for the tokens routed through it
  (recursion-wise caching, models/routed_decoding.py). Slot positions and recursion counts are
  bookkeeping, not counted. A routed segment's arrays are dense (static shapes), so the memory
  allocated is that of the unrouted plan; this is what a compacted recursion-wise cache holds."""
  held_BS = cache.key_positions_BS >= 0
  layers = jnp.zeros((), jnp.float32)
  for entry in cache.layers:
    if isinstance(entry, RoutedCache):
      seg = model.cfg.plan.segments[model.cfg.routed_segment]
      layers = layers + held_layers(entry, held_BS, seg.num_sets)
    else:
      layers = layers + entry.k_BSKD.shape[0]
  first = cache.layers[0]
  first = first.kv if isinstance(first, RoutedCache) else first
  # k (and v) of one token in one layer: (kv heads, head_dim) each
  per_layer = sum(a.shape[-2] * a.shape[-1] * a.dtype.itemsize for a in jax.tree.leaves(first))
  return layers * per_layer


_generate_jit = jax.jit(_generate_padded, static_argnames=(
    'model', 'max_new_tokens', 'temperature', 'top_k', 'top_p', 'eos_id', 'loops'))
_COMPILED: dict[Any, Any] = {}


def _aval_key(tree: Any) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((a.shape, a.dtype, getattr(a, 'sharding', None))
                        for a in leaves)


def check_prompts(cfg: Any, prompts: Sequence[Sequence[int]], eos_id: int | None) -> None:
  """ConfigError unless every prompt is non-empty token ids of the vocabulary (and eos_id too)."""
  if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
    raise ConfigError(f'eos_id={eos_id} must be a token id in [0, {cfg.vocab_size})')
  for p in prompts:
    if len(p) == 0:
      raise ConfigError('a prompt is empty; valid: at least one token')
    if min(p) < 0 or max(p) >= cfg.vocab_size:
      raise ConfigError(f'a prompt has token ids outside [0, vocab_size={cfg.vocab_size})')


def check_sampling(cfg: Any, temperature: float, top_k: int, top_p: float) -> None:
  """One ConfigError line for sampling settings outside their ranges."""
  if temperature < 0:
    raise ConfigError(f'temperature={temperature} must be >= 0 (0: greedy)')
  if not 0 <= top_k <= cfg.vocab_size:
    raise ConfigError(f'top_k={top_k} must be in [0, vocab_size={cfg.vocab_size}] (0: off)')
  if not 0 < top_p <= 1:
    raise ConfigError(f'top_p={top_p} must be in (0, 1] (1: off)')


def validate(cfg: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float, top_k: int, top_p: float, eos_id: int | None) -> None:
  """One ConfigError line for settings generation cannot honour, or a model feature cached
  generation refuses (config/compat.py)."""
  compat.check_action('generation', cfg.table_config())
  if not prompts:
    raise ConfigError('generation needs at least one prompt')
  if max_new_tokens < 1:
    raise ConfigError(f'max_new_tokens={max_new_tokens} must be >= 1')
  check_sampling(cfg, temperature, top_k, top_p)
  check_prompts(cfg, prompts, eos_id)
  for p in prompts:
    if cfg.position != 'none' and len(p) + max_new_tokens > cfg.max_len:
      raise ConfigError(
          f'a prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds '
          f'model.max_len={cfg.max_len} (the position limit of model.position={cfg.position}); '
          f'valid: prompt length + max_new_tokens <= {cfg.max_len}')


def generate(model: DecoderLM, variables: Any, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, rng: jax.Array | None = None,
             eos_id: int | None = None, loops: int | None = None) -> Generation:
  """Continues every prompt (a list of token ids) by up to `max_new_tokens` tokens.

  `variables`: what `model.apply` takes (the effective params of a trained state). `rng`: a
  jax key (default key(0); unused at temperature 0). Prompts run as one left-padded batch
  whose rows draw independently; the same prompts, settings and `rng` give the same tokens.
  Returns the tokens after each prompt up to (excluding) the first `eos_id`. `loops`: decode
  at that many loops of the looped segment (None: the plan's;
  sharenet/inference/test_time_depth.py).
  """
  prompts = [list(map(int, p)) for p in prompts]
  validate(model.cfg, prompts, max_new_tokens, temperature, top_k, top_p, eos_id)
  if loops is not None:
    test_time_depth.check_depth(model.cfg, loops, 'depth')
  tokens_BP, positions_BP = left_pad(prompts, bucket(max(len(p) for p in prompts)))
  rng = jax.random.key(0) if rng is None else rng
  static = dict(model=model, max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                top_k=int(top_k), top_p=float(top_p), eos_id=eos_id,
                loops=None if loops is None else int(loops))
  args = (variables, jnp.asarray(tokens_BP), jnp.asarray(positions_BP), rng)
  key = (tuple(sorted(static.items(), key=lambda kv: kv[0])), _aval_key(args))
  compile_seconds = 0.0
  if key not in _COMPILED:
    t0 = time.perf_counter()
    _COMPILED[key] = _generate_jit.lower(*args, **static).compile()
    compile_seconds = time.perf_counter() - t0
  t1 = time.perf_counter()
  out_BN, steps, kv_bytes = jax.block_until_ready(_COMPILED[key](*args))
  t2 = time.perf_counter()
  out_BN = np.asarray(out_BN)[:, :int(steps)]
  result = []
  for row in out_BN.tolist():
    if eos_id is not None and eos_id in row:
      row = row[:row.index(eos_id)]
    result.append(row)
  return Generation(result, t2 - t1, compile_seconds, float(kv_bytes))


def encode(text: str) -> list[int]:
  """Byte-level tokens of `text` (UTF-8): data/tokenizer.py's ByteTokenizer."""
  return ByteTokenizer().encode(text).tolist()


def decode(tokens: Sequence[int]) -> str:
  """Byte-level tokens -> text (ByteTokenizer): invalid UTF-8 appears escaped (\\xNN)."""
  return ByteTokenizer().decode(tokens)
