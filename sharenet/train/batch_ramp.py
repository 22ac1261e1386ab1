"""train.batch_ramp: a batch size that grows during the run (as the Mixture-of-Recursions
reference ramps its batch), each size compiled once.

`train.batch_ramp='4:50,8:120'` trains at batch 4 for steps 1..50, at 8 for steps 51..120 and at
train.batch_size from then on. The data iterator reads chunks of the ramp's first batch (b0 rows;
every stage's batch and train.batch_size are multiples of it), and a step at batch B takes B / b0
consecutive chunks, so the data stream is one sequence of chunks whatever the ramp and a
checkpoint resumes it exactly. The train step is jitted once and compiled once per distinct
batch shape (jax caches each). Tokens per second and MFU count each step's own tokens.

Checked in one ConfigError line each: the format, a stage batch that b0 does not divide or that
does not divide train.batch_size, stage ends that do not increase or pass train.steps, a batch
the batch shards (train.grad_accum, the mesh) cannot split, and data.mixture (its shares are
kept by rows per step).
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import numpy as np

from sharenet.errors import ConfigError


class Ramp(NamedTuple):
  stages: tuple[tuple[int, int], ...]   # (batch, last step of the stage), increasing steps
  final: int                            # train.batch_size, after the last stage

  @property
  def chunk(self) -> int:
    """Rows per data chunk: the first stage's batch."""
    return self.stages[0][0]

  def batch_at(self, step: int) -> int:
    """The batch of 1-based step `step`."""
    for batch, until in self.stages:
      if step <= until:
        return batch
    return self.final

  def batches(self) -> list[int]:
    return sorted({b for b, _ in self.stages} | {self.final})


def parse(spec: str, batch_size: int, steps: int) -> Ramp | None:
  """train.batch_ramp -> Ramp (None for '')."""
  if not spec:
    return None
  valid = (f'valid: BATCH:LAST_STEP,... with increasing steps up to train.steps={steps}, each '
           f'batch a multiple of the first that divides train.batch_size={batch_size}, e.g. '
           f'{batch_size // 4 or 1}:{max(steps // 4, 1)}')
  try:
    items = spec.replace(' ', '').split(',')
    stages = tuple(tuple(int(x) for x in item.split(':')) for item in items)
    if any(len(s) != 2 for s in stages):
      raise ValueError
  except ValueError:
    raise ConfigError(f'train.batch_ramp={spec!r} is not BATCH:LAST_STEP,...; {valid}') from None
  ends = [u for _, u in stages]
  if any(b < 1 for b, _ in stages) or ends != sorted(set(ends)) or ends[0] < 1 or ends[-1] > steps:
    raise ConfigError(f'train.batch_ramp={spec!r} has a batch below 1 or stage ends that do not '
                      f'increase within the run; {valid}')
  b0 = stages[0][0]
  for b, _ in stages:
    if b % b0 or batch_size % b:
      raise ConfigError(f'train.batch_ramp={spec!r}: batch {b} does not divide '
                        f'train.batch_size={batch_size} or is not a multiple of the first ({b0}); '
                        f'{valid}')
  return Ramp(stages, batch_size)


def check(ramp: Ramp | None, data_cfg: Any) -> None:
  if ramp is not None and getattr(data_cfg, 'mixture', ''):
    raise ConfigError('train.batch_ramp with data.mixture: the mixture assigns its sources by '
                      'the rows of a fixed batch; valid: one of them')


def next_batch(it: Iterator[Any], chunks: int) -> Any:
  """`chunks` consecutive chunks of the iterator as one batch (rows concatenated)."""
  parts = [next(it) for _ in range(chunks)]
  if chunks == 1:
    return parts[0]
  if isinstance(parts[0], dict):
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
  return np.concatenate(parts)
