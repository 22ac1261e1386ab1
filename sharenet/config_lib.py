"""Up-front validation of a whole experiment config (before any compilation)."""
from __future__ import annotations

import json
from typing import Any

import jax

from sharenet import data, optim, parametrization, sharding
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
  optim.decay_roles(t)
  if t.lr <= 0:
    raise ConfigError(f'train.lr={t.lr} must be > 0')
  if mcfg.position == 'learned' and t.seq_len > mcfg.max_len:
    raise ConfigError(f'train.seq_len={t.seq_len} exceeds model.max_len={mcfg.max_len} for '
                      f'learned positions')
  settings = parametrization.Settings.from_config(config.parametrization)  # kinds, rules
  parametrization.base_config(mcfg, settings)   # base sizes divide the model evenly
  validate_mesh(config)
  from sharenet.models import DecoderLM
  from sharenet.transforms import Transforms
  Transforms(config.transforms, DecoderLM(mcfg))  # raises for unknown / empty selections
  pc = jax.process_count() if process_count is None else process_count
  data.validate_data_config(config.data, t.seq_len, t.batch_size, pc, mcfg.vocab_size)
  data.validate_data_config(config.data, t.seq_len, t.eval_batch_size, pc, mcfg.vocab_size)
  return mcfg


def validate_mesh(config: Any) -> None:
  """Mesh sizes over this run's devices, logical rules, batch divisibility (sharenet.sharding)."""
  sharding.validate(config, jax.device_count())


def to_json(config: Any) -> str:
  return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)
