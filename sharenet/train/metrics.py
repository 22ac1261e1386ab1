"""A run's metrics, written by process 0 to each logger of train.loggers: metrics.jsonl (always:
the run's record, which resume, the studies and eval.py read), TensorBoard event files (DIR/tb)
and Weights & Biases (the `wandb` package; DIR/wandb holds its run, offline or synced).

W&B: `train.wandb.project` / `entity` / `name` (default: the workdir's name) / `mode` ('' : the
WANDB_MODE environment variable, else online; offline writes DIR/wandb/offline-run-* for `wandb
sync`). The run's id is kept in DIR/wandb_run_id, so a resumed run appends to the same W&B run;
W&B drops rows of steps it has already seen (the steps a killed run redoes), which
metrics.jsonl keeps. The config logged is the run's resolved config.
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax

from sharenet.errors import ConfigError

LOGGERS = ('jsonl', 'tensorboard', 'wandb')
WANDB_MODES = ('', 'online', 'offline', 'disabled')
RUN_ID_FILE = 'wandb_run_id'


def note(message: str) -> None:
  """One line on process 0's stdout, prefixed `sharenet: `."""
  if jax.process_index() == 0:
    print(f'sharenet: {message}', flush=True)


def parse_loggers(spec: str) -> tuple[str, ...]:
  """train.loggers 'jsonl,tensorboard,wandb' -> its names (one ConfigError line if not)."""
  names = tuple(dict.fromkeys(x for x in str(spec).replace(' ', '').split(',') if x))
  valid = f'valid: jsonl plus any of {", ".join(LOGGERS[1:])}, comma-separated'
  for n in names:
    if n not in LOGGERS:
      raise ConfigError(f'train.loggers: {n!r} is unknown; {valid}')
  if 'jsonl' not in names:
    raise ConfigError(f'train.loggers={spec!r} leaves out jsonl: metrics.jsonl is the run\'s '
                      f'record that resume, the studies and eval.py read; {valid}')
  for n, module in (('tensorboard', 'tensorboardX'), ('wandb', 'wandb')):
    if n in names:
      try:
        __import__(module)
      except ImportError:
        raise ConfigError(f'train.loggers={spec!r} needs the {module} package, which is not '
                          f'installed; valid: pip install -r requirements.txt, or leave '
                          f'{n} out') from None
  return names


def check_wandb(settings: Any) -> None:
  if settings.mode not in WANDB_MODES:
    raise ConfigError(f'train.wandb.mode={settings.mode!r} is unknown; valid: '
                      f'{", ".join(repr(m) for m in WANDB_MODES)}')


class MetricsWriter:
  """Appends one JSON object per call to DIR/metrics.jsonl and mirrors the scalars to the other
  loggers of `loggers`."""

  def __init__(self, workdir: str, loggers: tuple[str, ...] = ('jsonl', 'tensorboard'),
               config: dict[str, Any] | None = None, wandb_settings: Any = None):
    self._enabled = jax.process_index() == 0
    self._tb = self._wandb = None
    if not self._enabled:
      return
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', buffering=1)
    if 'tensorboard' in loggers:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, 'tb'))
    if 'wandb' in loggers:
      self._wandb = _wandb_run(workdir, config or {}, wandb_settings)

  def write(self, step: int, **scalars: Any) -> None:
    if not self._enabled:
      return
    row = {'step': int(step), **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(row) + '\n')
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, float(v), step)
    if self._wandb is not None:
      self._wandb.log({k: float(v) for k, v in scalars.items()}, step=int(step))

  def close(self) -> None:
    if self._enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()
      if self._wandb is not None:
        self._wandb.finish()


def _wandb_run(workdir: str, config: dict[str, Any], settings: Any) -> Any:
  """The W&B run of `workdir`: a new one, or the one DIR/wandb_run_id names (a resume)."""
  import wandb
  path = os.path.join(workdir, RUN_ID_FILE)
  run_id = open(path).read().strip() if os.path.exists(path) else None
  s = settings
  try:
    run = wandb.init(project=(s.project if s else '') or 'sharenet',
                     entity=(s.entity if s else '') or None,
                     name=(s.name if s else '') or os.path.basename(os.path.abspath(workdir)),
                     mode=(s.mode if s else '') or None, id=run_id,
                     resume='allow' if run_id else None, dir=workdir, config=config)
  except Exception as e:
    if run_id and 'is in use' in str(e):
      raise RuntimeError(
          f'W&B run {run_id} (named by {path}) is still open in the W&B service this process '
          'shares (WANDB_SERVICE is set, and a killed run of this workdir left its stream '
          'there); run from a process without WANDB_SERVICE (train.py drops it) or end the '
          'process that started the service') from e
    raise
  if run_id is None:
    with open(path, 'w') as f:
      f.write(run.id + '\n')
  return run


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """All rows of DIR/metrics.jsonl."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]
