"""Resuming a workdir: what may change (its config.json against the resolved config) and
`restore_or_init`, which the train loop calls to resume or start fresh.

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

import jax
import optax
from flax.traverse_util import flatten_dict

from sharenet.checkpoint import orbax_io
from sharenet.config import migrations
from sharenet.optim import chain
from sharenet.errors import ConfigError
from sharenet.train.metrics import note
from sharenet.models import TRAINABLE

RESTORE_MODES = ('auto', 'params')
# Cannot change the saved state or the data stream.
STATE_FREE = ('train.steps', 'train.log_every', 'train.eval_every', 'train.eval_batch_size',
              'train.checkpoint_every', 'train.keep_checkpoints', 'train.progress',
              'train.loggers', 'train.wandb.', 'train.watch', 'train.profile.', 'train.restore', 'train.grad_accum', 'model.remat', 'model.scan_unroll',
              'model.scan_lowering', 'model.scan_split_transpose', 'model.kernels',
              'model.attention', 'model.dtype', 'data.tokenizer', 'data.eval_tokens', 'dry_run',
              'mesh.')
# model.dtype is the compute dtype only: parameters and optimizer state are model.param_dtype
# (float32) either way, so a float32 checkpoint resumes under bfloat16 and back.
# Change which windows the train iterator yields from its saved position, or (num_workers) the
# shape of its saved state.
DATA_STREAM = ('data.source', 'data.path', 'data.bin_dtype', 'data.seed', 'data.num_workers',
               'data.segment_mask', 'train.seed',
               'train.batch_size', 'train.seq_len', 'train.batch_ramp')
# Sections of config.json that are the config (the rest is derived: shapes, counts, tables).
SECTIONS = ('model', 'train', 'data', 'transforms', 'parametrization', 'mesh', 'dry_run')



def param_shapes(tree: Any) -> dict[str, list[int]]:
  """{'/'-joined path: shape} of a parameter tree: the checkpoint record's `param_shapes`."""
  return {'/'.join(k): list(v.shape) for k, v in flatten_dict(tree).items()}

def _flat(tree: Any, prefix: str = '') -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, f'{prefix}.{k}' if prefix else str(k)))
  return out


def config_dict(config: Any) -> dict[str, Any]:
  """The sections of a config (train/experiment.py's `Resolved.record`, a config.json's dict,
  or a ConfigDict) as config.json stores them (tuples as lists, JSON scalars)."""
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
    old = _flat(config_dict(migrations.renamed(prior))) if prior else {}
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


def check_same_model(workdir: str, prior: dict[str, Any] | None, shapes: dict[str, list[int]],
                     changes: Changes) -> None:
  """A workdir holding another model's run fails with one line, not a shape traceback.

  Only the model's own collections count: transform gains may come and go (see train.restore).
  """
  model_only = lambda d: {k: v for k, v in d.items() if k.split('/')[0] in TRAINABLE}
  old_shapes = model_only((prior or {}).get('param_shapes', {}))
  shapes = model_only(shapes)
  if old_shapes and old_shapes != shapes:
    diff = changes.describe({k: v for k, v in changes.fields.items() if k.startswith('model.')})
    first = next(k for k in sorted(set(old_shapes) | set(shapes))
                 if old_shapes.get(k) != shapes.get(k))
    raise ConfigError(
        f'--workdir {workdir} holds a run of a different model ({diff or "shapes"}; first '
        f'differing param {first}: {old_shapes.get(first)} vs {shapes.get(first)}); valid: a '
        f'new --workdir or the old config')


def _check_finite_state(state: Any) -> None:
  if not orbax_io.params_finite(state.params):
    raise ValueError('non-finite parameters')


