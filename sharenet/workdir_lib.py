"""Evaluates a workdir's checkpoint: the library side of eval.py."""
from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import jax
import ml_collections
import orbax.checkpoint as ocp

from sharenet import checkpoint, data, eval_lib, sharding, train_lib
from sharenet.errors import ConfigError
from sharenet.models import ModelConfig


def load_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise ConfigError(f'--workdir {workdir} has no config.json; pass the workdir of a train.py run')
  with open(path) as f:
    raw = json.load(f)
  keys = ('model', 'train', 'data', 'parametrization', 'mesh', 'transforms')
  return ml_collections.ConfigDict({k: raw[k] for k in keys if k in raw})


class Restored(NamedTuple):
  """A workdir's restored train state, its step and the experiment that trained it."""
  state: train_lib.TrainState
  step: int
  exp: train_lib.Experiment


def restore_state(config: ml_collections.ConfigDict, workdir: str,
                  step: int | None = None) -> Restored:
  """The latest (or `step`) checkpoint of `workdir` with the experiment `config` builds."""
  mcfg = ModelConfig.from_config(config.model)
  if 'parametrization' not in config:   # runs written before the parametrization group existed
    config.parametrization = {'kind': 'sp'}
  exp = train_lib.setup(config, mcfg)
  abstract = jax.eval_shape(
      lambda: train_lib.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz))
  # Restore onto this process's devices, whatever mesh (or hosts) wrote the checkpoint.
  abstract = sharding.with_shardings(abstract, sharding.replicated_like(abstract))
  mngr = checkpoint.manager(workdir, config.train.keep_checkpoints, async_save=False)
  steps = mngr.all_steps()
  if not steps:
    raise ConfigError(f'--workdir {workdir} holds no checkpoint')
  if step is not None and step not in steps:
    raise ConfigError(f'--step={step} not found; available: {sorted(steps)}')
  if step is None:
    restored = checkpoint.restore_latest(mngr, abstract)
    if restored is None:
      raise ConfigError(f'--workdir {workdir}: no readable checkpoint')
    state, step = restored
  else:
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    state = mngr.restore(step, args=args)['state']
  mngr.close()
  return Restored(state, int(step), exp)


def evaluate_workdir(workdir: str, step: int | None = None) -> dict[str, Any]:
  """Restores the latest (or `step`) checkpoint's params and evaluates the validation split."""
  config = load_config(workdir)
  state, step, (model, _, pz, tr) = restore_state(config, workdir, step)
  params = jax.jit(train_lib.effective_params, static_argnums=(1, 2))(state, tr, pz)
  out = eval_lib.evaluate(model, params, config.data, config.train.seq_len,
                          config.train.eval_batch_size)
  out = {'step': int(step), **out,
         'unigram_bits_per_byte': data.unigram_bits_per_byte(config.data)}
  with open(os.path.join(workdir, 'eval.json'), 'w') as f:
    json.dump(out, f, indent=2)
  return out
