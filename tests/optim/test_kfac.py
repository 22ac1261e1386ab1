"""train.optimizer=kfac: the taps' statistics (sharenet/models/curvature.py), K-FAC's update
(sharenet/optim/kfac.py) against a numpy restatement, its wiring in the train step, its
second-order muP's damping and its one-line refusals."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from sharenet.errors import ConfigError
from sharenet.models import curvature, init_variables, layout, param_table
from sharenet.models.layers import Dense
from sharenet.optim import kfac
from sharenet.train import experiment, trainer


def _config(tiny_config, **over):
  return tiny_config(**{'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
                        'model.sharing.num_unique': 2, 'train.optimizer': 'kfac',
                        'train.weight_decay': 0.0, 'train.grad_clip': 0.0,
                        'train.schedule': 'constant', 'train.warmup_steps': 0,
                        'train.lr': 1e-3, **over})


def test_taps_are_the_rows_second_moments():
  """d TAP_IN = x^T x / N and d TAP_OUT = N dy^T dy over the N flattened rows, and the taps
  change neither the value nor the other gradients."""
  dense = Dense((5,), ('embed',), ('mlp',))
  x = jax.random.normal(jax.random.key(0), (3, 4, 6))
  r = jax.random.normal(jax.random.key(1), (3, 4, 5))
  params = dense.init(jax.random.key(2), x)['params']
  taps = {curvature.TAP_IN: jnp.zeros((6, 6)), curvature.TAP_OUT: jnp.zeros((5, 5))}

  def loss(p, t, x):
    return jnp.sum(r * dense.apply({'params': {**p, **t}}, x))

  (d_p, d_t, d_x) = jax.grad(loss, argnums=(0, 1, 2))(nn.unbox(params), taps, x)
  plain_p, plain_x = jax.grad(lambda p, x: jnp.sum(r * dense.apply({'params': p}, x)),
                              argnums=(0, 1))(nn.unbox(params), x)
  x2, r2 = np.asarray(x).reshape(12, 6), np.asarray(r).reshape(12, 5)
  np.testing.assert_allclose(d_t[curvature.TAP_IN], x2.T @ x2 / 12, rtol=1e-5)
  np.testing.assert_allclose(d_t[curvature.TAP_OUT], 12 * r2.T @ r2, rtol=1e-5)
  np.testing.assert_allclose(d_p['kernel'], plain_p['kernel'], rtol=1e-6)
  np.testing.assert_allclose(d_x, plain_x, rtol=1e-6)


def _tap_cotangents(cfg, variables, batch):
  """(the taps' cotangents as the train step gets them, {local path of each tapped kernel:
  its (TAP_IN, TAP_OUT) cotangents, stacked per stored set})."""
  model, table = trainer.DecoderLM(cfg), param_table(cfg)

  def loss(taps):
    return trainer.loss_fn(variables, {trainer.TAPS: taps}, batch, model=model)[0]

  cot = jax.grad(loss)(curvature.zeros(table))
  flat = flatten_dict(cot)
  return cot, {table[k].local: (flat[k[:-1] + (curvature.TAP_IN,)],
                                flat[k[:-1] + (curvature.TAP_OUT,)])
               for k in curvature.tapped(table)}


@pytest.mark.slow
def test_a_tied_sets_statistics_sum_its_layers(tiny_config):
  """A cycle of 2 stored sets over 4 layers: each set's tap cotangents equal the sum over the
  layers using it (l mod 2) of an untied copy's, the same weights per layer
  (layout.to_untied); curvature.statistics then averages A over the 2 uses."""
  c = _config(tiny_config)
  cfg = experiment.sections(c).model
  variables = init_variables(trainer.DecoderLM(cfg), jax.random.key(0))
  untied_cfg, untied_vars = layout.to_untied(variables, cfg)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
  cot, tied = _tap_cotangents(cfg, variables, batch)
  _, untied = _tap_cotangents(untied_cfg, untied_vars, batch)
  assert tied.keys() == untied.keys() and len(tied) >= 4
  for local, (a, g) in tied.items():
    ua, ug = untied[local]
    assert a.shape[0] == 2 and ua.shape[0] == 4
    np.testing.assert_allclose(a, ua[:2] + ua[2:], rtol=2e-5, atol=1e-7)   # set l mod 2
    np.testing.assert_allclose(g, ug[:2] + ug[2:], rtol=2e-5, atol=1e-9)
  table = param_table(cfg)
  flat = flatten_dict(cot)
  for k, (a, g) in curvature.statistics(cot, table).items():
    np.testing.assert_allclose(a, flat[k[:-1] + (curvature.TAP_IN,)] / 2, rtol=1e-6)
    np.testing.assert_allclose(g, flat[k[:-1] + (curvature.TAP_OUT,)], rtol=1e-6)


def _inverse(s, rho):
  w, v = np.linalg.eigh(s.astype(np.float64) + rho * np.eye(len(s)))
  return (v / np.maximum(w, rho)) @ v.T


@pytest.mark.parametrize('graft', ['adam', 'none'])
def test_two_steps_are_the_numpy_update(graft):
  """Two steps of scale_by_kfac on a stack of 2 matrices (4 x 3) against a float64 numpy
  restatement: bias-corrected EMA factors, (A + rho_A I)^-1 M (G + rho_G I)^-1 per set with
  M Adam's bias-corrected first moment, per-factor damping multipliers; graft=adam scales each
  set to Adam's update norm. update_every=2 keeps the first step's inverses at the second."""
  dims = lambda tree: jax.tree.map(lambda _: ((2,), 4, 3), tree)
  rho, decay, b1, b2, eps, mults = 1e-2, 0.9, 0.9, 0.99, 1e-8, (2.0, 0.5)
  tx = kfac.scale_by_kfac(dims, 2, rho, decay, b1, b2, lambda p: eps, graft, lambda p: mults)
  rng = np.random.default_rng(0)
  params = {'params': {'w': jnp.zeros((2, 4, 3))}}
  state = tx.init(params)
  mu = np.zeros((2, 4, 3)); nu = np.zeros((2, 4, 3))
  fa = np.zeros((2, 4, 4)); fg = np.zeros((2, 3, 3))
  for t in (1, 2):
    g = rng.normal(size=(2, 4, 3)).astype(np.float32)
    xa = rng.normal(size=(2, 6, 4)); xg = rng.normal(size=(2, 6, 3))
    a_t = np.einsum('sni,snj->sij', xa, xa) / 6; g_t = np.einsum('sni,snj->sij', xg, xg)
    with kfac.statistics({('params', 'w'): (jnp.asarray(a_t, jnp.float32),
                                             jnp.asarray(g_t, jnp.float32))}):
      u, state = tx.update({'params': {'w': jnp.asarray(g)}}, state, params)
    mu = b1 * mu + (1 - b1) * g; nu = b2 * nu + (1 - b2) * g * g
    m_hat, v_hat = mu / (1 - b1 ** t), nu / (1 - b2 ** t)
    fa = decay * fa + (1 - decay) * a_t; fg = decay * fg + (1 - decay) * g_t
    if t == 1:   # update_every=2: the inverses of step 1 serve step 2
      corr = 1 - decay
      inv_a = [_inverse(fa[s] / corr, rho * mults[0]) for s in range(2)]
      inv_g = [_inverse(fg[s] / corr, rho * mults[1]) for s in range(2)]
    want = np.stack([inv_a[s] @ m_hat[s] @ inv_g[s] for s in range(2)])
    if graft == 'adam':
      adam = m_hat / (np.sqrt(v_hat) + eps)
      for s in range(2):
        want[s] *= np.linalg.norm(adam[s]) / np.linalg.norm(want[s])
    np.testing.assert_allclose(u['params']['w'], want, rtol=2e-4, atol=1e-6)
  leaf = state.factors['params']['w']
  np.testing.assert_allclose(leaf.a, fa, rtol=1e-5)
  np.testing.assert_allclose(leaf.g, fg, rtol=1e-5)


def _kfac_state(opt_state):
  found = []

  def walk(node):
    if isinstance(node, kfac.KfacState):
      found.append(node)
    elif isinstance(node, (tuple, list)):
      for x in node:
        walk(x)
    elif isinstance(node, dict):
      for x in node.values():
        walk(x)
  walk(opt_state)
  assert len(found) == 1
  return found[0]


def test_the_train_step_feeds_each_sets_statistics_to_its_factors(tiny_config):
  """With decay 0 the factors after one train step are that step's statistics: the taps'
  cotangents (per stored set, A over its uses) for every hidden kernel; and the step moves
  only what the optimizer moves (the loss falls over 3 steps)."""
  c = _config(tiny_config, **{'train.kfac.decay': 0.0})
  exp = trainer.setup(c, experiment.validate(c))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  assert kfac.in_state(state.opt_state)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, c.model.vocab_size, (2, 9)),
                      jnp.int32)
  table = param_table(exp.model.cfg)
  cot = jax.grad(lambda t: trainer.loss_fn(state.params, {trainer.TAPS: t}, batch,
                                           model=exp.model)[0])(curvature.zeros(table))
  want = curvature.statistics(cot, table)
  step = jax.jit(trainer.make_train_step(exp))
  new, m0 = step(state, batch)
  factors = {k: v for k, v in flatten_dict(_kfac_state(new.opt_state).factors,
                                           is_leaf=lambda _, x: isinstance(x, kfac.KfacLeaf)
                                           ).items() if isinstance(v, kfac.KfacLeaf)}
  assert set(factors) == set(want) and len(want) >= 4
  for k, (a, g) in want.items():
    np.testing.assert_allclose(factors[k].a, a.reshape(factors[k].a.shape), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(factors[k].g, g.reshape(factors[k].g.shape), rtol=1e-5,
                               atol=1e-10)
  for _ in range(2):
    new, m = step(new, batch)
  assert float(m['loss']) < float(m0['loss'])


def test_an_update_outside_the_train_step_is_one_line(tiny_config):
  c = _config(tiny_config)
  exp = trainer.setup(c, experiment.validate(c))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  with pytest.raises(ConfigError, match='without the step\'s Kronecker statistics') as e:
    exp.tx.update(state.params, state.opt_state, state.params)
  assert '\n' not in str(e.value)


def test_second_order_mup_scales_each_factors_damping(tiny_config):
  """kfac graft=none, muP at twice the base width: every hidden kernel's (rho_A, rho_G)
  multipliers are (fan_in / base fan_in, base fan_out / fan_out) = (2, 1/2) and its LR
  multiplier is 1 (c = 0); grafted K-FAC keeps Adam's muP (LR 1/2, no damping multiplier)."""
  over = {'model.d_model': 64, 'model.mlp_dim': 256, 'model.num_heads': 4,
          'parametrization.kind': 'mup', 'parametrization.base_d_model': 32,
          'parametrization.base_num_heads': 2}
  for graft in ('none', 'adam'):
    c = _config(tiny_config, **{'train.kfac.graft': graft, **over})
    exp = trainer.setup(c, experiment.validate(c))
    table = param_table(exp.model.cfg)
    hidden = curvature.tapped(table)
    assert len(hidden) >= 4
    for path in hidden:
      rule = exp.pz.rules[path]
      if graft == 'none':
        assert rule.damping_mult == (2.0, 0.5) and rule.lr_mult == 1.0, (path, rule)
      else:
        assert rule.damping_mult == 1.0 and rule.lr_mult == 0.5, (path, rule)


