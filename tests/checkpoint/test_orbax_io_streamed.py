"""Tests for orbax_io.save_streamed: a checkpoint written leaf by leaf through orbax's
experimental v1 partial save, read by the unchanged restore code as `orbax_io.save`'s."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax.traverse_util import flatten_dict

from sharenet.checkpoint import orbax_io
from sharenet.train.trainer import TrainState

CONFIG = {'model': {'d_model': 8}, 'param_shapes': {'params/a/kernel': [4, 5]}}


def _params():
  rng = np.random.default_rng(0)
  return {'params': {'a': {'kernel': jnp.asarray(rng.standard_normal((4, 5), np.float32)),
                           'bias': jnp.asarray(rng.standard_normal((5,), np.float32))},
                     'b': jnp.asarray(rng.standard_normal((3,), np.float32), jnp.bfloat16)},
          'per_layer': {'x': jnp.asarray(rng.integers(0, 9, (2, 3)), jnp.int32)}}


def _leaves(params):
  return ((('params',) + p, v) for p, v in flatten_dict(params).items())


def _skeleton(step):
  return {'step': jnp.asarray(step, jnp.int32), 'opt_state': None, 'tstate': {}}


def _bits(tree):
  return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


def _identical(a, b):
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(_bits(a), _bits(b)))


@pytest.mark.slow
def test_a_streamed_checkpoint_restores_as_the_in_memory_save(tmp_path):
  params = _params()
  state = TrainState(jnp.asarray(7, jnp.int32), params, None, {})
  ref = orbax_io.manager(str(tmp_path / 'ref'), 3, async_save=False)
  orbax_io.save(ref, 7, state, None, CONFIG)
  ref.wait_until_finished()
  final = orbax_io.save_streamed(str(tmp_path / 'run'), 7, _leaves(params), _skeleton(7),
                                   CONFIG)
  assert final == str(tmp_path / 'run' / 'checkpoints' / '7')
  assert sorted(os.listdir(tmp_path / 'run')) == ['checkpoints']   # no staging left
  mngr = orbax_io.manager(str(tmp_path / 'run'), 3, async_save=False)
  assert mngr.all_steps() == [7] and mngr.latest_step() == 7
  assert orbax_io.saved_config(mngr, 7) == CONFIG
  assert orbax_io.saved_signatures(mngr, 7) == orbax_io.saved_signatures(ref, 7)
  meta = [json.loads((tmp_path / r / 'checkpoints' / '7' / 'state' / '_METADATA').read_text())
          for r in ('run', 'ref')]
  assert meta[0]['tree_metadata'] == meta[1]['tree_metadata']
  abstract = jax.eval_shape(lambda: state)
  restored, step = orbax_io.restore_latest(mngr, abstract)
  assert step == 7 and _identical(restored, state)
  assert _identical(restored, orbax_io.restore_latest(ref, abstract)[0])
  parts, _ = orbax_io.restore_parts(mngr, 7, {'params': abstract.params})
  assert _identical(parts['params'], params)
  leaf = orbax_io.restore_leaf(mngr, 7, 'params', ('params', 'a', 'kernel'),
                                 abstract.params['params']['a']['kernel'])
  np.testing.assert_array_equal(leaf, np.asarray(params['params']['a']['kernel']))
  # the manager goes on saving after it (train.py's next checkpoint)
  orbax_io.save(mngr, 8, restored, None, CONFIG)
  mngr.wait_until_finished()
  assert mngr.all_steps() == [7, 8]


def _failing(params, after):
  for k, item in enumerate(_leaves(params)):
    if k == after:
      raise RuntimeError('tensor unreadable')
    yield item


@pytest.mark.slow
@pytest.mark.parametrize('how', ['raise', 'repeat', 'skeleton_field'])
def test_a_failure_midway_leaves_no_step_and_no_staging(tmp_path, how):
  params = _params()
  leaves = {'raise': _failing(params, 2),
            'repeat': [*_leaves(params), next(_leaves(params))],
            'skeleton_field': [*_leaves(params), (('tstate', 'x'), jnp.zeros(2))]}[how]
  with pytest.raises(RuntimeError if how == 'raise' else ValueError):
    orbax_io.save_streamed(str(tmp_path / 'run'), 3, leaves, _skeleton(3), CONFIG)
  left = [os.path.relpath(os.path.join(d, n), tmp_path) for d, ds, fs in os.walk(tmp_path)
          for n in ds + fs]
  assert left in ([], ['run']), left   # no checkpoints/3, no staging directory
  mngr = orbax_io.manager(str(tmp_path / 'run'), 3, async_save=False)
  assert mngr.latest_step() is None and mngr.all_steps() == []
  # a later save of that step succeeds
  orbax_io.save_streamed(str(tmp_path / 'run'), 3, _leaves(params), _skeleton(3), CONFIG)
  mngr.reload()
  assert mngr.all_steps() == [3]
  with pytest.raises(FileExistsError):
    orbax_io.save_streamed(str(tmp_path / 'run'), 3, _leaves(params), _skeleton(3), CONFIG)


@pytest.mark.slow
def test_the_streamed_checkpoint_is_the_v0_item_layout(tmp_path):
  """The v1 marker file is gone and the items are the v0 handlers' (CheckpointManager reads
  the step by them)."""
  orbax_io.save_streamed(str(tmp_path), 0, _leaves(_params()), _skeleton(0), CONFIG)
  step = tmp_path / 'checkpoints' / '0'
  assert not (step / 'orbax.checkpoint').exists()
  handlers = json.loads((step / '_CHECKPOINT_METADATA').read_text())['item_handlers']
  assert handlers == {'state': ocp.StandardCheckpointHandler.typestr(),
                      'config': ocp.JsonCheckpointHandler.typestr()}
