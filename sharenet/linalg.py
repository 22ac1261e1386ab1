"""Batched LAPACK decompositions that cannot deadlock XLA's CPU thread pool.

jaxlib 0.10's CPU LAPACK kernels (eigh, svd, ...) spread a batch of matrices over XLA's intra-op
thread pool and block the calling pool thread until the batch is done. XLA runs independent
operations concurrently on that same pool, so once as many batched calls run at once as the pool
has threads (two on a 2-core machine: Shampoo's left and right roots, or two leaves' roots), every
thread waits on work that no thread is free to do, and the program never finishes. It showed as a
hang of a Shampoo step at width 128 (three blocks per MLP kernel) in about half of the runs.

`per_matrix` sends one matrix per call on the CPU (`lax.map`); a single matrix runs inline. Each
matrix goes through the same LAPACK routine as in the batched call, so the values are the same.
Other backends keep the batched call (their solvers do not share XLA's CPU pool).
"""
from __future__ import annotations

from typing import Any, Callable

import jax


def per_matrix(fn: Callable[[jax.Array], Any], x_N: jax.Array) -> Any:
  """`fn` (a batched decomposition such as jnp.linalg.eigh) of x_N (N, ...), one matrix per call
  on the CPU, the batch at once elsewhere."""
  if jax.default_backend() != 'cpu' or x_N.shape[0] == 1:
    return fn(x_N)
  return jax.lax.map(fn, x_N)
