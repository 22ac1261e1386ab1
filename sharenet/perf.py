"""Matmul-relative MFU: model FLOP/s over the FLOP/s of a large jitted jnp.dot, same process."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def matmul_peak_flops(n: int = 2048, dtype: str = 'float32', repeats: int = 5) -> float:
  """Best-of-`repeats` FLOP/s of an (n, n) @ (n, n) jitted matmul on the default device."""
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  f = jax.jit(jnp.dot)
  f(a, b).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best
