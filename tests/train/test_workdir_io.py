"""sharenet.train.workdir_io: a workdir's config (old ones completed from the defaults) and a
restore
that reads only, falls back past an unreadable checkpoint and names a mismatch in one line."""
import glob
import hashlib
import json
import os

import numpy as np
import pytest

from sharenet.checkpoint import config_file
from sharenet.train import loop, workdir_io
from sharenet.errors import ConfigError


def _tree_hash(directory):
  h = hashlib.sha256()
  for f in sorted(glob.glob(os.path.join(directory, '**', '*'), recursive=True)):
    if os.path.isfile(f):
      h.update(f.encode() + open(f, 'rb').read())
  return h.hexdigest()


@pytest.fixture(scope='module')
def run(tmp_path_factory, tiny_config):
  """A 10-step tiny run with checkpoints at 5 and 10."""
  workdir = str(tmp_path_factory.mktemp('run'))
  loop.train_and_evaluate(tiny_config(**{'train.steps': 10, 'train.checkpoint_every': 5}),
                               workdir)
  return workdir


def test_load_config_completes_an_old_config_json(tmp_path):
  old = {'model': {'d_model': 32, 'sharing': {'scheme': 'cycle'}},
         'transforms': {'update': 'agc'}, 'train': {'steps': 7}}
  (tmp_path / 'config.json').write_text(json.dumps({**old, 'params_unique': 1}))
  c = workdir_io.load_config(str(tmp_path))
  assert c.model.d_model == 32 and c.model.sharing.scheme == 'cycle' and c.train.steps == 7
  assert c.model.remat == 'dots' and c.parametrization.kind == 'sp'   # from the defaults
  assert c.transforms.updates == 'agc'                                # the renamed key
  assert 'params_unique' not in c


def test_config_json_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  assert config_file.write(workdir, {'model': {'d_model': 32}}) == str(tmp_path / 'config.json')
  before = (tmp_path / 'config.json').read_text()
  assert json.loads(before) == {'model': {'d_model': 32}}
  cyclic = {'model': {}}
  cyclic['model']['self'] = cyclic
  with pytest.raises(ValueError, match='Circular'):       # fails while serializing
    config_file.write(workdir, cyclic)
  monkeypatch.setattr(os, 'replace', lambda *a: (_ for _ in ()).throw(OSError('disk gone')))
  with pytest.raises(OSError, match='disk gone'):          # fails after the temporary is written
    config_file.write(workdir, {'model': {'d_model': 64}})
  assert os.listdir(workdir) == ['config.json']            # no temporary left behind
  assert (tmp_path / 'config.json').read_text() == before


def test_missing_config_json_is_one_line(tmp_path):
  with pytest.raises(ConfigError, match='has no config.json'):
    workdir_io.load_config(str(tmp_path))


@pytest.mark.slow
def test_restore_reads_params_only_and_moves_nothing(run):
  before = _tree_hash(run)
  config = workdir_io.load_config(run)
  state, step, exp = workdir_io.restore_state(config, run)
  assert step == 10 and int(state.step) == 10 and state.opt_state is None
  assert np.isfinite(np.asarray(state.params['params']['embed']['embedding'])).all()
  assert workdir_io.restore_state(config, run, step=5).step == 5
  with pytest.raises(ConfigError, match=r'--step=7 not found; available: \[5, 10\]'):
    workdir_io.restore_state(config, run, step=7)
  assert _tree_hash(run) == before


@pytest.mark.slow
def test_a_config_that_does_not_fit_is_one_line(run):
  config = workdir_io.load_config(run)
  config.model.d_model = 48
  with pytest.raises(ConfigError, match='written by another config') as e:
    workdir_io.restore_state(config, run)
  assert '\n' not in str(e.value)


def test_an_unreadable_newest_checkpoint_falls_back_without_moving(run, tmp_path, capsys):
  import shutil
  workdir = str(tmp_path / 'copy')
  shutil.copytree(run, workdir)
  state_dir = os.path.join(workdir, 'checkpoints', '10', 'state')
  for f in glob.glob(os.path.join(state_dir, '**', 'd', '*'), recursive=True):   # array data
    with open(f, 'r+b') as fh:
      fh.truncate(os.path.getsize(f) // 3)
  before = _tree_hash(workdir)
  restored = workdir_io.restore_state(workdir_io.load_config(workdir), workdir)
  assert restored.step == 5
  assert 'checkpoint 10 is unreadable' in capsys.readouterr().out
  assert _tree_hash(workdir) == before
  assert not os.path.exists(os.path.join(workdir, 'corrupt_checkpoints'))
