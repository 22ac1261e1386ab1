"""Scion (sharenet/optim/scion.py): one step against a numpy restatement of the reference's
update, per role, its muP's multipliers, train.lr_groups and bad settings."""
import jax
import numpy as np
import pytest

from sharenet.errors import ConfigError
from sharenet.models import param_table
from sharenet.optim import chain
from sharenet.train import experiment, trainer

NS = (3.4445, -4.7750, 2.0315)   # the quintic Newton-Schulz coefficients (optax's, Muon's)


def _orthogonalised(x, steps=5):
  """The reference's zeropower_via_newtonschulz5 (scion.py), in float64."""
  tall = x.shape[0] > x.shape[1]
  X = x.T if tall else x
  X = X / (np.linalg.norm(X) + 1e-8)
  a, b, c = NS
  for _ in range(steps):
    A = X @ X.T
    X = a * X + (b * A + c * A @ A) @ X
  return X.T if tall else X


def _lmo(info, g, scaled):
  """Each role's LMO (the reference's norms, module docstring of scion.py), per stored set."""
  s = info.num_stack
  if info.role in ('reader', 'writer', 'router', 'lora') and len(info.axes) == s + info.num_in:
    axes = tuple(range(s, g.ndim))   # stacked fan-in vectors: fan_in x 1 matrices
    out = g / (np.sqrt(np.sum(g ** 2, axis=axes, keepdims=True)) + 1e-8)
    return out / np.sqrt(np.prod(g.shape[s:])) if scaled else out
  if info.role in ('reader', 'writer', 'router', 'lora'):
    mats = g.reshape((-1, info.fan_in, info.fan_out))
    out = np.stack([_orthogonalised(m) for m in mats]).reshape(g.shape)
    return out * np.sqrt(info.fan_out / info.fan_in) if scaled else out
  if info.role in ('embedding', 'pos_embed'):
    axes = tuple(range(s + 1, g.ndim))
    norm = (np.sqrt(np.mean(g ** 2, axis=axes, keepdims=True)) if scaled
            else np.sqrt(np.sum(g ** 2, axis=axes, keepdims=True)))
    return g / (norm + 1e-8)
  if info.role == 'readout':
    return np.sign(g) / info.fan_in if scaled else np.sign(g)
  axes = tuple(range(s, g.ndim))
  return g / (np.sqrt(np.mean(g ** 2, axis=axes, keepdims=True)) + 1e-8)


def _config(tiny_config, kind, **over):
  return tiny_config(**{'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
                        'model.sharing.num_unique': 2, 'train.optimizer': 'scion',
                        'train.weight_decay': 0.0, 'train.grad_clip': 0.0,
                        'train.schedule': 'constant', 'train.warmup_steps': 0,
                        'train.lr': 1e-3, 'parametrization.kind': kind, **over})


@pytest.mark.slow
@pytest.mark.parametrize('kind, constrained, over', [
    ('mup', True, {}), ('sp', False, {}),
    ('mup', True, {'model.moe.kind': 'sigma_moe', 'model.moe.num_experts': 4,
                   'model.moe.top_k': 2, 'model.mlp': 'gelu'})])
def test_one_step_is_the_reference_update(tiny_config, kind, constrained, over):
  """Cycle of 2 stored sets (each set's matrices orthogonalised apart), two steps from zero
  momentum: m <- (1 - a) m + a g, then W <- (1 - lr) W - lr rho lmo(m) (constrained) or
  W - lr rho lmo(m), every leaf (the second step reads the momentum: every LMO is
  scale-free)."""
  c = _config(tiny_config, kind, **{'train.scion.constrained': constrained,
                                    'train.scion.radius': 2.0, 'train.scion.output_radius': 30.0,
                                    'train.scion.momentum': 0.3, **over})
  exp = trainer.setup(c, experiment.validate(c))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  leaves, tree = jax.tree.flatten(state.params)
  rng = np.random.default_rng(0)
  draw = lambda: jax.tree.unflatten(tree, [rng.standard_normal(x.shape).astype(np.float32)
                                           for x in leaves])
  g1, g2 = draw(), draw()
  u1, opt_state = exp.tx.update(g1, state.opt_state, state.params)
  params1 = jax.tree.map(lambda p, u: p + u, state.params, u1)
  updates, _ = exp.tx.update(g2, opt_state, params1)
  table = param_table(exp.model.cfg)
  flat_p = dict(jax.tree_util.tree_leaves_with_path(params1))
  flat_g1 = dict(jax.tree_util.tree_leaves_with_path(g1))
  flat_g2 = dict(jax.tree_util.tree_leaves_with_path(g2))
  seen = set()
  for path, u in jax.tree_util.tree_leaves_with_path(updates):
    key = tuple(k.key for k in path)
    info = table[key]
    w = np.asarray(flat_p[path], np.float64)
    m = 0.7 * 0.3 * np.asarray(flat_g1[path], np.float64) + 0.3 * np.asarray(flat_g2[path],
                                                                              np.float64)
    rho = 30.0 if info.role == 'readout' else 2.0
    d = rho * _lmo(info, m, kind == 'mup') + (w if constrained else 0.0)
    np.testing.assert_allclose(np.asarray(u, np.float64), -1e-3 * d, rtol=2e-3, atol=1e-7,
                               err_msg='/'.join(key))
    seen.add(info.role)
  assert {'reader', 'writer', 'embedding', 'readout', 'norm_in'} <= seen, seen
  assert 'router' in seen or not over   # the experts' router: a stack of fan-in vectors