def restore_or_init(run: Any, workdir: str, mngr: Any, target: Any, train_iter: Any,
                    init: Any, tx: optax.GradientTransformation,
                    shapes: dict[str, list[int]], target_at: Any = None) -> tuple[Any, int]:
  """(state, first step): the workdir's newest readable checkpoint, or a fresh `init()`.

  Never moves or rewrites a readable checkpoint. The config saved with the newest checkpoint
  (else DIR/config.json) is compared with this run's (`run`: train/experiment.py's resolved
  sections and the config they were read from, `run.record`; `Changes`): a change that makes the
  checkpoint unrestorable is a ConfigError naming the changed fields, unless train.restore=params
  asks for its parameters with a fresh optimizer state. `target_at(step)`, if given, is the
  target of checkpoint `step` (dynamic tying: each checkpoint holds its own plan's state).
  """
  steps = mngr.all_steps()
  if not steps:
    return init(), 0
  t = run.train
  prior = orbax_io.saved_config(mngr, max(steps)) or read_prior(workdir)
  changes = Changes(prior, run.record)
  check_same_model(workdir, prior, shapes, changes)
  if changes:
    note(f'note: resuming with changed fields: {changes.describe(changes.fields)}'
         + ('' if changes.stateful else ' (none changes the train state)'))
  params_only = t.restore == 'params' and bool(changes.stateful)
  data_changed = changes.data_stream
  if data_changed and not params_only:
    raise ConfigError(f'--workdir {workdir}: the data stream changed '
                      f'({changes.describe(data_changed)}), so its checkpoint cannot resume '
                      f'exactly; valid: {WAYS_OUT}')
  data_iter = None if data_changed else train_iter
  try:
    restored = orbax_io.restore_latest(mngr, target_at or target, data_iter,
                                       _check_finite_state)
  except orbax_io.StateMismatch as e:
    if t.restore != 'params':
      what = changes.describe(changes.stateful) or 'no recorded config field changed'
      raise ConfigError(f'--workdir {workdir}: checkpoint {e.step} was written by another config '
                        f'({what}; {e.detail}); valid: {WAYS_OUT}') from None
    return _restore_params(mngr, e.step, target, data_iter, init, tx, workdir), e.step
  if restored is None:
    note('WARNING: no readable checkpoint is left (each was moved to corrupt_checkpoints/); '
         'starting from step 0')
    return init(), 0
  state, step = restored
  if params_only:   # the state still fits, but the config changed: keep only the parameters
    state = state.replace(opt_state=_fresh_opt_state(tx, state.params, step, target))
    note(f'train.restore=params: loaded the parameters of checkpoint {step}, its transform '
         f'state{"" if data_changed else " and data position"}; the optimizer state is fresh '
         f'(its LR schedule continues at step {step})')
    return state, step
  # The peak LR lives in the optimizer state: a changed train.lr takes effect from here.
  opt_state = chain.with_peak_lr(state.opt_state, t.lr)
  state = state.replace(opt_state=jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                                               opt_state, state.opt_state))
  note(f'resumed from checkpoint at step {step}'
       + ('; train.restore=params starts a fresh optimizer state only when a field that changes '
          'the train state changed, and none did: the whole state is resumed'
          if t.restore == 'params' else ''))
  return state, step


def _fresh_opt_state(tx: optax.GradientTransformation, params: Any, step: int,
                     target: Any) -> Any:
  """A fresh optimizer state for `params` whose LR schedule continues at `step`."""
  shardings = jax.tree.map(lambda x: x.sharding, target.opt_state)
  return jax.jit(lambda p: chain.at_step(tx.init(p), step), out_shardings=shardings)(params)


def _restore_params(mngr: Any, step: int, target: Any, data_iter: Any, init: Any,
                    tx: optax.GradientTransformation, workdir: str) -> Any:
  """train.restore=params: checkpoint `step`'s parameters (and transform state and data
  position where they still fit) in a fresh state with a fresh optimizer state."""
  parts = {'step': target.step, 'params': target.params}
  kept = []
  try:
    try:
      out, data_ok = orbax_io.restore_parts(mngr, step, {**parts, 'tstate': target.tstate},
                                              data_iter)
      if jax.tree.leaves(target.tstate):
        kept.append('transform state')
    except orbax_io.StateMismatch:
      out, data_ok = orbax_io.restore_parts(mngr, step, parts, data_iter)
  except orbax_io.StateMismatch as e:
    raise ConfigError(f'--workdir {workdir}: train.restore=params: the parameters of checkpoint '
                      f'{step} do not fit this config ({e.detail}); valid: the old config or a '
                      f'new --workdir') from None
  # A transform state that no longer fits starts as a fresh init's (power-iteration vectors).
  tstate = out['tstate'] if 'tstate' in out else init().tstate
  state = target.replace(step=out['step'], params=out['params'], tstate=tstate,
                         opt_state=_fresh_opt_state(tx, out['params'], step, target))
  try:
    _check_finite_state(state)
  except ValueError:
    raise ConfigError(f'--workdir {workdir}: checkpoint {step} holds non-finite parameters; '
                      f'valid: an earlier checkpoint (move this one aside) or a new '
                      f'--workdir') from None
  if data_ok:
    kept.append('data position')
  note(f'train.restore=params: loaded the parameters of checkpoint {step}'
       + ''.join(f', its {k}' for k in kept) + '; the optimizer state is fresh (its LR '
       f'schedule continues at step {step})'
       + ('' if data_ok else '; the data stream starts anew'))
  return state
