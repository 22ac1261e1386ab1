"""Running statistics of a statistics norm (model.norm.kind=powernorm | unified_norm |
online_norm, sharenet/models/norm_stats.py)
in the model: one entry per applied layer under a tied block, the same under both lowerings,
in TrainState.tstate, and restored exactly after a kill -9. The forward and backward against
the reference: tests/models/test_norms_family.py; 8 devices against one:
tests/train/test_sharding.py."""
import subprocess

import jax
import numpy as np
import pytest

from sharenet.train import experiment, loop, trainer, workdir_io
from sharenet.main import convert_workdir, eval_workdir
from sharenet.models.norm_stats import NORM_STATS

from conftest import kill_after_checkpoint

POWERNORM = {'model.norm.kind': 'powernorm', 'model.norm.stats_warmup': 2}


def _train(config, steps):
  exp = trainer.setup(config, experiment.validate(config))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  step = jax.jit(trainer.make_train_step(exp))
  rng = np.random.default_rng(0)
  t = config.train
  losses = []
  for _ in range(steps):
    tokens = rng.integers(0, 256, (t.batch_size, t.seq_len + 1)).astype(np.int32)
    state, metrics = step(state, tokens)
    losses.append(float(metrics['loss']))
  return state, losses


def _block_stats(state):
  """The stack's statistics leaves {path: array} (the final norm's are outside it)."""
  flat = jax.tree_util.tree_flatten_with_path(state.tstate[NORM_STATS])[0]
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat if np.ndim(v) >= 2}


@pytest.mark.slow
def test_statistics_are_per_applied_layer_and_equal_under_both_lowerings(tiny_config):
  """A cycle of 2 sets applied twice (4 layers): every statistic has one entry per applied
  layer ((R, K) leading axes), the two applications of one set keep different statistics, and
  the nested and flat lowerings train to the same losses and statistics (4 steps: warmup's
  batch statistic, then the running one)."""
  cycle = {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
           'model.sharing.num_unique': 2, **POWERNORM}
  nested, losses = _train(tiny_config(**cycle), 4)
  flat, flat_losses = _train(tiny_config(**cycle, **{'model.scan_lowering': 'flat'}), 4)
  np.testing.assert_allclose(flat_losses, losses, rtol=1e-5)
  stats, flat_stats = _block_stats(nested), _block_stats(flat)
  assert stats and stats.keys() == flat_stats.keys()
  for path, value in stats.items():
    assert value.shape[:2] == (2, 2), (path, value.shape)     # (R, K): every applied layer
    np.testing.assert_allclose(flat_stats[path], value, rtol=1e-5, atol=1e-7, err_msg=path)
    if path.endswith("['psi2']"):
      assert not np.allclose(value[0, 0], value[1, 0])          # set 0's two uses differ
    if path.endswith("['count']"):
      assert (value == 4).all()
  assert losses[-1] != pytest.approx(losses[0])


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['powernorm', 'unified_norm', 'online_norm'])
def test_resume_after_kill_keeps_the_statistics_exactly(tmp_path, losses, tiny_config,
                                                        train_cmd, subprocess_env, kind):
  """train.py with a statistics norm killed (-9) after its step-20 checkpoint and resumed:
  steps 21-40 give the uninterrupted run's losses (trained in this process) bit for bit, and
  the final statistics are identical (the running statistic, or Unified Norm's window, is
  used from step 11)."""
  overrides = {'model.norm.kind': kind, 'model.norm.stats_warmup': 10}
  flags = [f'--config.{k}={v}' for k, v in overrides.items()]
  ref_dir, workdir = str(tmp_path / 'ref'), str(tmp_path / 'killed')
  loop.train_and_evaluate(tiny_config(**overrides), ref_dir)
  kill_after_checkpoint(train_cmd(workdir, *flags), subprocess_env, workdir, 20)
  subprocess.run(train_cmd(workdir, *flags), env=subprocess_env, check=True,
                 capture_output=True)
  ref, resumed = losses(ref_dir), losses(workdir)
  assert [resumed[s] for s in range(21, 41)] == [ref[s] for s in range(21, 41)]
  a, b = (workdir_io.restore_state(workdir_io.load_config(d), d)[0] for d in (ref_dir, workdir))
  for x, y in zip(jax.tree.leaves(a.tstate[NORM_STATS]), jax.tree.leaves(b.tstate[NORM_STATS])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  counts = [np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(
      a.tstate[NORM_STATS])[0] if jax.tree_util.keystr(p).endswith("['count']")]
  assert counts and all((c == 40).all() for c in counts)


@pytest.mark.slow
def test_a_conversion_of_a_powernorm_run_is_one_line(tmp_path, tiny_config):
  """convert.py would restart the running statistics at their init: refused, nothing written."""
  from sharenet.config import defaults
  from sharenet.errors import ConfigError
  src = str(tmp_path / 'src')
  loop.train_and_evaluate(tiny_config(**{**POWERNORM, 'train.steps': 2}), src)
  opts = defaults.conversion_config()
  opts.update(to='recursive', scheme='universal', num_unique=1, init='average')
  with pytest.raises(ConfigError, match='does not carry the running statistics') as e:
    convert_workdir.convert_workdir(src, str(tmp_path / 'out'), opts)
  assert '\n' not in str(e.value) and not (tmp_path / 'out').exists()
  # eval.py's path (eval mode, the running statistics) reads the run back
  assert np.isfinite(eval_workdir.evaluate_workdir(src)['eval_loss'])


@pytest.mark.slow
def test_fold_unified_norm_keeps_the_eval_loss(tmp_path, tiny_config):
  """convert.py --config.to=fold_unified_norm: a Unified-Norm run (past its warmup and first
  window, so the running statistics are the window's) folded into its readers and readout
  evaluates to the same loss (<= 1e-4) with no norms; a fold of another norm or of a tied plan
  is one line and writes nothing."""
  from sharenet.config import defaults
  from sharenet.errors import ConfigError
  src = str(tmp_path / 'un')
  loop.train_and_evaluate(tiny_config(**{
      'model.norm.kind': 'unified_norm', 'model.norm.stats_warmup': 3,
      'model.norm.stats_window': 2, 'train.steps': 8}), src)
  opts = defaults.conversion_config()
  opts.update(to='fold_unified_norm')
  out = str(tmp_path / 'folded')
  convert_workdir.convert_workdir(src, out, opts)
  assert workdir_io.load_config(out).model.norm.kind == 'none'
  before, after = eval_workdir.evaluate_workdir(src), eval_workdir.evaluate_workdir(out)
  assert abs(after['eval_loss'] - before['eval_loss']) <= 1e-4, (before, after)
  other = str(tmp_path / 'rms')
  loop.train_and_evaluate(tiny_config(**{'train.steps': 1}), other)
  with pytest.raises(ConfigError, match='needs a model with model.norm.kind=unified_norm') as e:
    convert_workdir.convert_workdir(other, str(tmp_path / 'x'), opts)
  assert '\n' not in str(e.value) and not (tmp_path / 'x').exists()
  tied = str(tmp_path / 'tied')
  loop.train_and_evaluate(tiny_config(**{
      'model.norm.kind': 'unified_norm', 'model.sharing.scheme': 'universal',
      'model.sharing.num_unique': 1, 'train.steps': 1}), tied)
  with pytest.raises(ConfigError, match='it converts a model with model.sharing.scheme=untied'):
    convert_workdir.convert_workdir(tied, str(tmp_path / 'y'), opts)
  assert not (tmp_path / 'y').exists()
