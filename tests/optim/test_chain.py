"""Tests for sharenet.optim.chain: LR schedules, decay roles and masks, the optimizer chain."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict

from sharenet.optim import chain
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables, param_table

PEAK, FLOOR = 1e-2, 1e-3


def _train(**kw):
  t = ml_collections.ConfigDict(dict(
      lr=PEAK, schedule='wsd', warmup_steps=10, steps=100, decay_fraction=0.3,
      min_lr_ratio=FLOOR / PEAK, weight_decay=0.1, decay_roles='matrices', b1=0.9, b2=0.95,
      eps=1e-8, grad_clip=0.0))
  t.update(kw)
  return t


def _lr(t, steps):
  sched = chain.lr_schedule(t)
  return np.asarray([float(sched(s)) for s in steps])


@pytest.fixture(scope='module')
def cfg():
  """Every role at once: biases, l2 QK-norm gains (scalars), peri-norm (in and out) gains,
  learned positions, depth-wise LoRA factors in the per-layer collection."""
  return ModelConfig(vocab_size=64, d_model=16, num_layers=2, num_heads=2, mlp_dim=24, remat='none',
                     norm=dict(kind='layernorm', placement='peri', qk_norm='l2'),
                     sharing=dict(scheme='cycle', num_unique=1,
                                  lora_rank=2), reader_bias=True, position='learned', max_len=16)


@pytest.fixture(scope='module')
def variables(cfg):
  return jax.jit(lambda: init_variables(DecoderLM(cfg), jax.random.key(0)))()


@pytest.fixture(scope='module')
def table(cfg):
  return param_table(cfg)


# ---- schedules -----------------------------------------------------------------------------

def test_wsd_warms_up_holds_then_decays_linearly_to_min_lr():
  lr = _lr(_train(), [0, 5, 10, 40, 70, 71, 85, 100, 150])
  # decay = 0.3 * 100 steps, so the stable phase ends at step 70.
  want = [0.0, PEAK / 2, PEAK, PEAK, PEAK, PEAK - (PEAK - FLOOR) / 30, (PEAK + FLOOR) / 2,
          FLOOR, FLOOR]
  np.testing.assert_allclose(lr, want, rtol=1e-5)


def test_cosine_warms_up_then_reaches_min_lr_at_the_last_step():
  lr = _lr(_train(schedule='cosine'), [0, 5, 10, 55, 100, 120])
  # The cosine's midpoint is halfway between warm-up end and the last step.
  np.testing.assert_allclose(lr, [0.0, PEAK / 2, PEAK, (PEAK + FLOOR) / 2, FLOOR, FLOOR],
                             rtol=1e-5)
  assert np.all(np.diff(_lr(_train(schedule='cosine'), range(10, 101))) < 0)


def test_constant_holds_the_peak_after_warmup():
  np.testing.assert_allclose(_lr(_train(schedule='constant'), [0, 5, 10, 99, 100, 500]),
                             [0.0, PEAK / 2, PEAK, PEAK, PEAK, PEAK], rtol=1e-6)
  # No warm-up: the very first step already uses the peak.
  np.testing.assert_allclose(_lr(_train(schedule='constant', warmup_steps=0), [0, 1]),
                             [PEAK, PEAK], rtol=1e-6)


def test_min_lr_ratio_sets_the_end_value():
  for schedule in ('wsd', 'cosine'):
    lr = _lr(_train(schedule=schedule, min_lr_ratio=0.0), [100])
    assert lr[0] == pytest.approx(0.0, abs=1e-12), schedule
    lr = _lr(_train(schedule=schedule, min_lr_ratio=0.5), [100])
    assert lr[0] == pytest.approx(PEAK / 2, rel=1e-5), schedule


def test_decay_fraction_moves_the_start_of_the_decay():
  lr = _lr(_train(decay_fraction=0.5), [49, 50, 51])
  assert lr[0] == lr[1] == pytest.approx(PEAK) and lr[2] < PEAK


def test_unknown_schedule_is_a_one_line_config_error():
  with pytest.raises(ConfigError, match=r"train.schedule='linear' is unknown; valid: wsd, "
                     r'cosine, constant') as e:
    chain.lr_schedule(_train(schedule='linear'))
  assert '\n' not in str(e.value)


# ---- decay roles and masks -----------------------------------------------------------------

def test_decay_roles_parses_a_comma_list_of_groups():
  assert chain.decay_roles(_train()) == chain.DECAY_GROUPS['matrices']
  assert chain.decay_roles(_train(decay_roles=' matrices , norm_out')) == (
      *chain.DECAY_GROUPS['matrices'], 'norm_out')
  assert chain.decay_roles(_train(decay_roles='')) == ()
  t = _train()
  del t['decay_roles']
  assert chain.decay_roles(t) == chain.DECAY_GROUPS['matrices']   # absent: matrices


def test_unknown_decay_group_is_a_one_line_config_error():
  with pytest.raises(ConfigError, match=r"train.decay_roles: 'gains' is unknown; valid: "
                     r'matrices, norm_in') as e:
    chain.decay_roles(_train(decay_roles='matrices,gains'))
  assert '\n' not in str(e.value)


MATRICES = ('kernel', 'embedding', 'pos_embed', 'lora_a', 'lora_b')


@pytest.mark.slow
def test_default_mask_decays_matrices_only(variables, table):
  mask = flatten_dict(chain.decay_mask(variables, table))
  flat = flatten_dict(variables)
  assert mask.keys() == flat.keys()
  assert {p[0] for p, m in mask.items() if m} == {'params', 'per_layer'}   # LoRA is decayed
  for path, m in mask.items():
    assert m == (path[-1] in MATRICES), path
  names = {p[-1] for p, m in mask.items() if not m}
  assert names == {'scale', 'bias', 'qk_scale'}


def test_norm_in_and_norm_out_gains_are_separable(variables, table):
  def decayed(group):
    roles = chain.decay_roles(_train(decay_roles=group))
    return {p[-2] for p, m in flatten_dict(chain.decay_mask(variables, table, roles)).items()
            if m}
  assert decayed('norm_in') == {'attn_norm', 'mlp_norm'}
  assert decayed('norm_out') == {'attn_out_norm', 'mlp_out_norm', 'final_norm'}
  assert decayed('scalar') == {'attn'}                                  # attn/qk_scale
  assert decayed('bias') == {'q', 'k', 'v', 'wi_gate', 'wi_up', 'readout'}


@pytest.mark.parametrize('group', ['matrices', 'norm_out,bias'])
def test_optimizer_decays_exactly_the_masked_leaves(variables, table, group):
  """With a zero gradient Adam's step is 0, so the update is -lr * wd * p on decayed leaves."""
  t = _train(schedule='constant', warmup_steps=0, decay_roles=group)
  tx = chain.make_optimizer(t, table=table)
  zeros = jax.tree.map(jnp.zeros_like, variables)
  u, _ = jax.jit(tx.update)(zeros, tx.init(variables), variables)
  mask = flatten_dict(chain.decay_mask(variables, table, chain.decay_roles(t)))
  assert any(mask.values()) and not all(mask.values())
  for path, x in flatten_dict(u).items():
    p = flatten_dict(variables)[path]
    want = -PEAK * 0.1 * p if mask[path] else jnp.zeros_like(p)
    np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-12, err_msg=str(path))


