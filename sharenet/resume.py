"""What a resume may change: the workdir's config.json against the resolved config.

Fields that cannot change the train state (run length, logging / eval / checkpoint cadence, the
progress bar, the mesh: a checkpoint reshards onto any mesh) are a one-line note. Fields that
change the data stream cannot resume it exactly. Any other change resumes when the saved state
still fits the new config's state tree; when it does not, the run stops with one line naming
the changed fields and the ways out (the old config, a new --workdir, or
--config.train.restore=params).
"""
from __future__ import annotations

import json
import os
from typing import Any

from sharenet import defaults
from sharenet.errors import ConfigError

RESTORE_MODES = ('auto', 'params')
# Cannot change the saved state or the data stream.
STATE_FREE = ('train.steps', 'train.log_every', 'train.eval_every', 'train.eval_batch_size',
              'train.checkpoint_every', 'train.keep_checkpoints', 'train.progress',
              'train.restore', 'train.grad_accum', 'model.remat', 'model.scan_unroll',
              'model.scan_lowering', 'model.scan_split_transpose', 'model.kernels',
              'model.attention', 'model.dtype', 'data.tokenizer', 'dry_run', 'mesh.')
# model.dtype is the compute dtype only: parameters and optimizer state are model.param_dtype
# (float32) either way, so a float32 checkpoint resumes under bfloat16 and back.
# Change which windows the train iterator yields from its saved position, or (num_workers) the
# shape of its saved state.
DATA_STREAM = ('data.source', 'data.path', 'data.bin_dtype', 'data.seed', 'data.num_workers',
               'data.segment_mask', 'train.seed',
               'train.batch_size', 'train.seq_len')
# Sections of config.json that are the config (the rest is derived: shapes, counts, tables).
SECTIONS = ('model', 'train', 'data', 'transforms', 'parametrization', 'mesh', 'dry_run')


def _flat(tree: Any, prefix: str = '') -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, f'{prefix}.{k}' if prefix else str(k)))
  return out


def config_dict(config: Any) -> dict[str, Any]:
  """The resolved config as config.json stores it (tuples as lists, JSON scalars)."""
  d = config.to_dict() if hasattr(config, 'to_dict') else dict(config)
  return json.loads(json.dumps({k: d[k] for k in SECTIONS if k in d}, default=str))


def read_prior(workdir: str) -> dict[str, Any] | None:
  """The config a previous run in `workdir` recorded, or None."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f'{path} is not valid JSON ({e}); valid: restore it, or delete it to '
                      f'resume by the checkpoints\' own configs') from None


def _matches(key: str, names: tuple[str, ...]) -> bool:
  return any(key == n or (n.endswith('.') and key.startswith(n)) for n in names)


class Changes:
  """Fields that differ between a workdir's recorded config and this run's config."""

  def __init__(self, prior: dict[str, Any] | None, config: Any):
    old = _flat(config_dict(defaults.renamed(prior))) if prior else {}
    new = _flat(config_dict(config))
    # A field the old run did not record (an older sharenet) is not reported as a change.
    self.fields = {k: (old[k], new[k]) for k in sorted(new) if k in old and old[k] != new[k]}

  def __bool__(self) -> bool:
    return bool(self.fields)

  def _select(self, pred) -> dict[str, tuple[Any, Any]]:
    return {k: v for k, v in self.fields.items() if pred(k)}

  @property
  def state_free(self) -> dict[str, tuple[Any, Any]]:
    return self._select(lambda k: _matches(k, STATE_FREE))

  @property
  def data_stream(self) -> dict[str, tuple[Any, Any]]:
    return self._select(lambda k: _matches(k, DATA_STREAM))

  @property
  def stateful(self) -> dict[str, tuple[Any, Any]]:
    """Changes that may change the train state (everything not state-free)."""
    return self._select(lambda k: not _matches(k, STATE_FREE))

  @staticmethod
  def describe(fields: dict[str, tuple[Any, Any]]) -> str:
    return ', '.join(f'{k} {_short(a)} -> {_short(b)}' for k, (a, b) in fields.items())


def _short(v: Any) -> str:
  s = json.dumps(v) if not isinstance(v, str) else repr(v)
  return s if len(s) <= 40 else s[:37] + '...'


WAYS_OUT = ('rerun with the old config, use a new --workdir, or add '
            '--config.train.restore=params to load the parameters with a fresh optimizer state')
