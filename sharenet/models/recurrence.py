"""Recurrent depth inside the model: the state entering the looped segment, and the injection.

Geiping et al., "Scaling up Test-Time Compute with Latent Reasoning" (arXiv:2502.05171;
reference code seal-rg/recurrent-pretraining): the stream entering the looped segment (the
prelude's output, e) is kept, the loops start from a state s_0 (`model.recurrence.init`), and
e re-enters at the start of every loop (`model.recurrence.injection`):

  add     s <- s + e
  concat  s <- A [s; e], A a (2D, D) adapter stored once with the segment (the reference's
          `adapter`; a hidden 'writer' matrix to muP: its output is the stream; its input axis
          'inject' is a width axis of size 2 d_model)

  init embed   s_0 = e (the only choice without injection: the plain looped model)
       zeros   s_0 = 0
       normal  s_0 = embed_scale * embed_init_std * n, n ~ N(0, 1) truncated to [-3, 3] per
               coordinate: the scale of an embedded token, as the reference's `like-init`
               (`initialize_state`: a truncated normal of the init std, times its embedding
               scale). The draw is keyed by (the call's 'recurrence' rng, else a fixed key;
               batch row; absolute position), so cached decoding, and loop-by-loop serving
               (sharenet/inference/loop_by_loop.py), draw what the full forward draws at the
               same row and position; training's rng is fresh per step and per
               micro-batch (train/sampled_depth.py `rngs`).

The loop runner (models/loops.py) applies an `Injection` at the start of every loop in every
lowering (nested, flat, unrolled, a Schedule's no-grad prefix and gradient loops) and for cached
generation, so training, evaluation at another depth and serving see one model.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from sharenet.models.config import ModelConfig
from sharenet.models.layers import Dense

RNG = 'recurrence'   # flax rng stream of the `normal` initial state (training: per step)


class Injection(NamedTuple):
  """The stream entering the looped segment, re-entering at the start of every loop."""
  kind: str                 # 'add' | 'concat'
  e_BTD: jax.Array
  params: Any = None        # concat: the adapter's variables
  adapter: Callable | None = None   # concat: (variables, x (B, T, 2D)) -> (B, T, D)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    if self.kind == 'add':
      return x_BTD + self.e_BTD.astype(x_BTD.dtype)
    x_BT2D = jnp.concatenate([x_BTD, self.e_BTD.astype(x_BTD.dtype)], axis=-1)
    return self.adapter(self.params, x_BT2D).astype(x_BTD.dtype)

  def frozen(self) -> 'Injection':
    """The same without gradient (a no-grad prefix's loop: nothing of it is differentiated)."""
    return self._replace(e_BTD=jax.lax.stop_gradient(self.e_BTD),
                         params=jax.lax.stop_gradient(self.params))


def adapter(cfg: ModelConfig, name: str | None = None) -> Dense:
  """concat's adapter [state; injected] (2D) -> D, created with the segment that loops."""
  return Dense((cfg.d_model,), ('inject',), ('embed',), role='writer',
               init_std=(2 * cfg.d_model) ** -0.5, dtype=jnp.dtype(cfg.dtype),
               param_dtype=jnp.dtype(cfg.param_dtype), dense_grad=cfg.dense_grad, name=name)


def injection(cfg: ModelConfig, e_BTD: jax.Array, adapter_params: Any = None
              ) -> Injection | None:
  """The Injection of `cfg` for the stream `e_BTD` (None: injection none)."""
  kind = cfg.recurrence.injection
  if kind == 'none':
    return None
  if kind == 'add':
    return Injection('add', e_BTD)
  return Injection('concat', e_BTD, {'params': adapter_params},
                   lambda v, x: adapter(cfg).apply(v, x))


def initial_state(cfg: ModelConfig, e_BTD: jax.Array, key: jax.Array | None,
                  positions_BT: jax.Array, rows_B: jax.Array | None = None) -> jax.Array:
  """The state entering the first loop (module docstring); `key` None -> a fixed key; `rows_B`
  the batch row each sequence draws as (default its index: loop-by-loop serving prefills and
  runs a request alone, as the row it has in the batch it came in)."""
  init = cfg.recurrence.init
  if init == 'embed':
    return e_BTD
  if init == 'zeros':
    return jnp.zeros_like(e_BTD)
  key = jax.random.key(0) if key is None else key
  B, T, D = e_BTD.shape
  rows_B = jnp.arange(B) if rows_B is None else rows_B
  rows_BT = jnp.broadcast_to(rows_B[:, None], (B, T))
  positions_BT = jnp.broadcast_to(positions_BT, (B, T))

  def draw(b, t):
    return jax.random.truncated_normal(jax.random.fold_in(jax.random.fold_in(key, b), t),
                                       -3.0, 3.0, (D,))

  noise_BTD = jax.vmap(jax.vmap(draw))(rows_BT, positions_BT)
  return (cfg.embed_scale * cfg.embed_init_std * noise_BTD).astype(e_BTD.dtype)