# ---- gradient clipping and the Adam core ---------------------------------------------------

def _tree(seed, scale=1.0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {'w': scale * jax.random.normal(k1, (8, 4)), 'b': scale * jax.random.normal(k2, (4,))}


def _updates(tx, grads):
  params = _tree(99)
  state, out = tx.init(params), []
  for g in grads:
    u, state = tx.update(g, state, params)
    out.append(u)
  return out


def _norm(tree):
  return float(optax.global_norm(tree))


@pytest.mark.slow
def test_grad_clip_bounds_the_gradient_that_adam_sees():
  """Adam is scale-invariant per step, so clipping shows in a sequence of different norms: with
  clip 1 the updates equal those of the unit-norm gradients, without clip they do not."""
  big = [_tree(0, 30.0), _tree(1, 300.0), _tree(2, 3.0)]
  assert all(_norm(g) > 1.0 for g in big)
  unit = [jax.tree.map(lambda x, n=_norm(g): x / n, g) for g in big]
  clipped = _updates(chain.make_optimizer(_train(grad_clip=1.0, weight_decay=0.0)), big)
  reference = _updates(chain.make_optimizer(_train(grad_clip=0.0, weight_decay=0.0)), unit)
  unclipped = _updates(chain.make_optimizer(_train(grad_clip=0.0, weight_decay=0.0)), big)
  for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(reference)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(unclipped[-1]), jax.tree.leaves(clipped[-1]))) > 1e-5