def test_scion_mup_is_the_lmos_on_the_effective_weights(tiny_config):
  """At twice the base width muP keeps its init and forward multipliers; the LR multiplier
  undoes them (the readout: the logits multiplier 1/m_d), so the effective weights take the
  width-scaled LMO's step; under sp every multiplier is 1."""
  c = _config(tiny_config, 'mup', **{'model.d_model': 64, 'model.mlp_dim': 128,
                                     'parametrization.base_d_model': 32})
  exp = trainer.setup(c, experiment.validate(c))
  rules = exp.pz.rules
  assert rules[('params', 'readout', 'kernel')].lr_mult == 2.0
  hidden = [r for r in rules.values() if r.role == 'hidden']
  assert hidden and all(r.lr_mult == 1.0 / r.fwd_mult == 1.0 for r in hidden)
  assert exp.pz.opt_multipliers().scion_scaled
  sp = _config(tiny_config, 'sp')
  assert trainer.setup(sp, experiment.validate(sp)).pz.opt_multipliers() is None


def test_lr_groups_multiply_a_groups_step(tiny_config):
  """train.lr_groups=readout:4,hidden:0.5: the readout's step x4 (its decay too, as a
  per-group LR does in the reference), a hidden kernel's x0.5, the rest unchanged."""
  def step(groups):
    c = _config(tiny_config, 'sp', **{'train.lr_groups': groups})
    exp = trainer.setup(c, experiment.validate(c))
    state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
    grads = jax.tree.map(lambda x: np.ones(x.shape, np.float32), state.params)
    u, _ = exp.tx.update(grads, state.opt_state, state.params)
    return u['params']
  base, grouped = step(''), step('readout:4,hidden:0.5')
  np.testing.assert_allclose(grouped['readout']['kernel'], 4 * base['readout']['kernel'],
                             rtol=1e-6)
  q = lambda t: t['stack']['segment_0']['level']['block']['attn']['q']['kernel']
  np.testing.assert_allclose(q(grouped), 0.5 * q(base), rtol=1e-6)
  np.testing.assert_array_equal(grouped['embed']['embedding'], base['embed']['embedding'])


def test_lr_groups_apply_to_adamw_too(tiny_config):
  """train.lr_groups under plain AdamW (SP): the readout's step doubles."""
  def step(groups):
    c = tiny_config(**{'train.lr_groups': groups, 'train.weight_decay': 0.0,
                       'train.schedule': 'constant', 'train.warmup_steps': 0})
    exp = trainer.setup(c, experiment.validate(c))
    state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
    grads = jax.tree.map(lambda x: np.full(x.shape, 0.5, np.float32), state.params)
    return exp.tx.update(grads, state.opt_state, state.params)[0]['params']
  np.testing.assert_allclose(step('readout:2')['readout']['kernel'],
                             2 * step('')['readout']['kernel'], rtol=1e-6)


@pytest.mark.parametrize('over, match', [
    ({'train.lr_groups': 'output:2'}, "'output:2' names no group"),
    ({'train.lr_groups': 'readout=2'}, 'is not GROUP:MULT'),
    ({'train.lr_groups': 'readout:2', 'model.tie_embeddings': True},
     "group 'readout' names no parameter of this model"),
    ({'train.weight_decay': 0.1}, 'decays every weight by its own step'),
    ({'train.scion.momentum': 0.0}, r'train.scion.momentum=0.0 must be in \(0, 1\]'),
    ({'train.matrix_roles': 'reader'}, 'takes every leaf by its role'),
    ({'parametrization.kind': 'umup'}, 'written for AdamW'),
])
def test_bad_scion_and_group_settings_are_one_line(tiny_config, over, match):
  c = _config(tiny_config, 'sp', **over)
  with pytest.raises(ConfigError, match=match) as e:
    trainer.setup(c, experiment.validate(c))
  assert '\n' not in str(e.value)
