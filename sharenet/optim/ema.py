"""train.ema: an exponential moving average of the weights, kept in the optimizer state.

ema_t = d * ema_{t-1} + (1 - d) * params_t after every applied step (d = train.ema; the average
starts at the initial parameters), in float32. It lives in the optimizer state, inside the
bad-step guard (sharenet/optim/guard.py: a skipped step leaves it as it was), so checkpoints
carry it and a resume is exact; it costs one copy of the trainable parameters, which a dry run's
memory report counts. The loop evaluates it beside the weights at every evaluation (`ema/eval_loss`,
`ema/eval_bits_per_byte`, ...) and eval.py --ema evaluates a checkpoint's average.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sharenet.errors import ConfigError


class EmaState(NamedTuple):
  inner: Any
  ema: Any   # shaped as the trainable parameters, float32


def check(t: Any) -> None:
  if not 0.0 <= t.ema < 1.0:
    raise ConfigError(f'train.ema={t.ema}; valid: 0 (off) <= ema < 1, the average\'s decay per '
                      f'step (e.g. 0.999)')


def decay(t: Any) -> float:
  """train.ema of train config `t` (a partial config without the key: 0, off)."""
  return float(getattr(t, 'ema', 0.0))


def track_ema(inner: optax.GradientTransformation, d: float) -> optax.GradientTransformation:
  """`inner`, with the average of the parameters it produces in its state."""

  def init(params):
    return EmaState(inner.init(params), jax.tree.map(lambda p: jnp.asarray(p, jnp.float32),
                                                     params))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError('train.ema needs the parameters in the optimizer update')
    updates, new_inner = inner.update(grads, state.inner, params)
    new_params = optax.apply_updates(params, updates)
    ema = jax.tree.map(lambda e, p: d * e + (1.0 - d) * jnp.asarray(p, jnp.float32), state.ema,
                       new_params)
    return updates, EmaState(new_inner, ema)

  return optax.GradientTransformation(init, update)


def find(opt_state: Any) -> EmaState | None:
  """The EmaState inside an optimizer state (the injected-LR and guard states wrap it)."""
  node = opt_state
  for _ in range(4):
    if isinstance(node, EmaState):
      return node
    node = getattr(node, 'inner_state', None) or getattr(node, 'inner', None)
    if node is None:
      return None
  return None


def kept(opt_state: Any) -> EmaState:
  """The EmaState of an optimizer state (or its abstract tree); ConfigError if there is none."""
  s = find(opt_state)
  if s is None:
    raise ConfigError('this run keeps no average of its weights; valid: train with '
                      '--config.train.ema=0.999 (or another decay)')
  return s


def averaged(opt_state: Any, like: Any) -> Any:
  """The average as parameters (each leaf in `like`'s dtype); ConfigError if there is none."""
  return jax.tree.map(lambda e, p: jnp.asarray(e, p.dtype), kept(opt_state).ema, like)
