"""The bad-step guard (sharenet/optim/guard.py): train.skip_nonfinite and train.spike_factor."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import resume_matches_uninterrupted

from sharenet.errors import ConfigError
from sharenet.optim import chain, guard


def _grads(scale, nan=False):
  g = {'w': jnp.full((3,), scale, jnp.float32), 'b': jnp.asarray(scale, jnp.float32)}
  return jax.tree.map(lambda x: x * jnp.nan, g) if nan else g


def test_skipped_steps_apply_nothing_and_keep_the_optimizer_state():
  """Adam inside the guard (window 3, factor 5): a NaN gradient and, once 3 steps are seen, a
  gradient 10x the median are skipped (zero update, Adam's state as before, counts kept); a
  gradient 4x the median is not."""
  tx = guard.skip_bad_steps(optax.adam(0.1), nonfinite=True, spike_factor=5.0, window=3)
  params = {'w': jnp.zeros((3,)), 'b': jnp.zeros(())}
  state = tx.init(params)
  norms = []
  for i, (scale, nan, skip) in enumerate([(1.0, False, False), (1.1, False, False),
                                          (0.0, True, True), (0.9, False, False),
                                          (10.0, False, True), (4.0, False, False)]):
    updates, new = tx.update(_grads(scale, nan), state, params)
    assert bool(new.last_skipped) == skip, i
    if skip:
      assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
      for a, b in zip(jax.tree.leaves(new.inner), jax.tree.leaves(state.inner)):
        np.testing.assert_array_equal(a, b)
    else:
      norms.append(float(optax.global_norm(_grads(scale))))
      assert float(jnp.abs(updates['w']).max()) > 0
    params = optax.apply_updates(params, updates)
    state = new
  assert int(state.skipped) == 2 and int(state.in_a_row) == 0 and int(state.seen) == 4
  ring = np.asarray(state.norms)
  np.testing.assert_allclose(sorted(ring), sorted(norms[-3:]), rtol=1e-6)
  assert float(guard.median_of_ring(state.norms, state.seen)) == pytest.approx(
      np.median(norms[-3:]), rel=1e-6)


def test_the_train_chain_wraps_the_guard_and_reports_it(tiny_config):
  t = tiny_config(**{'train.skip_nonfinite': True, 'train.weight_decay': 0.0}).train
  tx = chain.make_optimizer(t)
  state = tx.init({'w': jnp.zeros((2,))})
  assert guard.find(state) is not None
  _, state = tx.update({'w': jnp.asarray([jnp.inf, 1.0])}, state, {'w': jnp.zeros((2,))})
  assert {k: int(v) for k, v in guard.metrics(state).items()} == {
      'skipped_steps': 1, 'skipped_in_a_row': 1, 'step_skipped': 1}
  plain = tiny_config(**{'train.weight_decay': 0.0}).train
  assert guard.find(chain.make_optimizer(plain).init({'w': jnp.zeros(2)})) is None


@pytest.mark.parametrize('overrides, match', [
    ({'train.spike_factor': 0.5}, r'train.spike_factor=0.5; valid: 0 \(off\) or > 1'),
    ({"train.skip_nonfinite": True, "train.max_skips": 0}, "train.max_skips=0; valid: >= 1"),
])
def test_bad_guard_settings_are_one_line(tmp_path, tiny_config, overrides, match):
  from sharenet.train import loop
  with pytest.raises(ConfigError, match=match) as e:
    loop.train_and_evaluate(tiny_config(**overrides), str(tmp_path / 'run'))
  assert '\n' not in str(e.value) and not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_kill_and_resume_is_exact_with_the_guard_on(tmp_path):
  """train.py with the guard on (its window of norms in the optimizer state) killed with -9
  after its step-6 checkpoint resumes to the uninterrupted run's losses."""
  resume_matches_uninterrupted(tmp_path, [
      '--config.train.steps=12', '--config.train.checkpoint_every=6',
      '--config.train.log_every=1', '--config.train.skip_nonfinite=True',
      '--config.train.spike_factor=1.5', '--config.train.spike_window=3'], 6, 12)
