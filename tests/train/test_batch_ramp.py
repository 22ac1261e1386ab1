"""train.batch_ramp (sharenet/train/batch_ramp.py): smaller batches first, one compile per size."""
import numpy as np
import pytest
from conftest import resume_matches_uninterrupted

from sharenet.errors import ConfigError
from sharenet.train import batch_ramp


def test_a_ramp_is_chunks_of_its_first_batch():
  r = batch_ramp.parse('2:3, 4:5', 8, 10)
  assert r.chunk == 2 and [r.batch_at(s) for s in range(1, 9)] == [2, 2, 2, 4, 4, 8, 8, 8]
  assert r.batches() == [2, 4, 8] and batch_ramp.parse('', 8, 10) is None
  it = iter([np.full((2, 3), i) for i in range(5)])
  np.testing.assert_array_equal(batch_ramp.next_batch(it, 2), [[0] * 3] * 2 + [[1] * 3] * 2)
  np.testing.assert_array_equal(batch_ramp.next_batch(it, 1), [[2] * 3] * 2)
  dicts = iter([{'tokens': np.full((2, 3), i), 'segment_ids': np.zeros((2, 3))} for i in range(2)])
  assert batch_ramp.next_batch(dicts, 2)['tokens'].shape == (4, 3)


@pytest.mark.slow
def test_train_runs_the_ramp_compiling_once_per_size(tmp_path, tiny_config, monkeypatch):
  """steps 1-2 at batch 2, 3-4 at 4, then train.batch_size=8: each step sees its batch's rows
  (the dispatched shapes), three distinct shapes, and the log rows count each step's tokens."""
  from sharenet.train import loop
  from sharenet.train.metrics import read_metrics
  shapes = []
  dispatch = loop.dispatch

  def recorded(step_fn, state, host_batch, sharding, batch_shape, *args, **kwargs):
    shapes.append((np.asarray(host_batch).shape, batch_shape))
    return dispatch(step_fn, state, host_batch, sharding, batch_shape, *args, **kwargs)

  monkeypatch.setattr(loop, 'dispatch', recorded)
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(tiny_config(**{'train.steps': 6, 'train.batch_size': 8,
                                         'train.log_every': 1, 'train.batch_ramp': '2:2,4:4'}),
                          workdir)
  rows = [s[0][0] for s in shapes]
  assert rows == [2, 2, 4, 4, 8, 8] and all(s[0] == s[1] for s in shapes)
  assert all(np.isfinite(r['loss']) for r in read_metrics(workdir) if 'loss' in r)


@pytest.mark.parametrize('spec, match', [
    ('2-4', 'is not BATCH:LAST_STEP'),
    ('3:2', 'batch 3 does not divide train.batch_size=8'),
    ('2:2,3:4', 'batch 3 does not divide'),
    ('2:4,4:3', 'stage ends that do not increase'),
    ('2:99', 'within the run'),
])
def test_bad_ramps_are_one_line(tmp_path, tiny_config, spec, match):
  from sharenet.train import loop
  with pytest.raises(ConfigError, match=match) as e:
    loop.train_and_evaluate(tiny_config(**{'train.steps': 6, 'train.batch_size': 8,
                                           'train.batch_ramp': spec}), str(tmp_path / 'run'))
  assert '\n' not in str(e.value) and not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_kill_and_resume_inside_the_ramp_is_exact(tmp_path):
  """train.py with a ramp, killed with -9 after its step-4 checkpoint (inside the ramp), resumes
  to the uninterrupted run's losses."""
  resume_matches_uninterrupted(tmp_path, [
      '--config.train.steps=10', '--config.train.checkpoint_every=4',
      '--config.train.log_every=1', '--config.train.batch_size=8',
      '--config.train.batch_ramp=2:3,4:6'], 4, 10)
