"""Resume under a changed config: it resumes exactly or stops with one line; checkpoints are
never moved or rewritten (sharenet/train/resume.py, sharenet/checkpoint/orbax_io.py)."""
import glob
import hashlib
import json
import os
import shutil
import subprocess

import orbax.checkpoint as ocp
import pytest

from sharenet.train import resume, loop
from sharenet.errors import ConfigError
from sharenet.train.metrics import read_metrics

BASE = {'train.steps': 20, 'train.checkpoint_every': 10}


@pytest.fixture(scope='session')
def config(tiny_config):
  """configs/tiny.py at 20 steps with checkpoints every 10, plus dotted overrides."""
  return lambda **overrides: tiny_config(**{**BASE, **overrides})


def _hashes(workdir):
  """sha256 of every file under checkpoints/, by relative path."""
  root = os.path.join(workdir, 'checkpoints')
  out = {}
  for f in sorted(glob.glob(os.path.join(root, '**', '*'), recursive=True)):
    if os.path.isfile(f):
      out[os.path.relpath(f, root)] = hashlib.sha256(open(f, 'rb').read()).hexdigest()
  return out


def _steps_of(hashes, step):
  return {k: v for k, v in hashes.items() if k.split(os.sep)[0] == str(step)}


@pytest.fixture(scope='module')
def base_run(tmp_path_factory, config):
  """A 20-step tiny run with checkpoints at 10 and 20."""
  workdir = str(tmp_path_factory.mktemp('base'))
  loop.train_and_evaluate(config(), workdir)
  return workdir


