"""sharenet.checkpoint.orbax_io: round trip with the grain iterator, fall-back on corruption."""
import glob
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sharenet.checkpoint import orbax_io
from sharenet import data


def _state(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {'params': {'w': jax.random.normal(k1, (32, 32)), 'b': jax.random.normal(k2, (32,))},
          'step': jnp.asarray(seed, jnp.int32)}


def _abstract():
  return jax.eval_shape(lambda: _state(0))


def _equal(a, b):
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _saved(workdir, steps, keep=3):
  """A manager holding one checkpoint per step (state `_state(step)`)."""
  mngr = orbax_io.manager(workdir, keep=keep, async_save=False)
  for step in steps:
    orbax_io.save(mngr, step, _state(step), None)
  mngr.wait_until_finished()
  return mngr


def _corrupt(workdir, step, how):
  """Truncates or deletes the largest file of the saved state (its array data)."""
  pattern = os.path.join(workdir, 'checkpoints', str(step), 'state', '**', '*')
  target = max((f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)),
               key=os.path.getsize)
  if how == 'truncate':
    with open(target, 'r+b') as f:
      f.truncate(os.path.getsize(target) // 3)
  else:
    os.remove(target)


def test_save_and_restore_round_trip_with_the_data_iterator(tmp_path):
  """The grain iterator's state round-trips through sharenet.checkpoint.orbax_io."""
  corpus = tmp_path / 'corpus.txt'
  corpus.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 40_000, np.uint8)))
  cfg = ml_collections.ConfigDict({'source': 'text', 'path': str(corpus), 'num_workers': 0})
  it = data.make_train_iterator(cfg, 32, 4, seed=5)
  for _ in range(3):
    next(it)
  workdir = str(tmp_path / 'run')
  mngr = orbax_io.manager(workdir, keep=3)   # async, as in training
  orbax_io.save(mngr, 3, _state(3), it)
  mngr.wait_until_finished()
  expected = [next(it) for _ in range(3)]
  fresh = data.make_train_iterator(cfg, 32, 4, seed=5)
  restored = orbax_io.restore_latest(orbax_io.manager(workdir, keep=3), _abstract(), fresh)
  assert restored is not None
  state, step = restored
  assert step == 3 and _equal(state, _state(3))
  got = [next(fresh) for _ in range(3)]
  assert all(np.array_equal(a, b) for a, b in zip(got, expected))
  # Not vacuous: a fresh iterator starts elsewhere.
  assert not np.array_equal(next(data.make_train_iterator(cfg, 32, 4, seed=5)), expected[0])


def test_restore_latest_picks_the_newest_step_and_keep_prunes(tmp_path):
  mngr = _saved(str(tmp_path), [1, 2, 3, 4], keep=2)
  assert mngr.all_steps() == [3, 4]
  assert os.path.isdir(tmp_path / 'checkpoints' / '4')
  state, step = orbax_io.restore_latest(mngr, _abstract())
  assert step == 4 and _equal(state, _state(4))


def test_restore_latest_without_checkpoints_is_none(tmp_path):
  mngr = orbax_io.manager(str(tmp_path), keep=3, async_save=False)
  assert orbax_io.restore_latest(mngr, _abstract()) is None


# orbax leaves the failed read's coroutine unawaited; pytest reports that as unraisable.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
@pytest.mark.parametrize('how', ['truncate', 'delete'])
def test_corrupt_newest_step_is_moved_aside_and_the_previous_restored(tmp_path, how):
  workdir = str(tmp_path)
  mngr = _saved(workdir, [1, 2])
  _corrupt(workdir, 2, how)
  restored = orbax_io.restore_latest(mngr, _abstract())
  assert restored is not None
  state, step = restored
  assert step == 1 and _equal(state, _state(1))
  assert os.listdir(tmp_path / 'corrupt_checkpoints') == ['2']   # only the corrupt step
  assert os.path.isdir(tmp_path / 'corrupt_checkpoints' / '2' / 'state')
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['1']
  assert mngr.all_steps() == [1]


