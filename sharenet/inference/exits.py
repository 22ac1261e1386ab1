"""Adaptive exit criteria: when a token may stop looping (eval.py --exit CRITERION:THRESHOLD).

After each loop r of the looped segment the shared head (coda, final norm, readout) gives the
next-token distribution p_r; a token exits after the first loop whose criterion fires, or after
the last loop. The criteria read the model's own distribution (softmax of the logits at
temperature 1), never the sampling distribution, so an exit does not depend on the sampling
settings:

  maxprob:t  max_v p_r(v) >= t (Relaxed Recursive Transformers, arXiv:2410.20672; CALM's
             softmax confidence). t = 1 never fires (float32 probabilities can round to 1).
  entropy:t  H(p_r) <= t nats.
  kl:t       KL(p_r || p_{r-1}) <= t nats: successive loops agree (Geiping et al., "Scaling up
             Test-Time Compute with Latent Reasoning", arXiv:2502.05171, and its reference
             code seal-rg/recurrent-pretraining, which compares successive loops' next-token
             distributions, KL(p_{r-1} || p_r) there; before the first loop p_0 is uniform, as
             there).
  latent:t   ||h_r - h_{r-1}|| / ||h_r|| <= t: the relative change of the latent state (the
             stream after loop r; h_0 is the stream entering the first loop), the same
             reference's "latent-diff".

The reference exits on a strict `<`; here `<=` (and `>=` for maxprob), so a threshold is the
largest (smallest) value that still exits.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sharenet.errors import ConfigError

CRITERIA = ('maxprob', 'entropy', 'kl', 'latent')
SYNTAX = 'maxprob:T (T in [0, 1]), entropy:T, kl:T or latent:T (T >= 0)'


class Exit(NamedTuple):
  """A criterion and its threshold (hashable: a static argument of the jitted ticks)."""
  criterion: str = 'maxprob'
  threshold: float = 1.0

  @property
  def never(self) -> bool:
    """maxprob:1 is the rule disabled (plain full-depth decoding)."""
    return self.criterion == 'maxprob' and self.threshold >= 1.0


def parse(spec: str | Exit) -> Exit:
  """'kl:0.01' -> Exit('kl', 0.01); one ConfigError line naming the valid choices otherwise."""
  if isinstance(spec, Exit):
    return check(spec)
  criterion, sep, value = str(spec).partition(':')
  if criterion not in CRITERIA or not sep:
    raise ConfigError(f'--exit={spec!r}: unknown criterion; valid: {SYNTAX}')
  try:
    threshold = float(value)
  except ValueError:
    raise ConfigError(f'--exit={spec!r}: the threshold is not a number; valid: {SYNTAX}') from None
  return check(Exit(criterion, threshold))


def check(e: Exit) -> Exit:
  if e.criterion not in CRITERIA:
    raise ConfigError(f'exit criterion {e.criterion!r} is unknown; valid: {SYNTAX}')
  t = e.threshold
  if not math.isfinite(t) or t < 0 or (e.criterion == 'maxprob' and t > 1):
    raise ConfigError(f'--exit={e.criterion}:{t}: bad threshold; valid: {SYNTAX}')
  return Exit(e.criterion, float(t))


def uniform_logp(batch: int, vocab: int) -> jax.Array:
  """p_0 of the kl criterion: the uniform distribution's log-probabilities (B, V)."""
  return jnp.full((batch, vocab), -math.log(vocab), jnp.float32)


def fires(criterion: str, threshold: jax.Array, logp_BV: jax.Array, prev_logp_BV: jax.Array,
          h_BD: jax.Array, prev_h_BD: jax.Array) -> jax.Array:
  """(B,) bool: whether loop r's exit fires. `logp_BV` / `prev_logp_BV`: log p_r and log
  p_{r-1}; `h_BD` / `prev_h_BD`: the stream after loop r and entering it. `threshold` is
  traced (one program for every threshold), `criterion` static."""
  if criterion == 'maxprob':
    return (jnp.max(jnp.exp(logp_BV), axis=-1) >= threshold) & (threshold < 1.0)
  if criterion == 'entropy':
    return -jnp.sum(jnp.exp(logp_BV) * logp_BV, axis=-1) <= threshold
  if criterion == 'kl':
    return jnp.sum(jnp.exp(logp_BV) * (logp_BV - prev_logp_BV), axis=-1) <= threshold
  h_BD, prev_h_BD = h_BD.astype(jnp.float32), prev_h_BD.astype(jnp.float32)
  change_B = jnp.linalg.norm(h_BD - prev_h_BD, axis=-1)
  return change_B <= threshold * jnp.linalg.norm(h_BD, axis=-1)
