"""The train loop never waits on the host to dispatch: loop.dispatch reads nothing from the
device, and step n's metrics are read after step n+1 is queued (or at once where the state is
used: checkpoint, eval, the last step); non-finite handling still names the exact step.

The loop under test is the real one (loop.train_and_evaluate); the tests wrap its two seams,
loop.dispatch and loop.read_step_metrics, to record the order of events and to run
every dispatch under a device-to-host guard.
"""
import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax._src import array as jax_array

from sharenet.train import loop
from sharenet.errors import NonFiniteLoss

STEPS, CKPT = 12, 5   # checkpoints at 5, 10 and 12 (the last step)


def _refuse(*_args, **_kwargs):
  raise RuntimeError('device-to-host transfer during dispatch')


@contextlib.contextmanager
def no_device_to_host():
  """Fails any device-to-host read inside the block.

  jax.transfer_guard_device_to_host('disallow') enforces it on GPU / TPU; on CPU, where device
  memory is host memory and the guard never fires, the Python-level conversions of jax.Array
  (float, int, bool, item, tolist, str, jax.device_get, copies to host) are made to raise too.
  (numpy's buffer protocol on a CPU array is a zero-copy view that neither sees.)
  """
  cls = jax_array.ArrayImpl
  names = ('__array__', 'item', 'tolist', 'tobytes', 'copy_to_host_async',
           '_single_device_array_to_np_array_did_copy')
  saved = {n: cls.__dict__[n] for n in names + ('_value',)}
  try:
    cls._value = property(_refuse)
    for n in names:
      setattr(cls, n, _refuse)
    with jax.transfer_guard_device_to_host('disallow'):
      yield
  finally:
    for n, v in saved.items():
      setattr(cls, n, v)


def test_the_guard_catches_a_host_read():
  x = jnp.arange(4.0) + 1.0
  with no_device_to_host():
    y = jax.jit(lambda a: a * 2)(x)          # dispatch alone is fine
    for read in (float, bool, lambda a: a.item(), jax.device_get, str):
      with pytest.raises(Exception, match='device-to-host'):
        read(y[0] if read in (float, bool) else y)
  assert float(y[1]) == 4.0                  # restored afterwards


def _record(monkeypatch, poison=None):
  """Wraps the loop's seams; returns the event list [('dispatch'|'read', step), ...].

  `poison(step, state) -> state` may replace the state entering the dispatch of `step`.
  """
  events = []
  dispatch, read = loop.dispatch, loop.read_step_metrics

  def guarded_dispatch(step_fn, state, *args, **kwargs):
    step = sum(kind == 'dispatch' for kind, _ in events) + 1
    if poison is not None:
      state = poison(step, state)
    with no_device_to_host():
      out = dispatch(step_fn, state, *args, **kwargs)
    events.append(('dispatch', step))
    return out

  def recorded_read(step, metrics, last_checkpoint, *args):
    events.append(('read', step))
    return read(step, metrics, last_checkpoint, *args)

  monkeypatch.setattr(loop, 'dispatch', guarded_dispatch)
  monkeypatch.setattr(loop, 'read_step_metrics', recorded_read)
  return events


def _config(tiny_config):
  return tiny_config(**{'train.steps': STEPS, 'train.checkpoint_every': CKPT,
                        'train.log_every': 1})


@pytest.mark.slow
def test_dispatch_reads_nothing_and_metrics_are_read_one_step_behind(monkeypatch, tmp_path,
                                                                    tiny_config):
  events = _record(monkeypatch)
  out = loop.train_and_evaluate(_config(tiny_config), str(tmp_path))
  assert np.isfinite(out['loss'])
  dispatched = [s for kind, s in events if kind == 'dispatch']
  reads = [s for kind, s in events if kind == 'read']
  assert dispatched == list(range(1, STEPS + 1))
  assert reads == list(range(1, STEPS + 1))        # every step checked once, in order
  synced = {s for s in range(1, STEPS + 1) if s % CKPT == 0 or s == STEPS}
  for i, (kind, step) in enumerate(events):
    if kind != 'read':
      continue
    queued = sum(k == 'dispatch' for k, _ in events[:i])
    # Step n is read once step n+1 is queued; only a step whose state is saved is read at once.
    assert queued == (step if step in synced else step + 1), (step, events)


def _saved_steps(workdir):
  return ocp.CheckpointManager(os.path.join(workdir, 'checkpoints')).all_steps()


def test_non_finite_loss_names_its_step_though_read_one_step_behind(monkeypatch, tmp_path,
                                                                    tiny_config):
  bad = 7   # the parameters entering step 7 are NaN: step 7's loss is the first non-finite one

  def poison(step, state):
    if step != bad:
      return state
    return state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))

  events = _record(monkeypatch, poison)
  with pytest.raises(NonFiniteLoss, match=rf'at step {bad};.*last checkpoint: {CKPT}\)'):
    loop.train_and_evaluate(_config(tiny_config), str(tmp_path))
  assert ('dispatch', bad + 1) in events            # it was read one step behind
  assert _saved_steps(str(tmp_path)) == [CKPT]      # nothing after the bad step was saved


def test_non_finite_parameters_are_never_checkpointed(monkeypatch, tmp_path, tiny_config):
  # A NaN optimizer state entering step 5 (a checkpoint step) gives a finite loss and gradient
  # norm at step 5 but NaN parameters after it: the save must refuse them.
  def poison(step, state):
    if step != CKPT:
      return state
    nan = lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x
    return state.replace(opt_state=jax.tree.map(nan, state.opt_state))

  _record(monkeypatch, poison)
  with pytest.raises(NonFiniteLoss, match=rf'non-finite parameters after step {CKPT}'):
    loop.train_and_evaluate(_config(tiny_config), str(tmp_path))
  assert _saved_steps(str(tmp_path)) == []


def test_the_guard_skips_non_finite_steps_then_stops_after_max_skips(monkeypatch, tmp_path,
                                                                     tiny_config):
  """train.skip_nonfinite: NaN parameters entering step 7 make steps 7, 8, ... non-finite; each
  is skipped (no error, nothing applied) until train.max_skips=3 in a row, which stops the run
  with one line naming step 9; the last checkpoint is the one before."""
  bad = 7

  def poison(step, state):
    if step != bad:
      return state
    return state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))

  _record(monkeypatch, poison)
  config = tiny_config(**{'train.steps': STEPS, 'train.checkpoint_every': CKPT,
                          'train.log_every': 1, 'train.skip_nonfinite': True,
                          'train.max_skips': 3})
  with pytest.raises(NonFiniteLoss, match=r'train.max_skips=3: 3 steps in a row skipped up to '
                                          rf'step {bad + 2} .*last checkpoint: {CKPT}\)') as e:
    loop.train_and_evaluate(config, str(tmp_path))
  assert '\n' not in str(e.value) and _saved_steps(str(tmp_path)) == [CKPT]
