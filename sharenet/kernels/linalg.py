"""Batched LAPACK decompositions that cannot deadlock XLA's CPU thread pool.

jaxlib 0.10's CPU LAPACK kernels (eigh, svd, ...) spread a batch of matrices over XLA's intra-op
thread pool and block the calling pool thread until the batch is done. XLA runs independent
operations concurrently on that same pool, so once as many batched calls run at once as the pool
has threads (two on a 2-core machine: Shampoo's left and right roots, or two leaves' roots), every
thread waits on work that no thread is free to do, and the program never finishes. It showed as a
hang of a Shampoo step at width 128 (three blocks per MLP kernel) in about half of the runs.

`per_matrix` sends one matrix per call on the CPU (`lax.map`, or the call itself for one). Under
`jax.vmap` (the vmapped LR sweep maps whole train steps) a custom batching rule maps over the new
axis too, so no vmap turns the calls back into a batch. Each matrix goes through the same LAPACK
routine as in the batched call, so the values are the same. Other backends keep the batched call
(their solvers do not share XLA's CPU pool). The result is not differentiable (custom_vmap);
its callers (Shampoo's roots, the SVD initialisations of conversions) do not differentiate it.
"""
from __future__ import annotations

from typing import Any, Callable

import jax


def per_matrix(fn: Callable[[jax.Array], Any], x_N: jax.Array) -> Any:
  """`fn` (a batched decomposition such as jnp.linalg.eigh) of x_N (N, ...), one matrix per call
  on the CPU, also under vmap; the batch at once elsewhere."""
  if jax.default_backend() != 'cpu':
    return fn(x_N)

  @jax.custom_batching.custom_vmap
  def one_at_a_time(x):
    if x.shape[0] == 1:
      return jax.tree.map(lambda a: a[None], fn(x[0]))
    return jax.lax.map(fn, x)

  @one_at_a_time.def_vmap
  def rule(axis_size, in_batched, x):   # the vmapped axis is axis 0 of x where batched
    del axis_size
    out = jax.lax.map(one_at_a_time, x) if in_batched[0] else one_at_a_time(x)
    return out, jax.tree.map(lambda _: in_batched[0], out)

  return one_at_a_time(x_N)