@pytest.mark.parametrize('over, match', [
    ({'train.kfac.update_every': 0}, 'update_every=0 must be >= 1'),
    ({'train.kfac.damping': 0.0}, 'damping=0.0 must be > 0'),
    ({'train.kfac.decay': 1.0}, r'decay=1.0 must be in \[0, 1\)'),
    ({'train.kfac.graft': 'sgd'}, "graft='sgd' is unknown; valid: adam, none"),
    ({'train.matrix_roles': 'reader,readout'}, "kfac cannot take \\['readout'\\]"),
    ({'model.moe.kind': 'sigma_moe', 'model.moe.num_experts': 4, 'model.moe.top_k': 2,
      'model.mlp': 'gelu'}, 'expert kernels are stacks outside them'),
    ({'model.norm.kind': 'powernorm'}, 'both leave by cotangents'),
    ({'parametrization.kind': 'umup'}, 'written for AdamW'),
])
def test_bad_kfac_settings_are_one_line(tiny_config, over, match):
  c = _config(tiny_config, **over)
  with pytest.raises(ConfigError, match=match) as e:
    trainer.setup(c, experiment.validate(c))
  assert '\n' not in str(e.value)


PLANS = ('universal', 'sequence', 'middle_cycle', 'sandwich', 'explicit', 'expert_choice',
         'token_choice', 'python_loop', 'flat', 'poisson_lognormal', 'lora', 'kv_first')