def test_validate_rejecting_the_newest_falls_back_without_deleting_it(tmp_path):
  workdir = str(tmp_path)
  mngr = _saved(workdir, [1, 2])
  seen = []

  def validate(state):
    seen.append(int(state['step']))
    if int(state['step']) == 2:
      raise FloatingPointError('non-finite values')

  state, step = orbax_io.restore_latest(mngr, _abstract(), validate=validate)
  assert seen == [2, 1] and step == 1 and _equal(state, _state(1))
  # The rejected checkpoint is kept somewhere on disk: never lost work.
  assert any(os.path.isdir(tmp_path / d / '2') for d in ('checkpoints', 'corrupt_checkpoints'))


def test_a_state_tree_mismatch_is_raised_and_nothing_moves(tmp_path):
  workdir = str(tmp_path)
  mngr = _saved(workdir, [1, 2])
  other = jax.eval_shape(lambda: {**_state(0), 'extra': jnp.zeros(3)})
  with pytest.raises(orbax_io.StateMismatch, match=r'checkpoint 2: extra is not in the '
                     r'checkpoint'):
    orbax_io.restore_latest(mngr, other)
  assert sorted(mngr.all_steps()) == [1, 2]
  assert not os.path.exists(os.path.join(workdir, 'corrupt_checkpoints'))


def test_a_data_position_of_another_pipeline_is_a_mismatch_not_corruption(tmp_path):
  """Readable arrays with an iterator state this pipeline cannot take: raised, never moved."""
  corpus = tmp_path / 'corpus.txt'
  corpus.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 40_000, np.uint8)))
  cfg = ml_collections.ConfigDict({'source': 'text', 'path': str(corpus), 'num_workers': 0})
  it = data.make_train_iterator(cfg, 32, 4, seed=5)
  next(it)
  workdir = str(tmp_path / 'run')
  mngr = orbax_io.manager(workdir, keep=3, async_save=False)
  orbax_io.save(mngr, 1, _state(1), it)
  mngr.wait_until_finished()
  for f in glob.glob(os.path.join(workdir, 'checkpoints', '1', 'data', '*.json')):
    with open(f, 'w') as fh:
      fh.write('{"not": "a grain iterator state"}')
  with pytest.raises(orbax_io.StateMismatch, match='data iterator state'):
    orbax_io.restore_latest(mngr, _abstract(), data.make_train_iterator(cfg, 32, 4, seed=5))
  assert mngr.all_steps() == [1]
  assert not os.path.exists(os.path.join(workdir, 'corrupt_checkpoints'))
  # Without the iterator the same checkpoint restores.
  state, step = orbax_io.restore_latest(mngr, _abstract())
  assert step == 1 and _equal(state, _state(1))


def test_a_failed_restore_of_intact_files_is_raised_not_moved(tmp_path, monkeypatch):
  """Out of memory, a sharding error...: the files read back fine, so nothing is moved aside."""
  workdir = str(tmp_path)
  mngr = _saved(workdir, [1, 2])

  def failing_restore(*args, **kwargs):
    raise RuntimeError('RESOURCE_EXHAUSTED: out of memory')
  monkeypatch.setattr(mngr, 'restore', failing_restore)
  with pytest.raises(RuntimeError, match='out of memory'):
    orbax_io.restore_latest(mngr, _abstract())
  assert sorted(mngr.all_steps()) == [1, 2]
  assert not os.path.exists(os.path.join(workdir, 'corrupt_checkpoints'))


def test_a_second_quarantine_of_a_step_keeps_the_first(tmp_path):
  workdir = str(tmp_path)
  mngr = _saved(workdir, [1])
  for _ in range(2):   # step 2 written, found corrupt, moved aside; twice
    orbax_io.save(mngr, 2, _state(2), None)
    mngr.wait_until_finished()
    _corrupt(workdir, 2, 'delete')
    assert orbax_io.restore_latest(mngr, _abstract())[1] == 1
  moved = sorted(os.listdir(os.path.join(workdir, 'corrupt_checkpoints')))
  assert moved == ['2', '2.1']


def test_the_config_saved_with_a_checkpoint_reads_back(tmp_path):
  mngr = orbax_io.manager(str(tmp_path), keep=3, async_save=False)
  orbax_io.save(mngr, 1, _state(1), None, {'train': {'lr': 0.5}})
  orbax_io.save(mngr, 2, _state(2), None)
  mngr.wait_until_finished()
  assert orbax_io.saved_config(mngr, 1) == {'train': {'lr': 0.5}}
  assert orbax_io.saved_config(mngr, 2) is None
