"""Optax chain: clipping -> AdamW (decay on matrices only) with a warmup schedule."""
from __future__ import annotations

from typing import Any

import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.errors import ConfigError

SCHEDULES = ('wsd', 'cosine', 'constant')
DECAYED = ('kernel', 'embedding', 'pos_embed', 'lora_a', 'lora_b')


def lr_schedule(t: Any) -> optax.Schedule:
  """Linear warmup, then constant / cosine / warmup-stable-decay (linear cooldown)."""
  if t.schedule not in SCHEDULES:
    raise ConfigError(f'train.schedule={t.schedule!r} is unknown; valid: {", ".join(SCHEDULES)}')
  peak, floor = t.lr, t.lr * t.min_lr_ratio
  warmup = min(t.warmup_steps, t.steps)
  if t.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(t.steps, warmup + 1), floor)
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  if t.schedule == 'constant':
    return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
  decay = max(1, int(t.decay_fraction * t.steps))
  stable = max(t.steps - decay, warmup)
  return optax.join_schedules(
      [warm, optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
      [warmup, stable])


def decay_mask(params: Any) -> Any:
  """True for matrices (kernels, embeddings, LoRA factors); norm gains and biases are not decayed."""
  flat = flatten_dict(params)
  return unflatten_dict({k: k[-1] in DECAYED for k in flat})


def make_optimizer(t: Any) -> optax.GradientTransformation:
  """The train config's optimizer; its learning rate is reported by `lr_schedule(t)`."""
  parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
  parts.append(optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                           weight_decay=t.weight_decay, mask=decay_mask))
  return optax.chain(*parts)

