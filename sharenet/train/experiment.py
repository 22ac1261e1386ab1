"""The experiment config resolved once, at the top: typed sections, and the up-front validation
of the whole config before any compilation (each refused feature pair by its line of the
compatibility table).

`resolve(config)` validates and returns `Resolved`: ModelConfig (with the parametrization) and
the train, data, mesh and transforms sections (config/sections.py). The train loop calls it
once and hands the sections down; no module below reads the ConfigDict
(tests/train/test_experiment.py watches a training run for it).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax

from sharenet import data
from sharenet.data import corpus
from sharenet.config import compat, sections as sections_lib
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, param_table
from sharenet.models.config import table_view
from sharenet.models.scaling import Settings
from sharenet.optim import chain, ema, guard, matrix, scion
from sharenet.parametrization import optimizer_rules, rules
from sharenet.tasks import task_eval
from sharenet.train import (batch_ramp, dynamic_tying, metrics, profile, resume, sampled_depth,
                            sharding)
from sharenet.transforms import Transforms


@dataclasses.dataclass(frozen=True)
class Resolved:
  """An experiment config as the modules below the train loop read it."""
  model: ModelConfig                      # with its parametrization group (.parametrization)
  train: sections_lib.TrainConfig
  data: sections_lib.DataConfig
  mesh: sections_lib.MeshConfig
  transforms: sections_lib.TransformsConfig
  dry_run: bool = False
  record: dict[str, Any] | None = None    # the config as config.json stores it (a plain dict)


def sections(config: Any, mcfg: ModelConfig | None = None) -> Resolved:
  """The typed sections of `config` (a ConfigDict or dict), without the cross-section checks
  of `validate`; `mcfg`: its ModelConfig if already built."""
  raw = config.to_dict() if hasattr(config, 'to_dict') else dict(config)
  if mcfg is None:
    mcfg = ModelConfig.from_experiment(config)
  elif mcfg.parametrization != Settings.from_config(raw.get('parametrization', {})):
    raise ConfigError(f'the model config\'s parametrization (kind={mcfg.parametrization.kind}) '
                      f'is not the experiment\'s ({raw.get("parametrization")}); valid: '
                      f'ModelConfig.from_experiment(config)')
  typed = {name: sections_lib.read(cls, raw.get(name), name)
           for name, cls in sections_lib.SECTIONS.items()}
  return Resolved(model=mcfg, dry_run=bool(raw.get('dry_run', False)),
                  record=json.loads(json.dumps(raw, default=str)), **typed)


def resolve(config: Any, process_count: int | None = None) -> Resolved:
  """`config` validated (`validate`) and read into its typed sections, once."""
  return _validated(config, process_count)


def _positive(section: Any, prefix: str, *names: str) -> None:
  for n in names:
    if section[n] < 1:
      raise ConfigError(f'{prefix}.{n}={section[n]} must be >= 1')


def validate(config: Any, process_count: int | None = None) -> ModelConfig:
  """Checks model, train, data, mesh and parametrization fields; returns the ModelConfig.

  Pairs of features that do not combine are refused first, each by its line of the
  compatibility table (sharenet/config/compat.py)."""
  return _validated(config, process_count).model


def _validated(config: Any, process_count: int | None) -> Resolved:
  compat.check(table_view(config))
  mcfg = ModelConfig.from_experiment(config)   # raises for the model and parametrization
  run = sections(config, mcfg)
  t = run.train
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
  if matrix.optimizer_name(t) == 'scion':
    scion.check(t)
  chain.lr_groups(t, param_table(mcfg))   # train.lr_groups against the model's roles
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
  sharding.validate(run, jax.device_count())   # mesh sizes, rules, batch divisibility
  Transforms(run.transforms, DecoderLM(mcfg))  # raises for unknown / empty selections
  pc = jax.process_count() if process_count is None else process_count
  data.validate_data_config(run.data, t.seq_len, t.batch_size, pc, mcfg.vocab_size)
  data.validate_data_config(run.data, t.seq_len, t.eval_batch_size, pc, mcfg.vocab_size)
  metrics.parse_loggers(t.loggers)
  guard.check(t)
  batch_ramp.check(batch_ramp.parse(t.batch_ramp, t.batch_size, t.steps), run.data)
  ema.check(t)
  if t.watch and (mcfg.recurrent_segment is not None or not mcfg.scan_layers):
    raise ConfigError('train.watch names its rows by applied layer, which a model of sampled '
                      'recurrent depth (model.recurrence) does not fix and the Python-loop stack '
                      '(model.scan_layers=False) does not sow in order; valid: a scanned model '
                      'of fixed depth, or train.watch=False')
  profile.parse_steps(t.profile.steps, t.steps)
  dynamic_tying.check(t, mcfg)   # train.tying against the plan
  metrics.check_wandb(t.wandb)
  if t.eval_tasks or t.eval_task_dir or t.eval_task_limit or t.eval_num_fewshot != -1:
    if not t.eval_tasks:
      raise ConfigError('train.eval_task_dir, eval_num_fewshot and eval_task_limit apply to '
                        'train.eval_tasks; valid: set train.eval_tasks')
    task_eval.TrainTasks(t, DecoderLM(mcfg), corpus.for_data(run.data))   # checks only
  return run


def to_json(config: Any) -> str:
  return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)
