"""metrics.jsonl + TensorBoard event files, written by process 0."""
from __future__ import annotations

import json
import os
from typing import Any

import jax


def note(message: str) -> None:
  """One line on process 0's stdout, prefixed `sharenet: `."""
  if jax.process_index() == 0:
    print(f'sharenet: {message}', flush=True)


class MetricsWriter:
  """Appends one JSON object per call to DIR/metrics.jsonl and mirrors scalars to TensorBoard."""

  def __init__(self, workdir: str):
    self._enabled = jax.process_index() == 0
    if not self._enabled:
      return
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', buffering=1)
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, 'tb'))
    except ImportError:  # TensorBoard is optional; the jsonl file is the contract
      self._tb = None

  def write(self, step: int, **scalars: Any) -> None:
    if not self._enabled:
      return
    row = {'step': int(step), **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(row) + '\n')
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, float(v), step)

  def close(self) -> None:
    if self._enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """All rows of DIR/metrics.jsonl."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]
