"""Up-front validation of a whole experiment config, before any compilation: every section
checked, each refused feature pair by its line of the compatibility table."""
from __future__ import annotations

import json
from typing import Any

import jax

from sharenet.config import compat
from sharenet import data
from sharenet.optim import chain, matrix
from sharenet.parametrization import rules, optimizer_rules
from sharenet.train import sampled_depth, resume, sharding
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig
from sharenet.transforms import Transforms


def _positive(section: Any, prefix: str, *names: str) -> None:
  for n in names:
    if section[n] < 1:
      raise ConfigError(f'{prefix}.{n}={section[n]} must be >= 1')


def validate(config: Any, process_count: int | None = None) -> ModelConfig:
  """Checks model, train, data, mesh and parametrization fields; returns the ModelConfig.

  Pairs of features that do not combine are refused first, each by its line of the
  compatibility table (sharenet/config/compat.py)."""
  compat.check(config)
  mcfg = ModelConfig.from_experiment(config)   # raises for the model and parametrization
  t = config.train
  _positive(t, 'train', 'steps', 'batch_size', 'seq_len', 'grad_accum', 'eval_batch_size',
            'log_every', 'checkpoint_every', 'keep_checkpoints')
  if t.batch_size % t.grad_accum:
    raise ConfigError(f'train.grad_accum={t.grad_accum} must divide train.batch_size='
                      f'{t.batch_size}')
  if t.restore not in resume.RESTORE_MODES:
    raise ConfigError(f'train.restore={t.restore!r} is unknown; valid: '
                      f'{", ".join(resume.RESTORE_MODES)}')
  chain.lr_schedule(t)  # raises for an unknown schedule
  chain.decay_roles(t)
  matrix.check_settings(t)   # train.optimizer, matrix_roles, shampoo settings
  optimizer_rules.check(mcfg.parametrization.kind, optimizer_rules.settings_of(t))
  sampled_depth.exit_weights(t.exit_loss, mcfg)   # train.exit_loss against the plan's loops
  if t.lr <= 0:
    raise ConfigError(f'train.lr={t.lr} must be > 0')
  if mcfg.attention_window and t.seq_len > mcfg.attention_window:
    raise ConfigError(f'train.seq_len={t.seq_len} exceeds model.attention_window='
                      f'{mcfg.attention_window}: sliding-window attention is modelled only '
                      f'within its window; valid: train.seq_len <= {mcfg.attention_window}')
  if mcfg.position == 'learned' and t.seq_len > mcfg.max_len:
    raise ConfigError(f'train.seq_len={t.seq_len} exceeds model.max_len={mcfg.max_len} for '
                      f'learned positions')
  rules.base_config(mcfg)   # base sizes divide the model evenly
  validate_mesh(config)
  Transforms(config.transforms, DecoderLM(mcfg))  # raises for unknown / empty selections
  pc = jax.process_count() if process_count is None else process_count
  data.validate_data_config(config.data, t.seq_len, t.batch_size, pc, mcfg.vocab_size)
  data.validate_data_config(config.data, t.seq_len, t.eval_batch_size, pc, mcfg.vocab_size)
  return mcfg


def validate_mesh(config: Any) -> None:
  """Mesh sizes over this run's devices, logical rules, batch divisibility (sharenet.train.sharding)."""
  sharding.validate(config, jax.device_count())


def to_json(config: Any) -> str:
  return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)
