"""The output layer's operator norms, in every log row: norm transfer's observable.

Filatov, Wang, Ebert, Kesselheim, "Optimal Scaling Needs Optimal Norm", arXiv:2510.03871: under
Scion (and Adam) the optimal (learning rate, batch size) pair at every model and data size
gives the same operator norm of the output layer, its RMS -> l_inf norm (the norm of Scion's
readout LMO). With W the readout as it maps the final stream (d_in) to the logits (vocab),
read through the model's multipliers (the parametrization's forward multiplier and the logits
multiplier; the embedding's transpose when the embeddings are tied):

  output_norm/rms_to_inf  max over vocabulary rows of ||w_v||_2 x sqrt(d_in), exactly
  output_norm/spectral    its largest singular value, by `POWER_STEPS` power iterations from a
                          fixed start (an estimate from below: cheap, not exact)

Both are computed in the train step from the updated weights (a reduction and a few
matrix-vector products of the readout: small beside the step's logits matmul).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

POWER_STEPS = 10


def readout(cfg: Any, table: dict, variables: Any) -> jax.Array | None:
  """The effective readout as a (d_in, vocab) float32 matrix (None: the model has none)."""
  path = next((k for k, i in table.items() if i.role == 'readout' and i.num_stack == 0), None)
  if path is None and cfg.tie_embeddings:
    path = next((k for k, i in table.items() if i.role == 'embedding' and i.num_stack == 0),
                None)
    transpose = True
  else:
    transpose = False
  if path is None:
    return None
  w = variables
  for k in path:
    w = w[k]
  w = w.astype(jnp.float32)
  w = w.T if transpose else w.reshape((-1, w.shape[-1]))
  return w * cfg.logits_mult


def norms(w: jax.Array) -> dict[str, jax.Array]:
  """{'output_norm/rms_to_inf', 'output_norm/spectral'} of a (d_in, vocab) readout `w`."""
  d_in = w.shape[0]
  rms_to_inf = jnp.sqrt(jnp.max(jnp.sum(jnp.square(w), axis=0)) * d_in)
  v = jnp.ones((w.shape[1],), jnp.float32) / jnp.sqrt(w.shape[1])

  def step(v, _):   # products and sums, not matmuls: a float32 metric of the parameters, so
    # a bfloat16 step keeps its rule that every matmul is bfloat16 (tests/kernels/test_lowering.py)
    u = jnp.sum(w * v[None, :], axis=1)
    v = jnp.sum(w * u[:, None], axis=0)
    return v / (jnp.sqrt(jnp.sum(v * v)) + 1e-30), None
  v, _ = jax.lax.scan(step, v, None, length=POWER_STEPS)
  u = jnp.sum(w * v[None, :], axis=1)
  return {'output_norm/rms_to_inf': rms_to_inf, 'output_norm/spectral': jnp.sqrt(jnp.sum(u * u))}
