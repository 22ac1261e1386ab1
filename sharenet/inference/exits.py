"""Adaptive exit criteria: when a token may stop looping (eval.py --exit CRITERION:THRESHOLD).

After each loop r of the looped segment the shared head (coda, final norm, readout) gives the
next-token distribution p_r; a token exits after the first loop whose criterion fires, or after
the last loop. The criteria read the model's own distribution (softmax of the logits at
temperature 1), never the sampling distribution, so an exit does not depend on the sampling
settings:

  maxprob:t         max_v p_r(v) >= t (Relaxed Recursive Transformers, arXiv:2410.20672;
                    CALM's softmax confidence). t = 1 never fires (float32 probabilities can
                    round to 1).
  entropy:t         H(p_r) <= t nats.
  entropy_change:t  |H(p_r) - H(p_{r-1})| <= t nats: the entropy has settled (Geiping et al.,
                    "Scaling up Test-Time Compute with Latent Reasoning", arXiv:2502.05171, and
                    its reference code seal-rg/recurrent-pretraining, criterion `entropy-diff`;
                    before the first loop H_0 = 100 nats, as there, so a threshold below ~88
                    nats cannot fire after the first loop).
  kl:t              KL(p_r || p_{r-1}) <= t nats: successive loops agree (the same reference,
                    `kl`, which compares successive loops' next-token distributions as
                    KL(p_{r-1} || p_r); before the first loop p_0 is uniform, as there).
  argmax_stable:k   the argmax of p_r is the argmax of the k loops before it (the reference's
                    `argmax-stability`: a count of consecutive loops with an unchanged argmax,
                    0 after the first loop; exits when the count reaches k). k is an integer;
                    k = 0 fires after the first loop, k >= R never.
  latent:t          ||h_r - h_{r-1}|| / ||h_r|| <= t: the relative change of the latent state
                    (the recurrent state after loop r; h_0 is the state entering the first loop,
                    before any injection), the reference's `latent-diff`.
  cosine:t          cos(h_r, h_{r-1}) >= t: the latent state keeps its direction (t in [-1, 1];
                    t = 1 never fires, as maxprob's).

The reference exits on a strict `<` (`>=` for argmax-stability); here `<=` (and `>=` for the
similarities), so a threshold is the largest (smallest) value that still exits. Not built: the
reference's `minp-kl` (KL of min-p-filtered distributions).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sharenet.errors import ConfigError

CRITERIA = ('maxprob', 'entropy', 'entropy_change', 'kl', 'argmax_stable', 'latent', 'cosine')
SYNTAX = ('maxprob:T or cosine:T (T in [0, 1]; cosine down to -1), entropy:T, entropy_change:T, '
          'kl:T or latent:T (T >= 0), argmax_stable:K (an integer K >= 0)')
SIMILARITIES = ('maxprob', 'cosine')   # fire at or above the threshold; 1 never fires
ENTROPY_START = 100.0   # H_0 of entropy_change, the reference's


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
  low = -1.0 if e.criterion == 'cosine' else 0.0
  if (not math.isfinite(t) or t < low or (e.criterion in SIMILARITIES and t > 1) or
      (e.criterion == 'argmax_stable' and t != int(t))):
    raise ConfigError(f'--exit={e.criterion}:{t:g}: bad threshold; valid: {SYNTAX}')
  return Exit(e.criterion, float(t))


class Track(NamedTuple):
  """Per row, what loop r is compared with: the readings of loop r-1 (`start`: before the
  first loop)."""
  logp_BV: jax.Array     # log p_{r-1} (uniform before the first loop): kl
  entropy_B: jax.Array   # H(p_{r-1}) (ENTROPY_START before the first loop): entropy_change
  argmax_B: jax.Array    # argmax p_{r-1} (-1 before the first loop): argmax_stable
  stable_B: jax.Array    # consecutive loops up to r-1 with an unchanged argmax


def start(batch: int, vocab: int) -> Track:
  """The readings before the first loop, as the reference starts them."""
  return Track(jnp.full((batch, vocab), -math.log(vocab), jnp.float32),
               jnp.full((batch,), ENTROPY_START, jnp.float32), jnp.full((batch,), -1, jnp.int32),
               jnp.zeros((batch,), jnp.int32))


def measure(criterion: str, logp_BV: jax.Array, h_BD: jax.Array, prev_h_BD: jax.Array,
            track: Track) -> tuple[jax.Array, Track]:
  """(B,) the criterion's value at loop r, and the readings the next loop compares with.
  `logp_BV`: log p_r; `h_BD` / `prev_h_BD`: the state after loop r and entering it."""
  # Only the criterion's own readings are computed and carried (the rest of `track` stays).
  p_BV = jnp.exp(logp_BV)
  h_BD, prev_h_BD = h_BD.astype(jnp.float32), prev_h_BD.astype(jnp.float32)
  norm_B = jnp.linalg.norm(h_BD, axis=-1)
  if criterion == 'maxprob':
    return jnp.max(p_BV, axis=-1), track
  if criterion in ('entropy', 'entropy_change'):
    entropy_B = -jnp.sum(p_BV * logp_BV, axis=-1)
    value_B = entropy_B if criterion == 'entropy' else jnp.abs(entropy_B - track.entropy_B)
    return value_B, track._replace(entropy_B=entropy_B)
  if criterion == 'kl':
    return jnp.sum(p_BV * (logp_BV - track.logp_BV), axis=-1), track._replace(logp_BV=logp_BV)
  if criterion == 'argmax_stable':
    argmax_B = jnp.argmax(logp_BV, axis=-1).astype(jnp.int32)
    stable_B = jnp.where(argmax_B == track.argmax_B, track.stable_B + 1, 0)
    return stable_B.astype(jnp.float32), track._replace(argmax_B=argmax_B, stable_B=stable_B)
  if criterion == 'latent':
    return jnp.linalg.norm(h_BD - prev_h_BD, axis=-1) / norm_B, track
  cos_B = jnp.sum(h_BD * prev_h_BD, axis=-1) / (norm_B * jnp.linalg.norm(prev_h_BD, axis=-1))
  return cos_B, track


def fires(criterion: str, threshold: jax.Array, value_B: jax.Array) -> jax.Array:
  """(B,) bool: whether the criterion's value (`measure`) fires at the threshold (traced: one
  program for every threshold; `criterion` static)."""
  if criterion in SIMILARITIES:
    return (value_B >= threshold) & (threshold < 1.0)
  if criterion == 'argmax_stable':
    return value_B >= threshold
  return value_B <= threshold
