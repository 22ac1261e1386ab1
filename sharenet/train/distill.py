"""The distillation loss: a student's logits against a frozen teacher's (train.teacher).

Knowledge distillation (Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network",
arXiv:1503.02531, section 2): the student matches the teacher's next-token distribution softened
by a temperature T, by the forward KL

    KD_t = T^2 * KL(softmax(z_teacher / T) || softmax(z_student / T))
         = T^2 * sum_v p_T(v) (log p_T(v) - log q_T(v))

per position t; the T^2 keeps its gradient's scale independent of T (the paper's note). The step's
loss mixes it with the next-token cross entropy: (1 - w) * CE + w * mean_t KD_t for
w = train.teacher.weight (1: distillation only), the uptraining recipe of Relaxed Recursive
Transformers (Bae et al., arXiv:2410.20672, section 3.3: the recursive student distilled from
the model it was converted from). A student equal to its teacher has KD = 0 and, at w = 1, zero
gradient (tests/train/test_distill.py).

Hidden-state matching (train.teacher.match='S:T,...'): the tail-layer distillation with which
FoldGPT cures a folded model (Liu et al., arXiv:2407.00928) matches the student's residual stream
after its applied layer S to the teacher's after layer T, adding

    match_weight * mean over pairs (S, T) of mean_t mean_d (n(h_S) - n(h_T))^2

to the loss, where n(h) = h / rms(h) over d_model with train.teacher.match_norm (normalised
output features, so the loss is blind to the stream's scale, which grows with depth; the pruned-
block paper trains its replacement blocks with output feature normalization, FlexiGPT, arXiv:2501.14713
[its exact normalization unpublished: this is the reading documented in docs/interop.md]) and
n(h) = h without. The streams come from the models' untied views (sharenet/models/streams.py),
so any plan with one can be a student or a teacher; reported as `distill_hidden`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sharenet.errors import ConfigError


class Distill(NamedTuple):
  """What a step needs of its teacher besides the variables (static: hashable)."""
  model: Any            # the teacher's DecoderLM
  temperature: float
  weight: float
  match: tuple[tuple[int, int], ...] = ()   # (student layer, teacher layer) pairs
  match_weight: float = 1.0
  match_norm: bool = True


def parse_match(spec: str, student_layers: int, teacher_layers: int) -> tuple[tuple[int, int], ...]:
  """train.teacher.match 'S:T,S:T' -> ((S, T), ...), each layer in range (one ConfigError
  line if not)."""
  valid = (f'valid: comma-separated STUDENT:TEACHER applied-layer indices, 0..'
           f'{student_layers - 1} : 0..{teacher_layers - 1}, e.g. '
           f'{student_layers - 1}:{teacher_layers - 1}')
  pairs = []
  for item in (x.strip() for x in spec.split(',')):
    parts = item.split(':')
    try:
      s, t = (int(p) for p in parts)
    except ValueError:
      raise ConfigError(f'train.teacher.match={spec!r}: {item!r} is not S:T; {valid}') from None
    if not (0 <= s < student_layers and 0 <= t < teacher_layers):
      raise ConfigError(f'train.teacher.match={spec!r}: {item!r} is out of range; {valid}')
    pairs.append((s, t))
  if len(set(pairs)) != len(pairs):
    raise ConfigError(f'train.teacher.match={spec!r} names a pair twice; {valid}')
  return tuple(pairs)


def _features(h_BTD: jax.Array, normalize: bool) -> jax.Array:
  h = h_BTD.astype(jnp.float32)
  if not normalize:
    return h
  return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-12)


def hidden_per_token(student_LBTD: jax.Array, teacher_LBTD: jax.Array,
                     match: tuple[tuple[int, int], ...], normalize: bool) -> jax.Array:
  """(B, T): the mean over matched pairs of mean_d (n(h_S) - n(h_T))^2; no gradient reaches
  the teacher."""
  teacher_LBTD = jax.lax.stop_gradient(teacher_LBTD)
  per_pair = [jnp.mean(jnp.square(_features(student_LBTD[s], normalize) -
                                  _features(teacher_LBTD[t], normalize)), axis=-1)
              for s, t in match]
  return sum(per_pair) / len(per_pair)


def kd_per_token(student_BTV: jax.Array, teacher_BTV: jax.Array,
                 temperature: float) -> jax.Array:
  """T^2 KL(teacher_T || student_T) at every position (B, T), in float32; no gradient reaches
  the teacher."""
  t = jnp.float32(temperature)
  log_q = jax.nn.log_softmax(student_BTV.astype(jnp.float32) / t, axis=-1)
  log_p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_BTV).astype(jnp.float32) / t, axis=-1)
  return t * t * jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def mix(nll_BT: jax.Array, kd_BT: jax.Array, weight: float,
        w_BT: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
  """(1 - weight) * mean CE + weight * mean KD, and both means as step metrics; with a loss
  mask `w_BT`, means over the positions it counts."""
  ce, kd = token_mean(nll_BT, w_BT), token_mean(kd_BT, w_BT)
  return (1.0 - weight) * ce + weight * kd, {'distill_ce': ce, 'distill_kd': kd}


def token_mean(x_BT: jax.Array, w_BT: jax.Array | None) -> jax.Array:
  """The mean of a per-token loss over the positions the loss mask `w_BT` counts (all: None)."""
  if w_BT is None:
    return jnp.mean(x_BT)
  return jnp.sum(x_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0)
