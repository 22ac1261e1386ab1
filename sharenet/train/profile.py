"""train.profile.steps=START:END: a jax profiler trace of train steps START..END (1-based, as
the log rows count them) written into DIR/profile (TensorBoard's profile plugin and Perfetto
read it: `tensorboard --logdir DIR/profile`, or xprof).

The trace starts before step START is dispatched and stops once step END has finished on the
device, so it holds exactly those steps' host dispatch and device execution; each step is a
`train_step` step annotation (jax.profiler.StepTraceAnnotation) carrying its number. A resumed
run past END traces nothing; one that resumes inside the range traces the rest of it.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import jax

from sharenet.errors import ConfigError

DIRNAME = 'profile'


def parse_steps(spec: str, total_steps: int) -> tuple[int, int] | None:
  """'START:END' -> (START, END) within 1..train.steps (None for ''); one ConfigError line if
  not."""
  if not spec:
    return None
  valid = f'valid: START:END with 1 <= START <= END <= train.steps={total_steps}, e.g. 3:5'
  try:
    start, end = (int(x) for x in str(spec).split(':'))
  except ValueError:
    raise ConfigError(f'train.profile.steps={spec!r} is not START:END; {valid}') from None
  if not 1 <= start <= end <= total_steps:
    raise ConfigError(f'train.profile.steps={spec!r} is outside the run; {valid}')
  return start, end


class StepProfiler:
  """Starts and stops the trace around the steps of `window` ((START, END) or None)."""

  def __init__(self, workdir: str, window: tuple[int, int] | None):
    self.window, self.dir = window, os.path.join(workdir, DIRNAME)
    self.active = False

  def step(self, step: int):
    """A context around dispatching step `step` (1-based): the trace starts before START and
    the step carries its annotation while the trace runs."""
    if self.window is None or not self.window[0] <= step <= self.window[1]:
      return contextlib.nullcontext()
    if not self.active and jax.process_index() == 0:
      jax.profiler.start_trace(self.dir)
      self.active = True
    return jax.profiler.StepTraceAnnotation('train_step', step_num=step)

  def finished(self, step: int, state: Any) -> None:
    """After step `step` was dispatched: at END, waits for it on the device and stops."""
    if self.active and step >= self.window[1]:
      jax.block_until_ready(state)
      self.stop()

  def stop(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
