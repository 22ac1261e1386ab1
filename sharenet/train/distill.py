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
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Distill(NamedTuple):
  """What a step needs of its teacher besides the variables (static: hashable)."""
  model: Any            # the teacher's DecoderLM
  temperature: float
  weight: float


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
  if w_BT is None:
    ce, kd = jnp.mean(nll_BT), jnp.mean(kd_BT)
  else:
    n = jnp.maximum(jnp.sum(w_BT), 1.0)
    ce, kd = jnp.sum(nll_BT * w_BT) / n, jnp.sum(kd_BT * w_BT) / n
  return (1.0 - weight) * ce + weight * kd, {'distill_ce': ce, 'distill_kd': kd}
