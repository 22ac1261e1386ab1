"""A train.py workdir read and written: its config.json, its restored train state or one stored
parameter at a time, and a new workdir (a checkpoint with a fresh optimizer state, or none, and
its config.json) from variables in memory (convert.py) or streamed leaf by leaf
(interop/import_hf)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax.traverse_util import flatten_dict

from sharenet import data
from sharenet.checkpoint import config_file, orbax_io
from sharenet.config import defaults
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig
from sharenet.optim import chain, ema as ema_lib
from sharenet.train import dynamic_tying, experiment, resume, sharding, trainer
from sharenet.transforms import Transforms


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The workdir's config.json; keys added since it was written take the defaults. A run with
  dynamic tying (train.tying) trains the plan its newest checkpoint holds (`_plan_at`)."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise ConfigError(f'--workdir {workdir} has no config.json; pass the workdir of a train.py run')
  with open(path) as f:
    raw = json.load(f)
  keys = ('model', 'train', 'data', 'parametrization', 'mesh', 'transforms')
  config = defaults.complete({k: raw[k] for k in keys if k in raw})
  if dynamic_tying.enabled(config.train) and os.path.isdir(os.path.join(workdir, 'checkpoints')):
    mngr = orbax_io.manager(workdir, config.train.keep_checkpoints, async_save=False)
    try:
      steps = mngr.all_steps()
      config = _plan_at(config, mngr, max(steps)) if steps else config
    finally:
      mngr.close()
  return config


def _plan_at(config: ml_collections.ConfigDict, mngr: Any, step: int) -> ml_collections.ConfigDict:
  """`config` with the explicit plan checkpoint `step` holds, for a dynamic-tying run (the
  plan changes during training, sharenet/train/dynamic_tying.py); else `config`."""
  if not dynamic_tying.enabled(config.train):
    return config
  pattern = dynamic_tying.saved_pattern(orbax_io.saved_config(mngr, step))
  return config if pattern is None else dynamic_tying.with_pattern(config, pattern)


class Restored(NamedTuple):
  """A workdir's restored train state, its step and the experiment that trained it."""
  state: trainer.TrainState
  step: int
  exp: trainer.Experiment


def restore_state(config: ml_collections.ConfigDict, workdir: str,
                  step: int | None = None, ema: bool = False) -> Restored:
  """The parameters and transform state of the latest readable (or `step`) checkpoint of
  `workdir`, with the experiment `config` builds (`state.opt_state` is None: not needed).
  `ema`: the parameters are the run's average of its weights (train.ema, kept in the optimizer
  state, which is then read too; one ConfigError line for a run without one).

  Reads only; nothing in the workdir is moved or written. A checkpoint that does not fit
  `config` is one ConfigError line.
  """
  def experiment_of(config):
    run = experiment.sections(config)
    exp = trainer.setup(run)
    abstract = jax.eval_shape(
        lambda: trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz))
    # Restore onto this process's devices, whatever mesh (or hosts) wrote the checkpoint.
    abstract = sharding.with_shardings(abstract, sharding.replicated_like(abstract))
    parts = {'step': abstract.step, 'params': abstract.params, 'tstate': abstract.tstate}
    if ema:
      ema_lib.kept(abstract.opt_state)   # the run keeps one, or one line
      parts['opt_state'] = abstract.opt_state
    return run, exp, parts

  run, exp, parts = experiment_of(config)
  mngr = orbax_io.manager(workdir, run.train.keep_checkpoints, async_save=False)
  try:
    steps = sorted(mngr.all_steps(), reverse=True)
    if not steps:
      raise ConfigError(f'--workdir {workdir} holds no checkpoint')
    if step is not None and step not in steps:
      raise ConfigError(f'--step={step} not found; available: {sorted(steps)}')
    for s in [step] if step is not None else steps:
      at = _plan_at(config, mngr, s)   # dynamic tying: each checkpoint holds its own plan
      if at is not config:
        run, exp, parts = experiment_of(at)
      try:
        out, _ = orbax_io.restore_parts(mngr, s, parts)
      except orbax_io.StateMismatch as e:
        raise ConfigError(f'--workdir {workdir}: {e}: it was written by another config; valid: '
                          f'the workdir\'s own config.json, overriding only fields that keep '
                          f'the parameter tree') from None
      except Exception as e:  # noqa: BLE001 - unreadable: report it, try an older one
        if step is not None:
          raise ConfigError(f'--workdir {workdir}: checkpoint {s} is unreadable '
                            f'({type(e).__name__}); available: {sorted(steps)}') from None
        print(f'WARNING: checkpoint {s} is unreadable ({type(e).__name__}); trying an older '
              f'one', flush=True)
        continue
      params = out['params'] if not ema else ema_lib.averaged(out['opt_state'], out['params'])
      state = trainer.TrainState(out['step'], params, None, out['tstate'])
      return Restored(state, int(s), exp)
    raise ConfigError(f'--workdir {workdir}: no readable checkpoint')
  finally:
    mngr.close()


