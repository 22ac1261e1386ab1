"""The train loop end to end at tiny size: resume, corruption, bad input, NaN, eval.py."""
import glob
import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sharenet.train import experiment, loop, trainer
from sharenet import errors
from sharenet.main import eval_workdir
from sharenet.errors import ConfigError
from sharenet.train.metrics import read_metrics

from conftest import kill_after_checkpoint

@pytest.fixture(scope='module')
def reference_run(tmp_path_factory, tiny_config):
  """One uninterrupted 40-step tiny run, shared by several tests."""
  workdir = str(tmp_path_factory.mktemp('ref'))
  out = loop.train_and_evaluate(tiny_config(), workdir)
  return workdir, out


@pytest.mark.slow
def test_run_writes_contract_files(reference_run):
  workdir, out = reference_run
  cfg = json.load(open(os.path.join(workdir, 'config.json')))
  for key in ('params_unique', 'params_applied', 'flops_per_token', 'model', 'train'):
    assert key in cfg
  rows = read_metrics(workdir)
  train_rows = [r for r in rows if 'loss' in r]
  assert [r['step'] for r in train_rows] == list(range(1, 41))
  for key in ('loss', 'lr', 'tokens_per_sec', 'mfu_vs_matmul', 'grad_norm'):
    assert np.isfinite(train_rows[-1][key])
  # On CPU no hardware peak is published: the matmul-relative figure, never one named `mfu`.
  assert not any('mfu' in r for r in rows)
  assert train_rows[-1]['loss'] < train_rows[0]['loss'] - 1.0
  evals = [r for r in rows if 'eval_loss' in r]
  assert evals[-1]['step'] == 40 and 'eval_bits_per_byte' in evals[-1]
  assert glob.glob(os.path.join(workdir, 'tb', 'events.*'))


@pytest.mark.slow
def test_evaluate_workdir_matches_last_eval(reference_run):
  workdir, _ = reference_run
  last = [r for r in read_metrics(workdir) if 'eval_loss' in r][-1]
  out = eval_workdir.evaluate_workdir(workdir)
  assert out['step'] == last['step']
  assert abs(out['eval_loss'] - last['eval_loss']) <= 1e-6
  assert abs(out['eval_bits_per_byte'] - last['eval_bits_per_byte']) <= 1e-6
  assert 4.0 < out['unigram_bits_per_byte'] < 5.5
  assert json.load(open(os.path.join(workdir, 'eval.json')))['step'] == 40


@pytest.mark.slow
def test_resume_after_kill_is_bit_identical(reference_run, tmp_path, losses, train_cmd,
                                            subprocess_env):
  ref_dir, _ = reference_run
  workdir = str(tmp_path / 'killed')
  kill_after_checkpoint(train_cmd(workdir), subprocess_env, workdir, 20)
  res = subprocess.run(train_cmd(workdir), env=subprocess_env, check=True, capture_output=True,
                       text=True)
  assert 'eval_loss' in json.loads(res.stdout.splitlines()[-1])   # train.py's last line is JSON
  ref, resumed = losses(ref_dir), losses(workdir)
  assert [resumed[s] for s in range(21, 41)] == [ref[s] for s in range(21, 41)]


def _corrupt(workdir, step, how):
  """Truncates or deletes the largest file of the saved train state (its array data)."""
  pattern = os.path.join(workdir, 'checkpoints', str(step), 'state', '**', '*')
  files = [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
  assert files, 'no checkpoint file found to corrupt'
  target = max(files, key=os.path.getsize)
  if how == 'truncate':
    with open(target, 'r+b') as f:
      f.truncate(os.path.getsize(target) // 3)
  else:
    os.remove(target)


@pytest.mark.slow
@pytest.mark.parametrize('how', ['truncate', 'delete'])
def test_corrupt_newest_checkpoint_falls_back(tmp_path, capsys, how, tiny_config, losses):
  workdir = str(tmp_path)
  loop.train_and_evaluate(tiny_config(**{'train.steps': 20, 'train.checkpoint_every': 10}),
                               workdir)
  _corrupt(workdir, 20, how)
  loop.train_and_evaluate(tiny_config(**{'train.steps': 30, 'train.checkpoint_every': 10}),
                               workdir)
  out = capsys.readouterr().out
  warnings = [l for l in out.splitlines() if l.startswith('WARNING: checkpoint 20')]
  assert len(warnings) == 1, out
  assert 'resumed from checkpoint at step 10' in out
  assert os.path.isdir(os.path.join(workdir, 'corrupt_checkpoints', '20'))
  assert max(losses(workdir)) == 30


def test_different_model_in_workdir_fails_clearly(reference_run, tiny_config):
  workdir, _ = reference_run
  with pytest.raises(ConfigError, match=r'different model \(model.d_model 32 -> 48'):
    loop.train_and_evaluate(tiny_config(**{'model.d_model': 48}), workdir)


@pytest.mark.slow
def test_non_finite_loss_stops_without_bad_checkpoint(tmp_path, tiny_config):
  workdir = str(tmp_path)
  cfg = tiny_config(**{'train.lr': 1e30, 'train.warmup_steps': 0, 'train.checkpoint_every': 1,
                       'train.grad_clip': 0.0, 'train.schedule': 'constant'})
  with pytest.raises(errors.NonFiniteLoss, match=r'at step \d+'):
    loop.train_and_evaluate(cfg, workdir)
  mngr = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'))
  assert mngr.all_steps(), 'expected the finite early steps to be checkpointed'
  for step in mngr.all_steps():
    state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state['params']))


