"""Dynamic layer tying (sharenet/train/dynamic_tying.py, arXiv:2401.12819): the plans as
per-layer actions, the bandit's rule, the train state carried over set by set, and the train
loop re-choosing its plan and resuming exactly."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import resume_matches_uninterrupted

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM
from sharenet.train import dynamic_tying as dt
from sharenet.train import experiment, trainer


def test_actions_make_plans_and_sets_start_from_their_first_layers_sets():
  # layer 1 copies 0, layer 2 trains its own, layer 3 copies 1 (so 0): sets by first use
  assert dt.pattern_of((0, 0, 2, 1)) == (0, 0, 1, 0)
  assert dt.pattern_of((0, 1, 2, 3)) == (0, 1, 2, 3) and dt.pattern_of((0, 0, 1, 2)) == (0,) * 4
  assert dt.actions_of((0, 1, 1, 0)) == (0, 1, 1, 0) and dt.actions_of((0, 0, 1, 0)) == (0, 0, 2, 0)
  for p in [(0, 1, 1, 0), (0, 0, 1, 2), (0, 1, 0, 2)]:
    assert dt.pattern_of(dt.actions_of(p)) == p
  # new plan (0,1,1,2) from (0,1,0,1): set 0 <- layer 0's set 0; set 1 <- layer 1's set 1;
  # set 2 <- layer 3's set 1 (a layer that unties keeps the weights it was tied to)
  np.testing.assert_array_equal(dt.sources((0, 1, 0, 1), (0, 1, 1, 2)), [0, 1, 1])
  np.testing.assert_array_equal(dt.sources((0, 1, 2, 3), (0, 0, 1, 0)), [0, 2])
  with pytest.raises(ValueError, match='layer 2: action 3'):
    dt.pattern_of((0, 0, 3))


class _Settings:
  def __init__(self, epsilon=0.0, step_size=0.5, max_sets=0):
    self.epsilon, self.step_size, self.max_sets = epsilon, step_size, max_sets


def test_the_bandit_values_arms_by_centred_loss_drops_and_keeps_its_arm_on_ties():
  b = dt.Bandit(_Settings(), seed=0, pattern=(0, 1, 2, 3))
  assert b.observe(5.0) is None                    # the first interval starts
  assert b.choose() == (0, 1, 2, 3)                # all values 0: every layer keeps its arm
  assert b.observe(4.0) == 0.0                     # drop 1.0, the baseline starts at it
  assert b.baseline == 1.0 and b.values[3] == [0, 0, 0, 0.0]
  b.actions = [0, 0, 2, 1]                         # the next interval holds other arms
  assert b.observe(3.5) == -0.5                    # drop 0.5 against baseline 1.0: (0.5-1)/1
  assert b.baseline == 0.75                        # 1 + 0.5 (0.5 - 1)
  assert b.values[1] == [-0.5, 0.0] and b.values[3] == [0.0, -0.5, 0.0, 0.0]
  assert b.counts[3] == [0, 1, 0, 1]
  assert b.observe(2.0) == 1.0                     # drop 1.5 against 0.75: (1.5-0.75)/0.75
  assert b.values[1][0] == -0.5 + 0.5 * (1.0 + 0.5)
  assert b.choose() == dt.pattern_of((0, 0, 2, 1))   # greedy: layer 1 copies 0 (0.25 > 0)
  state = json.loads(json.dumps(b.state()))
  again = dt.Bandit.from_state(_Settings(), 0, state)
  assert again.state() == b.state() and again.pattern == b.pattern


def test_exploration_draws_and_the_set_cap():
  """epsilon=1: every layer's arm is the decision's numpy draw (seed, decision index); the
  cap ties the own-weight layers valued least above their best copy until it holds."""
  b = dt.Bandit(_Settings(epsilon=1.0), seed=7, pattern=(0, 1, 2, 3))
  b.decisions = 3
  rng = np.random.default_rng([7, 3])
  want = [0]
  for i in range(1, 4):
    rng.random()
    want.append(int(rng.integers(0, i + 1)))
  assert b.choose() == dt.pattern_of(want) and b.decisions == 4
  capped = dt.Bandit(_Settings(max_sets=2), seed=0, pattern=(0, 1, 2, 3))
  capped.values = [[0.0], [-1.0, 0.5], [0.0, 0.0, 0.2], [0.3, 0.0, 0.0, 0.4]]
  # own-weight gaps: layer 1 1.5, layer 2 0.2, layer 3 0.1: layer 3 is tied first (to 0)
  # then layer 2 (0.2 above its best copy, layer 0): plan (0, 1, 0, 0)
  assert capped.choose() == (0, 1, 0, 0) and capped.actions == [0, 1, 0, 0]


def _explicit(tiny_config, pattern, **over):
  c = tiny_config(**{'model.num_layers': 4, 'model.sharing.scheme': 'explicit',
                     'model.sharing.pattern': pattern, 'train.batch_size': 2,
                     'train.seq_len': 16, **over})
  return c, trainer.setup(c, experiment.validate(c))


def _state_after_a_step(c, exp, batch):
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  step = jax.jit(trainer.make_train_step(exp, 1))
  return step(state, batch)[0]


@pytest.mark.slow
def test_the_carried_state_is_the_donors_sets_and_computes_the_untied_restatement(tiny_config):
  """A trained (one step: Adam's moments are not zero) plan (0,1,0,1) carried to (0,0,1,2):
  every per-set leaf is the old one gathered by the sources, the rest is unchanged, and the
  new plan's model computes what an untied model holding, per layer, the weights of the set
  its new set came from computes."""
  old, new = (0, 1, 0, 1), (0, 0, 1, 2)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
  c, exp = _explicit(tiny_config, '0,1,0,1')
  state = _state_after_a_step(c, exp, batch)
  abstract = lambda p: (lambda e: trainer.abstract_state(e.model, e.tx, e.tr, e.pz))(
      _explicit(tiny_config, dt.pattern_string(p))[1])
  per_set = dt.per_set_leaves(abstract, 4)
  flags = jax.tree.leaves(per_set)
  assert set(flags) == {0, 1} and sum(flags) == 3 * 9   # params, mu, nu of 9 block leaves
  src = dt.sources(old, new)
  # new set 0 <- layer 0's set 0, set 1 <- layer 2's set 0, set 2 <- layer 3's set 1
  np.testing.assert_array_equal(src, [0, 0, 1])
  moved = dt.carry_over(state, per_set, src)
  for a, b, m in zip(jax.tree.leaves(state), jax.tree.leaves(moved), flags):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(b, a[[0, 0, 1]] if m else a)
  _, new_exp = _explicit(tiny_config, '0,0,1,2')
  tokens = batch[:, :-1]
  got = new_exp.model.apply(trainer.effective_params(moved, new_exp.tr, new_exp.pz), tokens)
  # the restatement: untied, layer l holding old set old[first layer of new[l]]
  _, untied = _explicit(tiny_config, '0,1,2,3')
  per_layer = [old[dt.actions_of(new)[l]] for l in range(4)]
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x[np.asarray(per_layer)] if 'segment_0' in jax.tree_util.keystr(path) else x,
      state.params)
  want = untied.model.apply(trainer.effective_params(state.replace(params=params), untied.tr,
                                                     untied.pz), tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(got), np.asarray(exp.model.apply(
      trainer.effective_params(state, exp.tr, exp.pz), tokens)), atol=1e-3)


def test_shampoo_blocks_move_with_their_sets(tiny_config):
  """Blocked Shampoo flattens the stored sets and each matrix's block grid into one axis
  (sets outermost): a set's m blocks move together."""
  c, exp = _explicit(tiny_config, '0,1,1,0', **{'train.optimizer': 'shampoo',
                                                 'train.shampoo.block_size': 16})
  abstract = lambda p: (lambda e: trainer.abstract_state(e.model, e.tx, e.tr, e.pz))(
      _explicit(tiny_config, dt.pattern_string(p), **{'train.optimizer': 'shampoo',
                                                        'train.shampoo.block_size': 16})[1])
  per_set = dt.per_set_leaves(abstract, 4)
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  leaves = jax.tree_util.tree_leaves_with_path(state)
  ms = jax.tree.leaves(per_set)
  blocked = [(p, x, m) for (p, x), m in zip(leaves, ms) if m > 1]
  assert blocked, 'no leaf with several blocks per set'
  # distinct values per block, so a wrong gather shows
  x = jnp.arange(blocked[0][1].size, dtype=jnp.float32).reshape(blocked[0][1].shape)
  path, _, m = blocked[0]
  moved = dt.carry_over({'x': x}, {'x': m}, np.asarray([1, 1, 0]))['x']
  sets = np.asarray(x).reshape((2, m) + x.shape[1:])
  np.testing.assert_array_equal(np.asarray(moved), sets[[1, 1, 0]].reshape((3 * m,) + x.shape[1:]))


@pytest.mark.parametrize('over, match', [
    ({'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2},
     "re-chooses an explicit plan, and model.sharing.scheme='cycle'"),
    ({'train.tying.every': 40}, 'makes no decision in train.steps=40'),
    ({'train.tying.max_sets': 1}, 'stores 2 sets, above train.tying.max_sets=1'),
    ({'train.tying.epsilon': 1.5}, r'train.tying.epsilon=1.5 must be in \[0, 1\]'),
    ({'train.tying.step_size': 0.0}, r'must be in \(0, 1\]'),
    ({'model.sharing.lora_rank': 2}, 'LoRA on the shared layers only comes and goes'),
    ({'model.sharing.pattern': '1,0,0,1'}, "does not number its sets by first use.*'0,1,1,0'"),
])
def test_bad_tying_settings_are_one_line(tiny_config, over, match):
  c = tiny_config(**{'model.num_layers': 4, 'model.sharing.scheme': 'explicit',
                     'model.sharing.pattern': '0,1,1,0', 'train.tying.every': 5, **over})
  with pytest.raises(ConfigError, match=match) as e:
    experiment.validate(c)
  assert '\n' not in str(e.value)


TYING = ['--config.model.num_layers=4', '--config.model.sharing.scheme=explicit',
         '--config.model.sharing.pattern=0,1,0,1', '--config.train.tying.every=4',
         '--config.train.tying.epsilon=0.5', '--config.train.tying.max_sets=3',
         '--config.train.tying.eval_tokens=512', '--config.train.eval_batch_size=8']


def _decisions(workdir):
  from sharenet.train.metrics import read_metrics
  return {r['step']: r for r in read_metrics(workdir) if 'tying/loss' in r}


@pytest.mark.slow
def test_kill_and_resume_across_plan_changes_is_exact(tmp_path):
  """train.py with dynamic tying, killed with -9 after its step-6 checkpoint (between the
  decisions at 4 and 8), resumes to the uninterrupted run's losses and decisions; the plan
  changed after the checkpoint too, and eval.py reads the final plan from the workdir."""
  flags = TYING + ['--config.train.steps=16', '--config.train.checkpoint_every=6',
                   '--config.train.log_every=1']
  ref, killed = resume_matches_uninterrupted(tmp_path, flags, 6, 16)
  want, got = _decisions(ref), _decisions(killed)
  assert sorted(want) == [0, 4, 8, 12]
  assert any(want[s]['tying/changed'] for s in (8, 12)), 'no plan change after the checkpoint'
  assert all(want[s]['tying/sets'] <= 3 for s in want)
  assert [got[s] for s in (8, 12)] == [want[s] for s in (8, 12)]
  from sharenet.main import eval_workdir
  from sharenet.train.metrics import read_metrics
  final = [r for r in read_metrics(ref) if 'eval_loss' in r][-1]['eval_loss']
  assert eval_workdir.evaluate_workdir(ref)['eval_loss'] == final
  with open(os.path.join(ref, 'config.json')) as f:
    summary = json.load(f)
  from sharenet.checkpoint import orbax_io
  mngr = orbax_io.manager(ref, 3, async_save=False)
  saved = dt.saved_pattern(orbax_io.saved_config(mngr, 16))
  mngr.close()
  assert tuple(summary['plan_index']) == saved


@pytest.mark.slow
def test_an_older_checkpoint_of_another_plan_restores(tmp_path, tiny_config, capsys):
  """The newest checkpoint unreadable: the previous one, written under another plan, is
  restored with its own plan and controller, and eval.py --step reads each checkpoint with its
  plan."""
  from sharenet.checkpoint import orbax_io
  from sharenet.main import eval_workdir
  from sharenet.train import loop
  over = {'model.num_layers': 4, 'model.sharing.scheme': 'explicit',
          'model.sharing.pattern': '0,1,0,1', 'train.tying.every': 2,
          'train.tying.epsilon': 1.0, 'train.tying.eval_tokens': 512,
          'train.eval_batch_size': 8, 'train.steps': 8, 'train.checkpoint_every': 4,
          'train.log_every': 4}
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(tiny_config(**over), workdir)
  mngr = orbax_io.manager(workdir, 3, async_save=False)
  plans = {s: dt.saved_pattern(orbax_io.saved_config(mngr, s)) for s in (4, 8)}
  mngr.close()
  assert plans[4] != plans[8], plans
  for s in (4, 8):   # each checkpoint evaluates with its own plan
    assert np.isfinite(eval_workdir.evaluate_workdir(workdir, step=s)['eval_loss'])
  state_dir = os.path.join(workdir, 'checkpoints', '8', 'state')
  for root, _, files in os.walk(state_dir):
    for name in files:
      with open(os.path.join(root, name), 'wb') as f:
        f.write(b'')
  capsys.readouterr()
  loop.train_and_evaluate(tiny_config(**{**over, 'train.steps': 10}), workdir)
  out = capsys.readouterr().out
  assert 'resumed from checkpoint at step 4' in out
