"""Skipping bad steps instead of dying: train.skip_nonfinite and train.spike_factor.

A long run on a pod should survive the rare batch whose gradient is non-finite or spikes far
above its recent size. `skip_bad_steps` wraps the optimizer (inside the injected peak LR, so
sharenet/optim/chain.py's state handling is unchanged): a step is skipped when its gradient's
global norm is not finite (train.skip_nonfinite) or exceeds train.spike_factor times the median
of the last train.spike_window accepted steps' norms (once that many have been seen). A skipped
step applies a zero update and leaves the optimizer's own state (moments, counts) as it was, so
the parameters are bit for bit the previous step's; the step counter, the data stream and the LR
schedule move on. The guard's state (the window of norms, the skipped totals) is part of the
optimizer state, so a checkpoint resumes it exactly. The train step reports `skipped_steps`
(the total) and `skipped_in_a_row`; after train.max_skips in a row the loop stops with one line
naming the step (sharenet/train/loop.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sharenet.errors import ConfigError


class GuardState(NamedTuple):
  inner: Any
  norms: jax.Array      # (window,) float32: accepted steps' gradient norms, a ring
  seen: jax.Array       # int32: accepted steps recorded in the ring
  skipped: jax.Array    # int32: steps skipped so far
  in_a_row: jax.Array   # int32: steps skipped since the last accepted one
  last_skipped: jax.Array   # bool: this step was skipped


def check(t: Any) -> None:
  """One ConfigError line for bad guard settings of a train config."""
  if t.spike_factor and t.spike_factor <= 1:
    raise ConfigError(f'train.spike_factor={t.spike_factor}; valid: 0 (off) or > 1 (skip a step '
                      f'whose gradient norm exceeds that many times the recent median)')
  if t.spike_window < 1 or t.max_skips < 1:
    raise ConfigError(f'train.spike_window={t.spike_window}, train.max_skips={t.max_skips}; '
                      f'valid: >= 1 each')


def enabled(t: Any) -> bool:
  """Whether train config `t` guards its steps (a partial config without the keys: no)."""
  return bool(getattr(t, 'skip_nonfinite', False) or getattr(t, 'spike_factor', 0.0))


def median_of_ring(norms: jax.Array, seen: jax.Array) -> jax.Array:
  """The median of the ring's filled entries (min(seen, window) of them)."""
  filled = jnp.arange(norms.shape[0]) < jnp.minimum(seen, norms.shape[0])
  return jnp.nanmedian(jnp.where(filled, norms, jnp.nan))


def skip_bad_steps(inner: optax.GradientTransformation, nonfinite: bool, spike_factor: float,
                   window: int) -> optax.GradientTransformation:
  """`inner`, skipping the steps the module docstring describes."""

  def init(params):
    return GuardState(inner.init(params), jnp.zeros((window,), jnp.float32),
                      jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                      jnp.zeros((), jnp.int32), jnp.zeros((), bool))

  def update(grads, state, params=None):
    norm = optax.global_norm(grads).astype(jnp.float32)
    bad = jnp.zeros((), bool)
    if nonfinite:
      bad = bad | ~jnp.isfinite(norm)
    if spike_factor:
      warm = state.seen >= window
      bad = bad | (warm & (norm > spike_factor * median_of_ring(state.norms, state.seen)))
    updates, new_inner = inner.update(grads, state.inner, params)
    keep = lambda new, old: jnp.where(bad, old, new)
    updates = jax.tree.map(lambda u: jnp.where(bad, jnp.zeros_like(u), u), updates)
    new_inner = jax.tree.map(keep, new_inner, state.inner)
    norms = keep(state.norms.at[state.seen % window].set(norm), state.norms)
    return updates, GuardState(new_inner, norms, state.seen + (~bad).astype(jnp.int32),
                               state.skipped + bad.astype(jnp.int32),
                               jnp.where(bad, state.in_a_row + 1, 0), bad)

  return optax.GradientTransformation(init, update)


def find(opt_state: Any) -> GuardState | None:
  """The guard's state inside an optimizer state (None without a guard)."""
  if isinstance(opt_state, GuardState):
    return opt_state
  inner = getattr(opt_state, 'inner_state', None)
  return inner if isinstance(inner, GuardState) else None


def metrics(opt_state: Any) -> dict[str, jax.Array]:
  """The step's guard rows: skipped_steps, skipped_in_a_row, step_skipped ({} without one)."""
  g = find(opt_state)
  if g is None:
    return {}
  return {'skipped_steps': g.skipped, 'skipped_in_a_row': g.in_a_row,
          'step_skipped': g.last_skipped}