@pytest.fixture
def copy_of(base_run, tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(base_run, workdir)
  return workdir


def _text_corpus(tmp_path):
  path = tmp_path / 'corpus.txt'
  path.write_bytes(open(os.path.join(os.path.dirname(os.__file__), 'os.py'), 'rb').read() * 4)
  return str(path)


UNRESTORABLE = [
    ({'train.grad_clip': 0.0}, 'train.grad_clip'),
    ({'transforms.reparam': 'weight_norm'}, 'transforms.reparam'),
    ({'transforms.updates': 'agc'}, 'transforms.updates'),
    ({'parametrization.kind': 'mup', 'parametrization.base_d_model': 16}, 'parametrization.kind'),
    ({'model.d_model': 48}, 'model.d_model'),
    ({'data.seed': 7}, 'data.seed'),
    ({'data.source': 'text'}, 'data.source'),
]


@pytest.mark.slow
@pytest.mark.parametrize('overrides, field', UNRESTORABLE)
def test_unrestorable_change_is_one_line_and_touches_nothing(copy_of, tmp_path, config,
                                                            overrides, field):
  if overrides.get('data.source') == 'text':
    overrides = {**overrides, 'data.path': _text_corpus(tmp_path)}
  before = _hashes(copy_of)
  config_before = open(os.path.join(copy_of, 'config.json')).read()
  with pytest.raises(ConfigError) as e:
    loop.train_and_evaluate(config(**{'train.steps': 30, **overrides}), copy_of)
  msg = str(e.value)
  assert '\n' not in msg and field in msg, msg
  assert 'new --workdir' in msg
  if field != 'model.d_model':   # a different model cannot take the old parameters either
    assert 'train.restore=params' in msg
  assert _hashes(copy_of) == before
  assert not os.path.exists(os.path.join(copy_of, 'corrupt_checkpoints'))
  assert open(os.path.join(copy_of, 'config.json')).read() == config_before


@pytest.mark.slow
@pytest.mark.parametrize('overrides', [{}, {'train.lr': 1e-3, 'train.weight_decay': 0.0}])
def test_restorable_change_resumes_from_the_last_checkpoint(copy_of, capsys, config,
                                                           overrides):
  before = _hashes(copy_of)
  loop.train_and_evaluate(config(**{'train.steps': 30, **overrides}), copy_of)
  out = capsys.readouterr().out
  assert 'resumed from checkpoint at step 20' in out
  note = [l for l in out.splitlines() if 'resuming with changed fields' in l]
  assert len(note) == 1 and 'train.steps 20 -> 30' in note[0]
  for key in overrides:
    assert key in note[0]
  assert ('none changes the train state' in note[0]) == (not overrides)
  rows = [r for r in read_metrics(copy_of) if 'loss' in r]
  assert [r['step'] for r in rows] == list(range(1, 31))   # 21..30 appended once, none redone
  # The optimizer trains with the new peak LR and the log reports it.
  peak = overrides.get('train.lr', config().train.lr)
  state = ocp.CheckpointManager(os.path.join(copy_of, 'checkpoints')).restore(
      30, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
  assert float(state['opt_state']['hyperparams']['peak_lr']) == pytest.approx(peak, rel=1e-6)
  assert max(r['lr'] for r in rows[20:]) <= peak * (1 + 1e-6)
  after = _hashes(copy_of)
  for step in (10, 20):
    assert _steps_of(after, step) == _steps_of(before, step)
  assert _steps_of(after, 30)


@pytest.mark.slow
def test_restore_params_loads_parameters_with_a_fresh_optimizer(copy_of, capsys, config):
  import jax
  import numpy as np
  before = _hashes(copy_of)
  cfg = config(**{'train.steps': 30, 'train.grad_clip': 0.0, 'train.restore': 'params'})
  loop.train_and_evaluate(cfg, copy_of)
  out = capsys.readouterr().out
  assert 'train.restore=params: loaded the parameters of checkpoint 20' in out
  assert 'optimizer state is fresh' in out and 'data position' in out
  after = _hashes(copy_of)
  for step in (10, 20):
    assert _steps_of(after, step) == _steps_of(before, step)
  mngr = ocp.CheckpointManager(os.path.join(copy_of, 'checkpoints'))
  restore = lambda s: mngr.restore(s, args=ocp.args.Composite(
      state=ocp.args.StandardRestore()))['state']
  s20, s30 = restore(20), restore(30)
  # Adam's moments restarted at step 20 (10 updates since) while the LR schedule's counts went
  # on from 20; the params moved on from the loaded ones.
  counts = [int(x) for p, x in jax.tree_util.tree_flatten_with_path(s30['opt_state'])[0]
            if 'count' in jax.tree_util.keystr(p)]
  assert sorted(counts) == [10, 30, 30], counts
  assert int(s30['step']) == 30
  emb20 = np.asarray(s20['params']['params']['embed']['embedding'])
  emb30 = np.asarray(s30['params']['params']['embed']['embedding'])
  assert 0 < np.abs(emb30 - emb20).max() < 1.0
  # Run again with the same flags: the saved state now fits, so it resumes whole.
  loop.train_and_evaluate(cfg, copy_of)
  out = capsys.readouterr().out   # and says why train.restore=params did not act
  assert 'resumed from checkpoint at step 30' in out and 'the whole state is resumed' in out


@pytest.mark.slow
def test_restore_params_refuses_a_different_model(copy_of, config):
  before = _hashes(copy_of)
  with pytest.raises(ConfigError, match='different model'):
    loop.train_and_evaluate(config(**{'model.num_layers': 3, 'train.restore': 'params'}),
                                 copy_of)
  assert _hashes(copy_of) == before


@pytest.mark.slow
def test_cli_exits_2_with_one_line(copy_of, train_cmd, subprocess_env):
  before = _hashes(copy_of)
  res = subprocess.run(train_cmd(copy_of, '--config.train.steps=30',
                                 '--config.train.checkpoint_every=10',
                                 '--config.train.grad_clip=0'),
                       env=dict(subprocess_env), capture_output=True, text=True)
  assert res.returncode == 2, res.stderr[-2000:]
  errors = [l for l in res.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'train.grad_clip 1.0 -> 0.0' in errors[0], res.stderr[-2000:]
  assert _hashes(copy_of) == before


def test_changes_classify_fields(config):
  old = json.loads(json.dumps(config().to_dict()))
  new = config(**{'train.steps': 99, 'mesh.fsdp': 2, 'train.lr': 0.1, 'data.seed': 3,
                  'data.num_workers': 2})
  ch = resume.Changes(old, new)
  assert set(ch.fields) == {'train.steps', 'mesh.fsdp', 'train.lr', 'data.seed',
                            'data.num_workers'}
  assert set(ch.state_free) == {'train.steps', 'mesh.fsdp'}
  # num_workers changes the shape of the saved iterator state.
  assert set(ch.data_stream) == {'data.seed', 'data.num_workers'}
  assert set(ch.stateful) == {'train.lr', 'data.seed', 'data.num_workers'}
  assert not resume.Changes(old, config())
  del old['train']['lr']             # a field an older run did not record is not a change
  assert 'train.lr' not in resume.Changes(old, new).fields