BAD = [
    ({'model.sharing.scheme': 'spiral'}, 'model.sharing.scheme'),
    ({'model.norm.kind': 'batchnorm'}, 'model.norm.kind'),
    ({'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 3}, 'model.sharing.num_unique'),
    ({'model.num_heads': 3}, 'model.num_heads'),
    ({'data.source': 'text', 'data.path': '/nonexistent/*.txt'}, 'data.path'),
    ({'train.seq_len': 10_000_000}, 'train.seq_len'),
    ({'train.schedule': 'linear'}, 'train.schedule'),
]


@pytest.mark.parametrize('overrides, field', BAD)
def test_bad_input_names_field(overrides, field, tiny_config):
  with pytest.raises(ConfigError, match=field.replace('.', r'\.')) as e:
    experiment.validate(tiny_config(**overrides))
  assert '\n' not in str(e.value)


def test_empty_data_files_rejected(tmp_path, tiny_config):
  (tmp_path / 'a.txt').write_text('')
  with pytest.raises(ConfigError, match='data.path'):
    experiment.validate(tiny_config(**{'data.source': 'text',
                                       'data.path': str(tmp_path / '*.txt')}))


@pytest.mark.slow
def test_cli_bad_input_exits_with_one_line(tmp_path, train_cmd, subprocess_env):
  res = subprocess.run(train_cmd(str(tmp_path), '--config.model.sharing.scheme=spiral'),
                       env=subprocess_env, capture_output=True, text=True)
  assert res.returncode != 0
  errors = [l for l in res.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'model.sharing.scheme' in errors[0] and 'valid:' in errors[0]
  assert not os.path.exists(os.path.join(tmp_path, 'checkpoints'))


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path, train_cmd, subprocess_env):
  workdir = str(tmp_path)
  proc = subprocess.Popen(train_cmd(workdir, '--config.train.checkpoint_every=1000'),
                          env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True)
  metrics = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.time() + 300
  while proc.poll() is None and time.time() < deadline:
    if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 3:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0
  assert 'SIGTERM at step' in out
  step = int(out.split('SIGTERM at step ')[1].split(';')[0])
  assert 3 <= step < 40
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(step)))


@pytest.mark.slow
def test_grad_accum_steps_like_the_whole_batch(tiny_config):
  """train.grad_accum=2 on a batch of 4 rows: the loss, the metrics and the update are those of
  one step on all 4 rows (mean of the micro-batches' means = the batch mean), in float64."""
  with jax.enable_x64(True):
    config = tiny_config(**{'model.num_layers': 2, 'model.dtype': 'float64',
                            'model.param_dtype': 'float64', 'train.batch_size': 4,
                            'train.seq_len': 8})
    exp = trainer.setup(config, experiment.validate(config))
    state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
    batch = jax.random.randint(jax.random.key(1), (4, 9), 0, 256)
    one, m1 = jax.jit(trainer.make_train_step(exp, 1))(state, batch)
    two, m2 = jax.jit(trainer.make_train_step(exp, 2))(state, batch)
    np.testing.assert_allclose(m2['loss'], m1['loss'], rtol=1e-12)
    np.testing.assert_allclose(m2['grad_norm'], m1['grad_norm'], rtol=1e-10)
    for a, b in zip(jax.tree.leaves(two.params), jax.tree.leaves(one.params)):
      np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
