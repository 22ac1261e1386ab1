"""Parametrization presets: rule tables, base-width equivalence, tied gradients, sharding."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict

from sharenet import optim, parametrization as P
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables, layout, param_table
from sharenet.parametrization import KINDS

D0 = 32


def tiny(d=32, **kw):
  base = dict(vocab_size=64, d_model=d, num_layers=4, num_heads=4, mlp_dim=3 * d // 2,
              scheme='cycle', repeats=2, remat='none')
  base.update(kw)
  return ModelConfig(**base).validate()


def train_cfg(**kw):
  t = ml_collections.ConfigDict(dict(
      lr=1e-2, schedule='constant', warmup_steps=0, steps=10, decay_fraction=0.3, min_lr_ratio=0.0,
      weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8, grad_clip=1.0))
  t.update(kw)
  return t


def tokens(B=2, T=12, seed=0, vocab=64):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)


def loss_fn(params, model, fwd, toks):
  logits = model.apply(fwd(params), toks[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()


def run_steps(cfg, settings, n_steps=3, seed=0):
  """(init params, params after n_steps) for a preset; fixed data."""
  pz = P.Parametrization(cfg, P.Settings(**settings))
  model = DecoderLM(pz.cfg)
  tx = optim.make_optimizer(train_cfg(), multipliers=pz.opt_multipliers(), table=param_table(cfg))
  p0 = pz.init(init_variables(model, jax.random.key(seed)))

  @jax.jit
  def step(p, s, toks):
    g = jax.grad(loss_fn)(p, model, pz.forward, toks)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p, s = p0, tx.init(p0)
  for i in range(n_steps):
    p, s = step(p, s, tokens(seed=i))
  return p0, p


# ---- analytic rule tables ---------------------------------------------------------------

def expected(kind, name, path, d, cfg, m_L=1.0, alpha=1.0, loop='none', R=2):
  """Independent restatement of the preset tables (TP5, u-muP, Lingle, CompleteP and the
  looped residual scaling of docs/references.md)."""
  md = d / D0
  fan_in = {'embedding': 64, 'wo': cfg.mlp_dim}.get(name, d)
  hidden = name in ('q', 'k', 'v', 'o', 'wi_gate', 'wi_up', 'wo')
  trunk = 'stack' in path
  e = dict(init=1.0, fwd=1.0, lr=1.0, eps=1.0)
  sp_std = {'embedding': 1.0, 'readout': d ** -0.5}.get(name, fan_in ** -0.5 if hidden else None)
  if kind in ('mup', 'completep', 'mup_table3'):
    if hidden:
      e['lr'] = 1 / md
    if name == 'readout':
      e.update(init=md ** 0.5) if kind != 'mup_table3' else e.update(init=md ** -0.5, lr=1 / md)
  if kind == 'umup':
    L = cfg.num_layers
    if name == 'embedding':
      e.update(lr=d ** -0.5)
    elif hidden:
      e.update(init=fan_in ** 0.5, fwd=fan_in ** -0.5, lr=fan_in ** -0.5 * L ** -0.5)
    elif name == 'readout':
      e.update(init=d ** 0.5, fwd=1 / d)
    elif trunk and name.endswith('norm'):
      e.update(lr=L ** -0.5)
  if kind == 'completep':
    if hidden:
      e.update(lr=e['lr'] * m_L ** (alpha - 1), eps=1 / (md * m_L ** alpha))
    elif trunk and name.endswith('norm'):
      e.update(lr=e['lr'] * m_L ** (alpha - 1))
    if name in ('o', 'wo'):
      e['fwd'] *= m_L ** -alpha
  if loop != 'none' and name in ('o', 'wo'):
    e['fwd'] *= 1 / R if loop == 'inv_R' else R ** -0.5
  e['std'] = None if sp_std is None else sp_std * e['init']
  return e


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('loop', ['none', 'inv_R', 'inv_sqrt_R'])
def test_rule_table_matches_analytic(kind, loop):
  for d in (32, 64, 128):
    cfg = tiny(d, num_unique=2, repeats=2)
    settings = dict(kind=kind, base_d_model=D0, loop_rule=loop, base_depth=1, depth_alpha=0.5)
    pz = P.Parametrization(cfg, P.Settings(**settings))
    seen = set()
    for path, r in pz.rules.items():
      name = path[-2] if path[-1] in ('kernel', 'scale') else path[-1]
      e = expected(kind, name, path, d, cfg, m_L=2.0, alpha=0.5, loop=loop)
      got = dict(init=r.init_scale, fwd=r.fwd_mult, lr=r.lr_mult, eps=r.eps_mult, std=r.init_std)
      for k, v in e.items():
        assert got[k] == (None if v is None else pytest.approx(v, rel=1e-12)), (d, path, k)
      assert r.wd_mult == (1.0 if path[-1] in ('kernel', 'embedding') else 0.0)
      assert 'layers' not in r.axes or r.fan_in_mult in (1.0, d / D0)
      seen.add(name)
    assert {'q', 'o', 'wo', 'embedding', 'readout', 'attn_norm', 'final_norm'} <= seen
    dh, dh0 = d // 4, D0 // 4
    attn = {'sp': 0.0, 'umup': 1 / dh}.get(kind, dh0 ** 0.5 / dh)
    assert pz.cfg.attn_scale == pytest.approx(attn, rel=1e-12)
    assert pz.cfg.logits_mult == (D0 / d if kind in ('mup', 'completep') else 1.0)


def test_tied_embeddings_mup_rules():
  for d in (32, 128):
    pz = P.Parametrization(tiny(d, tie_embeddings=True), P.Settings('mup', base_d_model=D0))
    emb = pz.rules[('params', 'embed', 'embedding')]
    assert (emb.role, emb.init_std, emb.lr_mult, emb.fwd_mult) == ('embedding', 1.0, 1.0, 1.0)
    assert pz.cfg.logits_mult == D0 / d and not any('readout' in p for p in pz.rules)


def test_init_statistics_follow_the_table():
  """Empirical std of the rescaled init matches init_std (hidden ~ fan_in^-1/2, readout const)."""
  for d in (32, 128):
    cfg = tiny(d)
    pz = P.Parametrization(cfg, P.Settings('mup', base_d_model=D0))
    v = jax.jit(lambda: pz.init(init_variables(DecoderLM(pz.cfg), jax.random.key(0))))()
    for path, x in flatten_dict(v).items():
      r = pz.rules[path]
      if r.init_std is not None and x.size > 500:
        assert abs(float(jnp.std(x)) / r.init_std - 1) < 0.1, path
    ro = float(jnp.std(v['params']['readout']['kernel']))
    assert abs(ro - D0 ** -0.5) < 0.1 * D0 ** -0.5


# ---- base width == SP bit for bit -------------------------------------------------------

@pytest.mark.parametrize('kind', ['mup', 'mup_table3', 'completep'])
def test_base_width_equals_sp_bitwise(kind):
  cfg = tiny(D0)
  sp0, sp3 = run_steps(cfg, dict(kind='sp'))
  mu0, mu3 = run_steps(cfg, dict(kind=kind, base_d_model=D0))
  for a, b in zip(jax.tree.leaves(sp0), jax.tree.leaves(mu0)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(sp3), jax.tree.leaves(mu3)):
    np.testing.assert_array_equal(a, b)
  # Not vacuous: half the width as base changes the updates.
  _, half3 = run_steps(cfg, dict(kind=kind, base_d_model=D0 // 2))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(sp3),
                                                      jax.tree.leaves(half3)))


def test_unit_multiplier_chain_equals_adamw():
  cfg = tiny(D0)
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  ones = jax.tree.map(lambda _: 1.0, v)
  table = param_table(cfg)
  mult = P.OptMultipliers(ones, ones, False)
  t = train_cfg(schedule='wsd', warmup_steps=2)
  adamw = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                      optax.adamw(optim.lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                                  weight_decay=t.weight_decay,
                                  mask=lambda p: optim.decay_mask(p, table)))
  outs = []
  # The injected peak LR (a float32 in the optimizer state) rounds like optax's python float.
  for tx in (adamw, optim.make_optimizer(t, table=table),
             optim.make_optimizer(t, multipliers=mult, table=table)):

    @jax.jit
    def step(p, s, toks):
      g = jax.grad(loss_fn)(p, DecoderLM(cfg), lambda x: x, toks)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    p, s = v, tx.init(v)
    for i in range(t.steps):   # warmup, stable and decay
      p, s = step(p, s, tokens(seed=i))
    outs.append(p)
  for out in outs[1:]:
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(out)):
      np.testing.assert_array_equal(a, b)


def test_independent_weight_decay_does_not_move_with_lr():
  """wd_mode=independent: the per-step decay factor is the same for any base LR."""
  cfg = tiny(64)
  pz = P.Parametrization(cfg, P.Settings('mup', base_d_model=D0, wd_mode='independent'))
  v = init_variables(DecoderLM(pz.cfg), jax.random.key(0))
  zeros = jax.tree.map(jnp.zeros_like, v)
  decays = []
  for lr in (1e-3, 1e-1):
    tx = optim.make_optimizer(train_cfg(lr=lr, grad_clip=0.0), multipliers=pz.opt_multipliers(),
                              table=param_table(cfg))
    u, _ = jax.jit(tx.update)(zeros, tx.init(v), v)   # zero gradient: the update is pure decay
    k = ('params', 'stack', 'segment_0', 'level', 'block', 'mlp', 'wo', 'kernel')
    decays.append(flatten_dict(u)[k] / flatten_dict(v)[k])
  np.testing.assert_allclose(decays[0], decays[1], rtol=1e-5)
  np.testing.assert_allclose(decays[0], -0.1, rtol=1e-5)


# ---- tied gradients under every preset --------------------------------------------------

def _rel_err(a, b):
  return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


@pytest.mark.parametrize('kind', KINDS)
def test_tied_gradient_identity_under_every_preset(kind):
  """d loss / d raw tied weight == fwd_mult * sum over uses of the untied effective gradients."""
  cfg = tiny(64, num_layers=6, scheme='middle_cycle', repeats=2,
             tie_embeddings=kind in ('sp', 'mup', 'completep'))
  pz = P.Parametrization(cfg, P.Settings(kind, base_d_model=D0, loop_rule='inv_R', base_depth=2))
  model = DecoderLM(pz.cfg)
  v = pz.init(init_variables(model, jax.random.key(0)))
  toks = tokens()
  g = jax.jit(jax.grad(loss_fn), static_argnums=(1, 2))(v, model, pz.forward, toks)
  ucfg, uv = layout.to_untied(pz.forward(v), pz.cfg)   # effective weights, one set per layer
  ug = jax.jit(jax.grad(loss_fn), static_argnums=(1, 2))(uv, DecoderLM(ucfg), lambda x: x, toks)
  fwd = flatten_dict(pz.tree('fwd_mult'))
  tied, per_applied = layout.unique_sets(g['params'], cfg), layout.unique_sets(ug['params'], ucfg)
  seg_of_set = [i for i, s in enumerate(cfg.plan.segments) for _ in range(s.num_sets)]
  for path, gt in tied.items():
    for u in range(cfg.plan.num_unique):
      seg = seg_of_set[u]
      prefix = ('params', 'stack', f'segment_{seg}', 'level', 'block')
      mult = fwd[prefix + path]
      want = mult * sum(per_applied[path][l] for l in cfg.plan.uses(u))
      assert _rel_err(gt[u], want) <= 1e-5, (path, u)
  assert fwd[('params', 'stack', 'segment_1', 'level', 'block', 'attn', 'o', 'kernel')] < 1.0
  for path, gx in flatten_dict(g['params']).items():
    if path[0] != 'stack':
      want = fwd[('params',) + path] * flatten_dict(ug['params'])[path]
      assert _rel_err(gx, want) <= 1e-5, path


# ---- sharding invariance (8 simulated devices) ------------------------------------------

_SHARDED = r'''
import json, sys
import jax, ml_collections, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as PS
import flax.linen as nn
from flax.traverse_util import flatten_dict
from sharenet.models import DecoderLM, ModelConfig, init_boxed, init_variables, param_table
from sharenet import optim, parametrization as P
# Self-contained: the same tiny model, train config, tokens and loss as the tests above.
D0 = 32
cfg_of = lambda d, **kw: ModelConfig(**{**dict(
    vocab_size=64, d_model=d, num_layers=4, num_heads=4, mlp_dim=3 * d // 2, scheme='cycle',
    repeats=2, remat='none'), **kw}).validate()
train_cfg = ml_collections.ConfigDict(dict(
    lr=1e-2, schedule='constant', warmup_steps=0, steps=10, decay_fraction=0.3, min_lr_ratio=0.0,
    weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8, grad_clip=1.0))
tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 64)

def loss_fn(params, model, fwd, toks):
  logits = model.apply(fwd(params), toks[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

assert jax.device_count() == int(sys.argv[2]), jax.device_count()
mesh = Mesh(np.asarray(jax.devices()).reshape(-1, 4 if jax.device_count() == 8 else 1),
            ('fsdp', 'tensor'))
rules = (('embed', 'fsdp'), ('mlp', 'tensor'), ('heads', 'tensor'), ('kv_heads', 'tensor'),
         ('vocab', 'tensor'))
out = {}
for kind in ('mup', 'completep'):
  cfg = cfg_of(64, tie_embeddings=kind == 'mup')
  settings = dict(kind=kind, base_d_model=D0, loop_rule='inv_R', base_depth=1)
  pz = P.Parametrization(cfg, P.Settings(**settings))
  model = DecoderLM(pz.cfg)
  boxed = jax.eval_shape(lambda: init_boxed(model, jax.random.key(0)))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  with mesh:
    p0 = jax.jit(lambda: pz.init(init_variables(model, jax.random.key(0))),
                 out_shardings=shardings)()
    # Leaves whose local shard is smaller than the global array: multipliers taken from shard
    # shapes would differ there; the table below comes from global (logical) shapes.
    n_sharded = sum(x.addressable_shards[0].data.shape != x.shape for x in jax.tree.leaves(p0))
    tx = optim.make_optimizer(train_cfg, multipliers=pz.opt_multipliers(),
                              table=param_table(cfg))
    g = jax.jit(jax.grad(loss_fn), static_argnums=(1, 2))(p0, model, pz.forward, tokens)
    u, _ = jax.jit(tx.update)(g, tx.init(p0), p0)
  table = [r for r in pz.describe()]
  out[kind] = dict(table=table, n_sharded=int(n_sharded),
                   update={'/'.join(k): np.asarray(x).ravel()[:64].tolist()
                           for k, x in flatten_dict(u).items()})
print('RESULT' + json.dumps(out))
'''


def _run_sharded(root, n):
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={n} '
             '--xla_backend_optimization_level=0', JAX_PLATFORMS='cpu', PYTHONPATH=root)
  res = subprocess.run([sys.executable, '-c', _SHARDED, root, str(n)], env=env,
                       capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  line = [l for l in res.stdout.splitlines() if l.startswith('RESULT')][0]
  return json.loads(line[len('RESULT'):])


def test_multipliers_and_first_update_same_on_1_and_8_devices(repo_root):
  one, eight = _run_sharded(repo_root, 1), _run_sharded(repo_root, 8)
  for kind in one:
    assert one[kind]['table'] == eight[kind]['table'], kind
    assert eight[kind]['n_sharded'] >= 10 and one[kind]['n_sharded'] == 0
    for k, a in one[kind]['update'].items():
      np.testing.assert_allclose(eight[kind]['update'][k], a, rtol=2e-4, atol=1e-9, err_msg=k)


# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize('settings, cfg_kw, match', [
    (dict(kind='mupp'), {}, r'parametrization.kind=.*valid: sp, mup, mup_table3, umup, completep'),
    (dict(kind='mup', loop_rule='1/R'), {}, r'loop_rule=.*valid: none, inv_R, inv_sqrt_R'),
    (dict(kind='umup'), dict(tie_embeddings=True), r'valid with model.tie_embeddings=True'),
    (dict(kind='mup', loop_rule='inv_R'), dict(scheme='explicit', repeats=0, pattern='0,1,1,0'),
     r'loop_rule needs a regular plan'),
    (dict(kind='mup', base_d_model=25), {}, r'base_d_model=25'),
    (dict(kind='completep'), dict(norm_placement='peri'), r'placement=pre or post'),
])
def test_bad_settings_one_line_error(settings, cfg_kw, match):
  with pytest.raises(ConfigError, match=match) as e:
    P.Parametrization(tiny(64, **cfg_kw), P.Settings(**settings))
  assert '\n' not in str(e.value)
