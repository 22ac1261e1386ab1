"""train.ema (sharenet/optim/ema.py): the weights' moving average in the optimizer state."""
import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import resume_matches_uninterrupted

from sharenet.errors import ConfigError
from sharenet.optim import ema, guard


def test_the_average_restates_in_numpy_and_skipped_steps_leave_it():
  """ema_t = d ema_{t-1} + (1 - d) params_t over SGD steps; inside the guard a NaN step leaves
  it (and the parameters) as they were."""
  d = 0.9
  tx = guard.skip_bad_steps(ema.track_ema(optax.sgd(0.5), d), True, 0.0, 1)
  params = {'w': jnp.asarray([1.0, -2.0])}
  state = tx.init(params)
  want, p = np.asarray([1.0, -2.0]), np.asarray([1.0, -2.0])
  for g in ([1.0, 1.0], [0.5, -1.0], [np.nan, 0.0], [2.0, 0.0]):
    updates, state = tx.update({'w': jnp.asarray(g)}, state, params)
    params = optax.apply_updates(params, updates)
    if not np.isnan(g).any():
      p = p - 0.5 * np.asarray(g)
      want = d * want + (1 - d) * p
    np.testing.assert_allclose(params['w'], p, rtol=1e-6)
    np.testing.assert_allclose(ema.find(state).ema['w'], want, rtol=1e-6)
  np.testing.assert_allclose(ema.averaged(state, params)['w'], want, rtol=1e-6)
  with pytest.raises(ConfigError, match='keeps no average'):
    ema.averaged(optax.sgd(0.1).init(params), params)


@pytest.mark.slow
def test_train_evaluates_the_average_and_eval_py_reads_it_after_an_exact_resume(
    tmp_path, tiny_config):
  """train.py with train.ema: each evaluation adds ema/eval_loss; killed with -9 after its
  step-6 checkpoint the run resumes to the uninterrupted run's losses and averages; eval.py
  --ema evaluates the saved average (equal to the run's last ema/eval_loss), and a run without
  an average is one line."""
  ref, killed = resume_matches_uninterrupted(tmp_path, [
      '--config.train.steps=12', '--config.train.checkpoint_every=6',
      '--config.train.log_every=1', '--config.train.ema=0.8'], 6, 12)
  from sharenet.train.metrics import read_metrics
  last = lambda w: [r for r in read_metrics(w) if 'ema/eval_loss' in r][-1]
  assert last(killed)['ema/eval_loss'] == last(ref)['ema/eval_loss']
  assert last(ref)['ema/eval_loss'] != last(ref)['eval_loss']
  from sharenet.main import eval_workdir
  from conftest import EVAL_TOKENS
  row = eval_workdir.evaluate_workdir(ref, overrides={'data.eval_tokens': EVAL_TOKENS}, ema=True)
  assert row['ema'] and row['eval_loss'] == pytest.approx(last(ref)['ema/eval_loss'], rel=1e-6)
  plain = str(tmp_path / 'plain')
  from sharenet.train import loop
  loop.train_and_evaluate(tiny_config(**{'train.steps': 1}), plain)
  with pytest.raises(ConfigError, match='keeps no average') as e:
    eval_workdir.evaluate_workdir(plain, ema=True)
  assert '\n' not in str(e.value)
  assert os.path.isfile(os.path.join(ref, 'eval.json'))
  assert json.load(open(os.path.join(ref, 'eval.json')))['ema'] is True
  # export_hf --ema writes the average: its embedding is the saved average's, not the weights'
  from sharenet.interop import export_hf, safetensors_io
  from sharenet.train import workdir_io
  config = workdir_io.load_config(ref)
  embedding = {e: np.asarray(workdir_io.restore_state(config, ref, ema=e).state.params[
      'params']['embed']['embedding']) for e in (False, True)}
  for e in (False, True):
    assert export_hf.export_hf(ref, str(tmp_path / f'hf{e}'), ema=e)['ema'] is e
    files = safetensors_io.open_model(str(tmp_path / f'hf{e}'))
    got = files['model.embed_tokens.weight'].read('model.embed_tokens.weight')
    np.testing.assert_allclose(got, embedding[e], rtol=1e-6)
  assert np.abs(embedding[True] - embedding[False]).max() > 1e-4
  with pytest.raises(ConfigError, match='keeps no average') as e:
    export_hf.export_hf(plain, str(tmp_path / 'hf_plain'), ema=True)
  assert '\n' not in str(e.value) and not (tmp_path / 'hf_plain').exists()


def test_a_bad_decay_is_one_line(tmp_path, tiny_config):
  from sharenet.train import loop
  with pytest.raises(ConfigError, match=r'train.ema=1.0; valid: 0 \(off\) <= ema < 1') as e:
    loop.train_and_evaluate(tiny_config(**{'train.ema': 1.0}), str(tmp_path / 'run'))
  assert '\n' not in str(e.value) and not (tmp_path / 'run').exists()
