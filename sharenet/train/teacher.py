"""train.teacher: the frozen model a run distills from, checked, restored and sharded.

`train.teacher.workdir=DIR` names any workdir whose model reads the student's tokens: a trained
run, an import (sharenet/interop/import_hf.py), the untied source of a conversion. Its latest
checkpoint's applied variables (transforms and parametrization multipliers resolved once) are
restored, laid out on the student's mesh by the teacher's own logical axes under the run's rules
(what they do not name is replicated), and passed to every step, which runs the teacher's forward
inside the same jitted program (sharenet/train/distill.py: the loss). The step's MFU counts the
teacher's forward FLOPs; a dry run compiles the step with the teacher's variables as arguments,
so its memory report holds them.

Checked before anything is written, one ConfigError line each: a workdir without a checkpoint,
another vocabulary or tokenizer than the student's, temperature <= 0, a weight outside (0, 1],
and the students whose loss is not the plain next-token one (recurrent depth and trained exits,
u-muP's unit-scaled cross entropy: not built with a teacher). Hidden-state matching
(train.teacher.match) also needs streams of one width (d_model) and models whose applied layers
have an untied view (sharenet/models/streams.py check), and each pair's layers in range.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from sharenet.data import corpus, tokenizer
from sharenet.errors import ConfigError
from sharenet.models import ModelConfig, accounting, logical_axes, streams
from sharenet.train import distill, experiment, sampled_depth, sharding, trainer, workdir_io


class Loaded(NamedTuple):
  distill: distill.Distill   # static: the teacher's model, temperature, weight
  variables: Any             # its applied variables, placed on the student's mesh
  shardings: Any
  forward_flops: float       # the teacher's forward FLOPs per token at the run's seq_len


def _identity(data_cfg: Any) -> str | None:
  spec, base = corpus.data_spec(data_cfg)
  return None if spec is None else tokenizer.identity(spec, 'data.tokenizer', base_dir=base)


def check(run: experiment.Resolved) -> ModelConfig | None:
  """The teacher's ModelConfig, after the checks of the module doc (None without a teacher)."""
  te = run.train.teacher
  if not te.workdir:
    return None
  if te.temperature <= 0:
    raise ConfigError(f'train.teacher.temperature={te.temperature}; valid: > 0')
  if not 0 < te.weight <= 1:
    raise ConfigError(f'train.teacher.weight={te.weight}; valid: 0 < weight <= 1 (1: '
                      f'distillation only; without a teacher, leave train.teacher.workdir empty)')
  mcfg = run.model
  if mcfg.recurrent_segment is not None or sampled_depth.step_loops(run.train, mcfg).exits:
    raise ConfigError('train.teacher with model.recurrence or train.exit_loss: distillation '
                      'of a sampled-depth or multi-exit loss is not built; valid: a student '
                      'trained at its plan\'s depth with train.exit_loss=last')
  if run.model.parametrization.kind == 'umup':
    raise ConfigError('train.teacher with parametrization.kind=umup: u-muP\'s unit-scaled cross '
                      'entropy has no distillation counterpart here; valid: sp, mup, completep')
  config = workdir_io.load_config(te.workdir)
  tcfg = ModelConfig.from_experiment(config)
  if tcfg.vocab_size != mcfg.vocab_size:
    raise ConfigError(f'train.teacher.workdir={te.workdir!r} has vocab_size={tcfg.vocab_size}, '
                      f'the student {mcfg.vocab_size}; valid: a teacher of the student\'s '
                      f'vocabulary')
  mine, theirs = _identity(run.data), _identity(experiment.sections(config).data)
  if mine is not None and theirs is not None and mine != theirs:
    raise ConfigError(f'train.teacher.workdir={te.workdir!r} reads another tokenizer '
                      f'({theirs}) than the student ({mine}); valid: a teacher of the '
                      f'student\'s tokenizer')
  if te.match:
    distill.parse_match(te.match, mcfg.num_layers, tcfg.num_layers)
    if te.match_weight <= 0:
      raise ConfigError(f'train.teacher.match_weight={te.match_weight}; valid: > 0')
    if tcfg.d_model != mcfg.d_model:
      raise ConfigError(f'train.teacher.match={te.match!r} compares streams of d_model '
                        f'{mcfg.d_model} (student) and {tcfg.d_model} (teacher); valid: a '
                        f'teacher of the student\'s width, or train.teacher.match=\'\'')
    streams.check(mcfg, 'train.teacher.match (the student)')
    streams.check(tcfg, 'train.teacher.match (the teacher)')
  return tcfg


def load(run: experiment.Resolved, mesh: Any, rules: Any) -> Loaded | None:
  """The run's teacher restored onto `mesh` (None without one)."""
  if check(run) is None:
    return None
  te = run.train.teacher
  restored = workdir_io.restore_state(workdir_io.load_config(te.workdir), te.workdir)
  model, _, pz, tr = restored.exp
  variables = jax.jit(trainer.effective_params, static_argnums=(1, 2))(restored.state, tr, pz)
  specs = dict(sharding.param_specs(logical_axes(model), {k: variables[k] for k in
                                                          logical_axes(model)}, mesh, rules))
  shardings = {k: (jax.tree.map(lambda s: NamedSharding(mesh, s), specs[k],
                                is_leaf=lambda x: isinstance(x, P)) if k in specs else
                   jax.tree.map(lambda _: NamedSharding(mesh, P()), v))
               for k, v in variables.items()}
  variables = jax.device_put(variables, shardings)
  flops = accounting.flops_per_token(model.cfg, run.train.seq_len, train=False)
  match = distill.parse_match(te.match, run.model.num_layers, model.cfg.num_layers) if (
      te.match) else ()
  return Loaded(distill.Distill(model, float(te.temperature), float(te.weight), match,
                                float(te.match_weight), bool(te.match_norm)),
                variables, shardings, flops)
