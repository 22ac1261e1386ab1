"""Up-front validation of a whole experiment config (before any compilation)."""
from __future__ import annotations

import json
from typing import Any

import jax

from sharenet import data, optim, parametrization
from sharenet.errors import ConfigError
from sharenet.models import ModelConfig

PARAMETRIZATIONS = parametrization.KINDS


def _positive(section: Any, prefix: str, *names: str) -> None:
  for n in names:
    if section[n] < 1:
      raise ConfigError(f'{prefix}.{n}={section[n]} must be >= 1')


def validate(config: Any, process_count: int | None = None) -> ModelConfig:
  """Checks model, train, data, mesh and parametrization fields; returns the ModelConfig."""
  mcfg = ModelConfig.from_config(config.model)
  t = config.train
  _positive(t, 'train', 'steps', 'batch_size', 'seq_len', 'grad_accum', 'eval_batch_size',
            'log_every', 'checkpoint_every', 'keep_checkpoints')
  if t.batch_size % t.grad_accum:
    raise ConfigError(f'train.grad_accum={t.grad_accum} must divide train.batch_size='
                      f'{t.batch_size}')
  optim.lr_schedule(t)  # raises for an unknown schedule
  if t.lr <= 0:
    raise ConfigError(f'train.lr={t.lr} must be > 0')
  if mcfg.position == 'learned' and t.seq_len > mcfg.max_len:
    raise ConfigError(f'train.seq_len={t.seq_len} exceeds model.max_len={mcfg.max_len} for '
                      f'learned positions')
  settings = parametrization.Settings.from_config(config.parametrization)  # kinds, rules
  parametrization.base_config(mcfg, settings)   # base sizes divide the model evenly
  validate_mesh(config.mesh)
  pc = jax.process_count() if process_count is None else process_count
  data.validate_data_config(config.data, t.seq_len, t.batch_size, pc, mcfg.vocab_size)
  data.validate_data_config(config.data, t.seq_len, t.eval_batch_size, pc, mcfg.vocab_size)
  return mcfg


def validate_mesh(mesh: Any) -> None:
  """Only data parallelism exists so far; fsdp / tensor land with the sharding issue."""
  if mesh.fsdp != 1 or mesh.tensor != 1:
    raise ConfigError(f'mesh.fsdp={mesh.fsdp}, mesh.tensor={mesh.tensor}: only data parallelism '
                      f'is implemented so far; valid: fsdp=1, tensor=1')
  n = jax.device_count()
  if mesh.data not in (-1, n):
    raise ConfigError(f'mesh.data={mesh.data} must be -1 or the device count {n}')


def to_json(config: Any) -> str:
  return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)
