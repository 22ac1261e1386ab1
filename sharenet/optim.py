"""Optax chain: clipping -> AdamW (decay on matrices only) with a warmup schedule.

With a parametrization's per-leaf multipliers (sharenet/parametrization.py) the chain is
clip -> Adam with per-leaf eps -> per-leaf LR multipliers -> decoupled decay with per-leaf
multipliers (not scaled by the LR multiplier) -> the LR schedule. With every multiplier 1 it is
bit-identical to optax.adamw (asserted in tests/test_parametrization.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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


def scale_by_adam_tree_eps(b1: float, b2: float, eps_tree: Any) -> optax.GradientTransformation:
  """optax.scale_by_adam with a per-leaf eps (same ops, so eps_tree of one value == optax's)."""

  def init_fn(params):
    mu = optax.tree.zeros_like(params)
    nu = optax.tree.zeros_like(params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    count_inc = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
    nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
    updates = jax.tree.map(lambda m, v, e: m / (jnp.sqrt(v + 0.0) + e), mu_hat, nu_hat, eps_tree)
    return updates, optax.ScaleByAdamState(count=count_inc, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


class _Empty(NamedTuple):
  pass


def scale_and_decay(lr_tree: Any, wd_tree: Any) -> optax.GradientTransformation:
  """u <- lr_mult * u + wd_leaf * p: per-leaf LR multipliers, then decay not scaled by them."""

  def update_fn(updates, state, params):
    def leaf(u, p, k, w):
      u = u if k == 1.0 else jnp.asarray(k, u.dtype) * u
      return u if w == 0.0 else u + w * p
    return jax.tree.map(leaf, updates, params, lr_tree, wd_tree), state

  return optax.GradientTransformation(lambda _: _Empty(), update_fn)


def make_optimizer(t: Any, multipliers: Any = None) -> optax.GradientTransformation:
  """The train config's optimizer; its learning rate is reported by `lr_schedule(t)`.

  `multipliers` (parametrization.OptMultipliers) adds per-leaf LR / WD / eps multipliers. Decay
  is `lr(t) * weight_decay * wd_mult * p` (lr-coupled, independent of the per-leaf LR
  multiplier), or with `independent_wd` `(lr(t) / lr_peak) * weight_decay * wd_mult * p`.
  """
  parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
  if multipliers is None:
    parts.append(optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                             weight_decay=t.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
  wd = t.weight_decay / t.lr if multipliers.independent_wd else t.weight_decay
  eps_tree = jax.tree.map(lambda k: t.eps * k, multipliers.eps)
  wd_tree = jax.tree.map(lambda k: wd * k, multipliers.wd)
  parts += [scale_by_adam_tree_eps(t.b1, t.b2, eps_tree),
            scale_and_decay(multipliers.lr, wd_tree),
            optax.scale_by_learning_rate(lr_schedule(t))]
  return optax.chain(*parts)