@pytest.mark.slow
@pytest.mark.parametrize('plan', PLANS)
def test_every_plans_kernels_get_statistics(plan, tiny_config):
  """Under each sharing plan, lowering and routing (their compatibility-table settings on a
  cycle of 2 sets over 4 layers), every tapped kernel's taps receive nonzero statistics (a
  plan whose runner dropped the taps would train on the damping alone, silently), and each
  A and G is symmetric."""
  from sharenet.config import compat
  overrides = {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
               'model.sharing.num_unique': 2, 'train.optimizer': 'kfac',
               **dict(compat.BY_NAME[plan].overrides)}
  c = tiny_config(**overrides)
  exp = trainer.setup(c, experiment.validate(c))
  variables = init_variables(exp.model, jax.random.key(0))
  batch = jnp.asarray(np.random.default_rng(0).integers(0, c.model.vocab_size, (2, 17)),
                      jnp.int32)
  table = param_table(exp.model.cfg)
  depth = None
  if exp.model.cfg.recurrent_segment is not None:   # sampled depth: a fixed 2 loops here
    depth = jnp.asarray(2, jnp.int32)
  cot = jax.grad(lambda t: trainer.loss_fn(variables, {trainer.TAPS: t}, batch, depth,
                                           model=exp.model)[0])(curvature.zeros(table))
  stats = curvature.statistics(cot, table)
  assert len(stats) >= 4
  for k, (a, g) in stats.items():
    a, g = np.asarray(a), np.asarray(g)
    n = a.shape[:-2]
    tr_a = np.trace(a.reshape((-1,) + a.shape[-2:]), axis1=1, axis2=2)
    tr_g = np.trace(g.reshape((-1,) + g.shape[-2:]), axis1=1, axis2=2)
    assert np.all(tr_a > 0) and np.all(tr_g > 0), (plan, k, n, tr_a, tr_g)
    np.testing.assert_allclose(a, np.swapaxes(a, -1, -2), rtol=1e-5, atol=1e-6)