def param_reader(config: ml_collections.ConfigDict, workdir: str
                 ) -> tuple[int, dict[tuple, Any], Callable[[tuple], np.ndarray]]:
  """(step, {params path: ShapeDtypeStruct}, read) for `workdir`'s latest checkpoint:
  read(path) restores that one stored parameter as a host array (orbax_io.restore_leaf), so
  a caller holds one tensor at a time. The checkpoint's parameter tree must be the config's
  (else one ConfigError line, as restore_state)."""
  keep = config.train.keep_checkpoints
  mngr = orbax_io.manager(workdir, keep, async_save=False)
  try:
    steps = sorted(mngr.all_steps())
    if not steps:
      raise ConfigError(f'--workdir {workdir} holds no checkpoint')
    step = steps[-1]
    run = experiment.sections(_plan_at(config, mngr, step))
    exp = trainer.setup(run)
    abstract = trainer.abstract_state(exp.model, exp.tx, exp.tr, exp.pz).params['params']
    shapes = dict(flatten_dict(abstract))
    saved = {k: v for k, v in orbax_io.saved_signatures(mngr, step).items()
             if k.startswith('params/params/')}
    want = {'params/params/' + k: v for k, v in orbax_io.leaf_signatures(abstract).items()}
    diff = orbax_io.first_difference(saved, want)
    if diff is not None:
      raise ConfigError(f'--workdir {workdir}: checkpoint {step}: {diff}: it was written by '
                        f'another config; valid: the workdir\'s own config.json')
  finally:
    mngr.close()

  def read(path: tuple) -> np.ndarray:
    m = orbax_io.manager(workdir, keep, async_save=False)
    try:
      return orbax_io.restore_leaf(m, step, 'params', ('params',) + tuple(path), shapes[path])
    finally:
      m.close()
  return step, shapes, read


def save_workdir(out: str, raw: dict[str, Any], cfg: ModelConfig, variables: Any, step: int,
                 extra: dict[str, Any], optimizer_state: bool = True) -> None:
  """Writes `out` as a train.py workdir of config `raw` (a dict; its model section `cfg`'s)
  holding `variables` at `step`: a checkpoint with a fresh optimizer state and data iterator
  (train.py continues it), and config.json with `extra` added (convert.py, interop/import_hf).

  `optimizer_state=False` saves none (the checkpoint is then the parameters' size, not three
  times it): `raw` must have train.restore=params, so train.py makes a fresh one on resuming.
  """
  run = experiment.sections(raw, cfg)
  if not optimizer_state and run.train.restore != 'params':
    raise ValueError('a checkpoint without optimizer state needs train.restore=params')
  os.makedirs(out, exist_ok=True)
  exp = trainer.setup(run)   # the optimizer train.py builds (its parametrization's multipliers)
  new_tr, tx = exp.tr, exp.tx
  params, tstate = new_tr.init(variables)
  # A fresh optimizer state whose LR schedule continues at the source's step.
  opt_state = chain.at_step(tx.init(params), step) if optimizer_state else None
  new_state = trainer.TrainState(jnp.asarray(step, jnp.int32), params, opt_state, tstate)
  t = run.train
  it = None
  if run.data.source != 'bin' or run.data.path:
    it = data.make_train_iterator(run.data, t.seq_len, t.batch_size, t.seed, 0, 1)
  mngr = orbax_io.manager(out, t.keep_checkpoints, async_save=False)
  saved_config, summary = _workdir_configs(raw, extra, params)
  orbax_io.save(mngr, step, new_state, it, saved_config)
  mngr.wait_until_finished()
  mngr.close()
  config_file.write(out, summary)


