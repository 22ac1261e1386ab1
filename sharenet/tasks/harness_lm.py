"""A sharenet model answering EleutherAI lm-evaluation-harness requests.

`HarnessLM(model, variables, tok, ...)` answers the three request types every task of the
harness reduces to (lm-eval 0.4; Gao et al., "A framework for few-shot language model
evaluation", the harness's own citation), computed from the model's logits. It becomes the
harness's `lm_eval.api.model.LM` in sharenet/tasks/task_eval.py `as_harness_model`, so importing
this module (the train loop does) does not import the harness.

- `loglikelihood(context, continuation)`: the summed log-probability of the continuation's
  tokens after the context, and whether greedy decoding would produce them all. The pair is
  encoded as the harness's Hugging Face model does: trailing spaces of the context move to the
  continuation, the whole text is encoded and the continuation is what follows the context's
  own encoding (so a BPE merge across the boundary is scored as the model would see it). An empty
  context conditions on the prefix token (the end-of-document id; for a byte model trained
  without one, vocab 256, the newline byte).
- `loglikelihood_rolling(text)`: the text's whole log-probability in windows of `max_length`
  tokens, each token predicted once with as much context as fits (`lm_eval.utils`'s rolling
  windows, the rule the harness documents), for perplexity tasks.
- `generate_until(context, gen_kwargs)`: greedy (or `do_sample` with its temperature) KV-cached
  generation (sharenet/inference/generate.py; with an `exit` rule, loop-by-loop decoding with
  adaptive exits, sharenet/inference/loop_by_loop.py), cut at the first `until` string.

Batching: scoring requests are sorted by length, padded on the right to a power-of-two bucket
(at least 16, at most `max_length`) and run `max_batch_tokens // bucket` rows at a time (the
last batch filled with empty rows), so the jitted forward compiles once per bucket and the
logits never exceed `max_batch_tokens` x vocab floats. Right padding changes nothing before it
(causal attention), so a request's numbers do not depend on its batch or bucket (tested);
the per-token log-probabilities are summed on the host in float64. Expert-choice routing is the
exception: its routers pick tokens across the padded row (docs/routing.md), so its scores depend
on the bucket; it is refused.

`max_length` is the context the model was trained on (train.seq_len) unless given; `schedule`
runs another depth of a looped model (models/loops.py Schedule), the caller's choice.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from sharenet.errors import ConfigError
from sharenet.inference import exits, generate, loop_by_loop
from sharenet.models import DecoderLM
from sharenet.models.loops import Schedule

MIN_BUCKET = 16
DEFAULT_MAX_GEN = 256   # the harness's default max_gen_toks
GEN_BATCH = 8           # prompts per generation batch (one compiled program per prompt bucket)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _token_scores(model: DecoderLM, variables: Any, inputs_BT: jax.Array, targets_BT: jax.Array,
                  schedule: Schedule) -> tuple[jax.Array, jax.Array]:
  """(log p(target) (B, T) float32, target == argmax (B, T)) of every position."""
  extra = {} if schedule.is_default else {'schedule': schedule}
  logits_BTV, _ = model.apply(variables, inputs_BT, mutable=[], **extra)
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return logp_BT, jnp.argmax(logp_BTV, axis=-1) == targets_BT


def check_model(cfg: Any) -> None:
  """One ConfigError line for a model whose task scores would depend on their padding."""
  if cfg.routing.kind == 'expert_choice':
    raise ConfigError('downstream tasks with model.routing.kind=expert_choice: its routers '
                      'choose tokens across the padded batch row, so a score would depend on '
                      'its padding; valid: token_choice routing or an unrouted model')


class HarnessLM:
  """The harness's three requests over a sharenet model (module doc)."""

  def __init__(self, model: DecoderLM, variables: Any, tok: Any, *, max_length: int,
               schedule: Schedule = Schedule(), max_batch_tokens: int = 8192,
               exit: str | None = None, depth: int | None = None):
    cfg = model.cfg
    check_model(cfg)
    if max_length < 2:
      raise ConfigError(f'the harness context max_length={max_length}; valid: >= 2 tokens')
    self.model, self.variables, self.tok = model, variables, tok
    self.max_length, self.schedule = int(max_length), schedule
    self.max_batch_tokens = int(max_batch_tokens)
    self.exit = None if exit is None else exits.parse(exit)
    self.depth = depth
    vocab = cfg.vocab_size
    self.prefix_id = tok.eod_id if tok.eod_id < vocab else tok.encode('\n').tolist()[0]
    self.eos_id = tok.eod_id if tok.eod_id < vocab else None

  # -- encoding ------------------------------------------------------------------------------

  def _encode(self, text: str) -> list[int]:
    return self.tok.encode(text).tolist()

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the harness's Hugging Face model splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
      return [self.prefix_id], self._encode(continuation)
    whole, ctx = self._encode(context + continuation), self._encode(context)
    return ctx, whole[len(ctx):]

  # -- scoring -------------------------------------------------------------------------------

  def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
            ) -> list[tuple[float, bool]]:
    """(sum of log p(continuation token), all greedy) of each (context ids, continuation ids):
    the last max_length tokens of context + continuation are the model's input."""
    rows = []
    for i, (ctx, cont) in enumerate(pairs):
      if not cont:
        raise ConfigError(f'request {i}: an empty continuation; valid: at least one token')
      if len(cont) > self.max_length:
        raise ConfigError(f'request {i}: a continuation of {len(cont)} tokens exceeds the '
                          f'context of {self.max_length}; valid: a shorter continuation')
      whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
      rows.append((whole[:-1], whole[1:], len(cont)))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    start = 0
    while start < len(order):
      length = min(self.max_length, max(MIN_BUCKET, generate.bucket(len(rows[order[start]][0]))))
      per_batch = max(1, self.max_batch_tokens // length)
      chunk = order[start:start + per_batch]
      inputs = np.zeros((per_batch, length), np.int32)
      targets = np.zeros((per_batch, length), np.int32)
      for b, i in enumerate(chunk):
        inp, tgt, _ = rows[i]
        inputs[b, :len(inp)], targets[b, :len(tgt)] = inp, tgt
      logp, greedy = jax.device_get(_token_scores(self.model, self.variables,
                                                  jnp.asarray(inputs), jnp.asarray(targets),
                                                  self.schedule))
      for b, i in enumerate(chunk):
        n, end = rows[i][2], len(rows[i][0])
        out[i] = (float(logp[b, end - n:end].astype(np.float64).sum()),
                  bool(greedy[b, end - n:end].all()))
      start += len(chunk)
    return out

  def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False
                    ) -> list[tuple[float, bool]]:
    return self.score([self.encode_pair(*r.args) for r in requests])

  def rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
    """The harness's disjoint rolling windows (context ids, predicted ids) of a text."""
    from lm_eval import utils as lm_utils
    return [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
        token_list=self._encode(text), prefix_token=self.prefix_id,
        max_seq_len=self.max_length, context_len=1)]

  def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False
                            ) -> list[float]:
    windows = [self.rolling_windows(r.args[0]) for r in requests]
    scores = iter(self.score([w for ws in windows for w in ws]))
    return [float(sum(next(scores)[0] for _ in ws)) for ws in windows]

  # -- generation ----------------------------------------------------------------------------

  def _generate(self, prompts: list[list[int]], max_new: int, temperature: float,
                seed: int) -> list[list[int]]:
    sampling = dict(temperature=temperature, rng=jax.random.key(seed), eos_id=self.eos_id)
    if self.exit is not None:
      return loop_by_loop.generate_early_exit(self.model, self.variables, prompts, max_new,
                                              exit=self.exit, depth=self.depth,
                                              **sampling).tokens
    return generate.generate(self.model, self.variables, prompts, max_new, loops=self.depth,
                             **sampling).tokens

  def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
    out: list[str] = [''] * len(requests)
    groups: dict[tuple[Any, ...], list[int]] = {}
    settings = []
    for i, r in enumerate(requests):
      context, kwargs = r.args
      kwargs = dict(kwargs or {})
      until = kwargs.pop('until', None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_new = int(kwargs.pop('max_gen_toks', DEFAULT_MAX_GEN))
      temperature = float(kwargs.pop('temperature', 0.0)) if kwargs.pop('do_sample', False) \
          else 0.0
      limit = min(self.max_length, self.model.cfg.max_len) - max_new
      if limit < 1:
        raise ConfigError(f'generate_until: max_gen_toks={max_new} leaves no room for a prompt '
                          f'in a context of {min(self.max_length, self.model.cfg.max_len)} '
                          f'tokens; valid: max_gen_toks < that')
      prompt = (self._encode(context) or [self.prefix_id])[-limit:]
      settings.append((prompt, until))
      groups.setdefault((max_new, temperature), []).append(i)
    for (max_new, temperature), idx in groups.items():
      idx = sorted(idx, key=lambda i: len(settings[i][0]))
      for s in range(0, len(idx), GEN_BATCH):
        chunk = idx[s:s + GEN_BATCH]
        prompts = [settings[i][0] for i in chunk]
        prompts += [prompts[-1]] * (GEN_BATCH - len(prompts))   # one batch shape
        tokens = self._generate(prompts, max_new, temperature, seed=s)
        for i, toks in zip(chunk, tokens):
          text = self.tok.decode(toks)
          for stop in settings[i][1]:
            if stop and stop in text:
              text = text[:text.index(stop)]
          out[i] = text
    return out