def test_grad_clip_leaves_small_gradients_alone():
  small = [_tree(0, 0.01), _tree(1, 0.02)]
  assert all(_norm(g) < 1.0 for g in small)
  on = _updates(chain.make_optimizer(_train(grad_clip=1.0, weight_decay=0.0)), small)
  off = _updates(chain.make_optimizer(_train(grad_clip=0.0, weight_decay=0.0)), small)
  for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
    np.testing.assert_array_equal(a, b)


def test_adam_with_tree_eps_equals_optax_with_one_eps():
  grads = [_tree(s) for s in range(4)]
  mine = _updates(chain.scale_by_adam_tree_eps(0.9, 0.95, lambda path: 1e-3), grads)
  ref = _updates(optax.scale_by_adam(0.9, 0.95, eps=1e-3), grads)
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)


def test_adam_tree_eps_is_per_leaf():
  grads = [_tree(s, 1e-2) for s in range(3)]
  eps = {('w',): 1.0, ('b',): 1e-8}   # a huge eps on 'w' damps only 'w'
  mine = _updates(chain.scale_by_adam_tree_eps(0.9, 0.95, lambda path: eps[path]), grads)[-1]
  for name, e in (('w', 1.0), ('b', 1e-8)):
    ref = _updates(optax.scale_by_adam(0.9, 0.95, eps=e), grads)[-1]
    np.testing.assert_array_equal(mine[name], ref[name])
  assert float(jnp.max(jnp.abs(mine['w']))) < 0.1 < float(jnp.max(jnp.abs(mine['b'])))


def test_per_leaf_wd_multiplier_scales_decay_only_where_the_mask_decays(variables, table):
  """OptMultipliers.wd: a zero-gradient step decays p by lr * wd * wd_mult on the leaves the
  role mask decays, and by nothing elsewhere, whatever their multiplier; LR multipliers do not
  enter the decay (lr-coupled) and wd / lr_peak replaces wd (independent)."""
  from sharenet.parametrization.rules import OptMultipliers
  ones = jax.tree.map(lambda _: 1.0, variables)
  wd_tree = jax.tree.map(lambda _: 0.25, variables)
  lr_tree = jax.tree.map(lambda _: 3.0, variables)
  zeros = jax.tree.map(jnp.zeros_like, variables)
  for independent, per_step in ((False, PEAK * 0.1 * 0.25), (True, 0.1 * 0.25)):
    t = _train(schedule='constant', warmup_steps=0)
    tx = chain.make_optimizer(t, multipliers=OptMultipliers(lr_tree, ones, independent, wd_tree),
                              table=table)
    u, _ = jax.jit(tx.update)(zeros, tx.init(variables), variables)
    mask = flatten_dict(chain.decay_mask(variables, table))
    for path, x in flatten_dict(u).items():
      p = flatten_dict(variables)[path]
      want = -per_step * p if mask[path] else jnp.zeros_like(p)
      np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-12, err_msg=str(path))