def _workdir_configs(raw: dict[str, Any], extra: dict[str, Any],
                     params: Any) -> tuple[dict[str, Any], dict[str, Any]]:
  """(the checkpoint's config item, config.json's contents) of a workdir of config `raw` (a
  dict) holding `params` (arrays or ShapeDtypeStructs)."""
  shapes = resume.param_shapes(params)
  return ({**resume.config_dict(raw), 'param_shapes': shapes},
          {**raw, **extra, 'param_shapes': shapes})


def save_workdir_streamed(out: str, raw: dict[str, Any], cfg: ModelConfig, abstract: Any,
                          leaves: Iterable[tuple[tuple[str, ...], Any]], step: int,
                          extra: dict[str, Any]) -> None:
  """save_workdir(out, raw, cfg, variables, step, extra, optimizer_state=False), the
  variables given leaf by leaf: `abstract` is their tree of ShapeDtypeStructs and `leaves`
  yields (path in it, jax.Array or np.ndarray), every leaf once, in any order. The
  checkpoint is written by orbax_io.save_streamed, so the host holds one leaf (and orbax's
  buffers for it) at a time; the saved state and both configs are save_workdir's.

  Needs train.restore=params (no optimizer state), no data named (no iterator position to
  save) and transforms whose init leaves the variables as they are (no reparam, no nGPT
  projection); ValueError otherwise, and for a leaf that is not in `abstract` (path, shape
  or dtype), repeated or missing, which leaves no checkpoint step behind.
  """
  run = experiment.sections(raw, cfg)
  if run.train.restore != 'params':
    raise ValueError('a checkpoint without optimizer state needs train.restore=params')
  if run.data.source != 'bin' or run.data.path:
    raise ValueError('a streamed workdir saves no data iterator; this config names data')
  new_tr = Transforms(run.transforms, DecoderLM(cfg))
  if not new_tr.init_is_identity:
    raise ValueError('a streamed workdir needs transforms whose init keeps the variables '
                     '(no transforms.reparam, no transforms.project=ngpt)')
  params, tstate = jax.eval_shape(new_tr.init, abstract)   # tstate: {} (no leaves)
  skeleton = trainer.TrainState(jnp.asarray(step, jnp.int32), None, None, tstate)
  skeleton = {f.name: getattr(skeleton, f.name) for f in dataclasses.fields(skeleton)
              if f.name != 'params'}
  want = {p: (tuple(x.shape), np.dtype(x.dtype)) for p, x in flatten_dict(params).items()}

  def checked() -> Iterator[tuple[tuple[str, ...], Any]]:
    for path, value in leaves:
      path = tuple(path)
      got = (tuple(value.shape), np.dtype(value.dtype))
      if want.pop(path, None) != got:
        raise ValueError(f'leaf {"/".join(path)} {got[0]} {got[1]} is not one of the '
                         f'variables\' leaves (or is repeated)')
      yield ('params',) + path, value
      del value   # the caller has saved it: not held while the next leaf is produced
    if want:
      raise ValueError(f'{len(want)} leaves were not given, e.g. {"/".join(next(iter(want)))}')

  saved_config, summary = _workdir_configs(raw, extra, params)
  os.makedirs(out, exist_ok=True)
  orbax_io.save_streamed(out, step, checked(), skeleton, saved_config)
  config_file.write(out, summary)
