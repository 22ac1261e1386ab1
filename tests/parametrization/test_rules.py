"""Parametrization presets: rule tables, base-width equivalence, tied gradients, sharding."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict

from sharenet.models import scaling
from sharenet.optim import chain
from sharenet.parametrization import rules as P
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables, layout, param_table
from sharenet.models.scaling import KINDS
from conftest import rel_err as _rel_err

D0 = 32


def tiny(d=32, **kw):
  base = dict(vocab_size=64, d_model=d, num_layers=4, num_heads=4, mlp_dim=3 * d // 2,
              sharing=dict(scheme='cycle', repeats=2), remat='none')
  return ModelConfig(**base).derive(**kw)


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
  pz = P.Parametrization(cfg.derive(parametrization=scaling.Settings(**settings)))
  model = DecoderLM(pz.cfg)
  tx = chain.make_optimizer(train_cfg(), multipliers=pz.opt_multipliers(), table=param_table(cfg))
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
  if kind == 'completep' and trunk:   # every block parameter (CompleteP Table 1)
    e.update(lr=e['lr'] * m_L ** (alpha - 1), eps=1 / (md * m_L ** alpha))
    if name in ('o', 'wo'):
      e['fwd'] *= m_L ** -alpha
  if loop != 'none' and name in ('o', 'wo'):
    e['fwd'] *= 1 / R if loop == 'inv_R' else R ** -0.5
  e['std'] = None if sp_std is None else sp_std * e['init']
  return e


@pytest.mark.slow
@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('loop', ['none', 'inv_R', 'inv_sqrt_R'])
def test_rule_table_matches_analytic(kind, loop):
  for d in (32, 64, 128):
    cfg = tiny(d, sharing=dict(num_unique=2, repeats=2))
    settings = dict(kind=kind, base_d_model=D0, loop_rule=loop, base_depth=1, depth_alpha=0.5)
    pz = P.Parametrization(cfg.derive(parametrization=scaling.Settings(**settings)))
    seen = set()
    for path, r in pz.rules.items():
      name = path[-2] if path[-1] in ('kernel', 'scale') else path[-1]
      e = expected(kind, name, path, d, cfg, m_L=2.0, alpha=0.5, loop=loop)
      got = dict(init=r.init_scale, fwd=r.fwd_mult, lr=r.lr_mult, eps=r.eps_mult, std=r.init_std)
      for k, v in e.items():
        assert got[k] == (None if v is None else pytest.approx(v, rel=1e-12)), (d, path, k)
      assert r.decays == (path[-1] in ('kernel', 'embedding'))
      trunk_cp = kind == 'completep' and 'stack' in path
      assert r.wd_mult == pytest.approx(2.0 ** (0.5 - 1) if trunk_cp else 1.0, rel=1e-12)
      assert 'layers' not in r.axes or r.fan_in_mult in (1.0, d / D0)
      seen.add(name)
    assert {'q', 'o', 'wo', 'embedding', 'readout', 'attn_norm', 'final_norm'} <= seen
    dh, dh0 = d // 4, D0 // 4
    attn = {'sp': dh ** -0.5, 'umup': 1 / dh}.get(kind, dh0 ** 0.5 / dh)   # sp: 1/sqrt(d_head)
    assert pz.cfg.attn_mult == pytest.approx(attn, rel=1e-12)
    assert pz.cfg.logits_mult == (D0 / d if kind in ('mup', 'completep') else 1.0)


def test_tied_embeddings_mup_rules():
  for d in (32, 128):
    pz = P.Parametrization(
        tiny(d, tie_embeddings=True).derive(
            parametrization=scaling.Settings('mup', base_d_model=D0)))
    emb = pz.rules[('params', 'embed', 'embedding')]
    assert (emb.role, emb.init_std, emb.lr_mult, emb.fwd_mult) == ('embedding', 1.0, 1.0, 1.0)
    assert pz.cfg.logits_mult == D0 / d and not any('readout' in p for p in pz.rules)


@pytest.mark.parametrize('kind', KINDS)
def test_zero_init_options_act_under_every_kind(kind):
  """readout_zero_init / query_zero_init zero exactly the readout and the query kernels, under
  every kind (they were once read only by the muP branch and did nothing under sp or umup)."""
  settings = dict(kind=kind, base_d_model=D0 // 2)
  plain = P.Parametrization(tiny(D0).derive(parametrization=scaling.Settings(**settings))).rules
  zeroed = P.Parametrization(tiny(D0).derive(parametrization=scaling.Settings(
      **settings, readout_zero_init=True, query_zero_init=True))).rules
  changed = {p for p in plain if zeroed[p] != plain[p]}
  assert {p[-2] for p in changed} == {'readout', 'q'}
  assert all(plain[p].init_scale != 0 and zeroed[p].init_scale == 0 for p in changed)
  assert all(zeroed[p].lr_mult == plain[p].lr_mult for p in changed)


@pytest.mark.slow
def test_init_statistics_follow_the_table():
  """Empirical std of the rescaled init matches init_std (hidden ~ fan_in^-1/2, readout const)."""
  for d in (32, 128):
    cfg = tiny(d)
    pz = P.Parametrization(cfg.derive(parametrization=scaling.Settings('mup', base_d_model=D0)))
    v = jax.jit(lambda: pz.init(init_variables(DecoderLM(pz.cfg), jax.random.key(0))))()
    for path, x in flatten_dict(v).items():
      r = pz.rules[path]
      if r.init_std is not None and x.size > 500:
        assert abs(float(jnp.std(x)) / r.init_std - 1) < 0.1, path
    ro = float(jnp.std(v['params']['readout']['kernel']))
    assert abs(ro - D0 ** -0.5) < 0.1 * D0 ** -0.5


# ---- base width == SP bit for bit -------------------------------------------------------

@pytest.mark.slow
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


@pytest.mark.slow
def test_unit_multiplier_chain_equals_adamw():
  cfg = tiny(D0)
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  ones = jax.tree.map(lambda _: 1.0, v)
  table = param_table(cfg)
  mult = P.OptMultipliers(ones, ones, False)
  t = train_cfg(schedule='wsd', warmup_steps=2)
  adamw = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                      optax.adamw(chain.lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                                  weight_decay=t.weight_decay,
                                  mask=lambda p: chain.decay_mask(p, table)))
  outs = []
  # The injected peak LR (a float32 in the optimizer state) rounds like optax's python float.
  for tx in (adamw, chain.make_optimizer(t, table=table),
             chain.make_optimizer(t, multipliers=mult, table=table)):

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
  pz = P.Parametrization(
      cfg.derive(parametrization=scaling.Settings('mup', base_d_model=D0, wd_mode='independent')))
  v = init_variables(DecoderLM(pz.cfg), jax.random.key(0))
  zeros = jax.tree.map(jnp.zeros_like, v)
  decays = []
  for lr in (1e-3, 1e-1):
    tx = chain.make_optimizer(train_cfg(lr=lr, grad_clip=0.0), multipliers=pz.opt_multipliers(),
                              table=param_table(cfg))
    u, _ = jax.jit(tx.update)(zeros, tx.init(v), v)   # zero gradient: the update is pure decay
    k = ('params', 'stack', 'segment_0', 'level', 'block', 'mlp', 'wo', 'kernel')
    decays.append(flatten_dict(u)[k] / flatten_dict(v)[k])
  np.testing.assert_allclose(decays[0], decays[1], rtol=1e-5)
  np.testing.assert_allclose(decays[0], -0.1, rtol=1e-5)


# ---- tied gradients under every preset --------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('kind', KINDS)
def test_tied_gradient_identity_under_every_preset(kind):
  """d loss / d raw tied weight == fwd_mult * sum over uses of the untied effective gradients."""
  cfg = tiny(64, num_layers=6, sharing=dict(scheme='middle_cycle', repeats=2),
             tie_embeddings=kind in ('sp', 'mup', 'completep'))
  pz = P.Parametrization(
      cfg.derive(
          parametrization=scaling.Settings(kind, base_d_model=D0, loop_rule='inv_R', base_depth=2)))
  model = DecoderLM(pz.cfg)
  v = jax.jit(lambda: pz.init(init_variables(model, jax.random.key(0))))()
  toks = tokens()
  g = jax.jit(jax.grad(loss_fn), static_argnums=(1, 2))(v, model, pz.forward, toks)
  # effective weights, one set per layer
  ucfg = layout.untied_config(pz.cfg)
  uv = jax.jit(lambda v: layout.to_untied(pz.forward(v), pz.cfg)[1])(v)
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
import json
import jax, ml_collections, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as PS
import flax.linen as nn
from flax.traverse_util import flatten_dict
from sharenet.models import DecoderLM, ModelConfig, init_boxed, init_variables, param_table
from sharenet.optim import chain
from sharenet.models import scaling
from sharenet.parametrization import rules as P
# Self-contained: the same tiny model, train config, tokens and loss as the tests above.
D0 = 32
cfg_of = lambda d, **kw: ModelConfig(
    vocab_size=64, d_model=d, num_layers=4, num_heads=4, mlp_dim=3 * d // 2,
    sharing=dict(scheme='cycle', repeats=2), remat='none').derive(**kw)
train_cfg = ml_collections.ConfigDict(dict(
    lr=1e-2, schedule='constant', warmup_steps=0, steps=10, decay_fraction=0.3, min_lr_ratio=0.0,
    weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8, grad_clip=1.0))
tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 64)

def loss_fn(params, model, fwd, toks):
  logits = model.apply(fwd(params), toks[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

assert jax.device_count() == 8, jax.device_count()
rules = (('embed', 'fsdp'), ('mlp', 'tensor'), ('heads', 'tensor'), ('kv_heads', 'tensor'),
         ('vocab', 'tensor'))
out = {}
for n, kind in [(n, kind) for n in (1, 8) for kind in ('mup', 'completep')]:
  # fsdp x tensor = 2 x 4 over the 8 devices, or the first device alone
  mesh = Mesh(np.asarray(jax.devices()[:n]).reshape(-1, 4 if n == 8 else 1), ('fsdp', 'tensor'))
  cfg = cfg_of(64, tie_embeddings=kind == 'mup')
  settings = dict(kind=kind, base_d_model=D0, loop_rule='inv_R', base_depth=1)
  pz = P.Parametrization(cfg.derive(parametrization=scaling.Settings(**settings)))
  model = DecoderLM(pz.cfg)
  boxed = jax.eval_shape(lambda: init_boxed(model, jax.random.key(0)))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  with mesh:
    p0 = jax.jit(lambda: pz.init(init_variables(model, jax.random.key(0))),
                 out_shardings=shardings)()
    # Leaves whose local shard is smaller than the global array: multipliers taken from shard
    # shapes would differ there; the table below comes from global (logical) shapes.
    n_sharded = sum(x.addressable_shards[0].data.shape != x.shape for x in jax.tree.leaves(p0))
    tx = chain.make_optimizer(train_cfg, multipliers=pz.opt_multipliers(),
                              table=param_table(cfg))
    g = jax.jit(jax.grad(loss_fn), static_argnums=(1, 2))(p0, model, pz.forward, tokens)
    u, _ = jax.jit(tx.update)(g, tx.init(p0), p0)
  table = [r for r in pz.describe()]
  out.setdefault(n, {})[kind] = dict(table=table, n_sharded=int(n_sharded),
                                     update={'/'.join(k): np.asarray(x).ravel()[:64].tolist()
                                             for k, x in flatten_dict(u).items()})
print('RESULT' + json.dumps(out))
'''


@pytest.mark.slow
def test_multipliers_and_first_update_same_on_1_and_8_devices(subprocess_env):
  """One process with 8 simulated devices: the model on a mesh of all 8 (fsdp x tensor) and on
  the first device alone gets the same multiplier table and the same first update."""
  env = dict(subprocess_env, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  res = subprocess.run([sys.executable, '-c', _SHARDED], env=env, capture_output=True,
                       text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  line = [l for l in res.stdout.splitlines() if l.startswith('RESULT')][0]
  results = json.loads(line[len('RESULT'):])
  one, eight = results['1'], results['8']
  for kind in one:
    assert one[kind]['table'] == eight[kind]['table'], kind
    assert eight[kind]['n_sharded'] >= 10 and one[kind]['n_sharded'] == 0
    for k, a in one[kind]['update'].items():
      np.testing.assert_allclose(eight[kind]['update'][k], a, rtol=2e-4, atol=1e-9, err_msg=k)


# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    'settings, cfg_kw, match',
    [
        (dict(kind='mupp'), {},
         r'parametrization.kind=.*valid: sp, mup, mup_table3, umup, completep'),
        (dict(kind='mup', loop_rule='1/R'), {}, r'loop_rule=.*valid: none, inv_R, inv_sqrt_R'),
        (dict(kind='umup'), dict(tie_embeddings=True),
         r'one tensor cannot carry the embedding.s and the readout.s rules'),
        (dict(kind='sp', readout_zero_init=True), dict(tie_embeddings=True),
         r'tied embeddings store no readout of their own.*valid: '),
        # An explicit plan applying its sets unequally often ('0,1,1,0' applies both twice: fine).
        (dict(kind='mup', loop_rule='inv_R'),
         dict(sharing=dict(scheme='explicit', repeats=0, pattern='0,1,1,1')),
         r'loop_rule=inv_R needs every stored set applied equally often'),
        (dict(kind='mup', base_d_model=25), {}, r'base_d_model=25'),
        (dict(kind='completep'), dict(norm=dict(placement='peri')),
         r'branch multipliers are cancelled by peri norms'),
    ])
def test_bad_settings_one_line_error(settings, cfg_kw, match):
  with pytest.raises(ConfigError, match=match) as e:
    P.Parametrization(tiny(64, **cfg_kw).derive(parametrization=scaling.Settings(**settings)))
  assert '\n' not in str(e.value)


# ---- the papers' tables, written out (independent of the code's rule table) -------------------
#
# TP5 = Yang et al., "Tensor Programs V" (arXiv:2203.03466), Table 3 (muP for SGD / Adam) and
# Table 8 (its equivalent form with multipliers, "compatible with input/output weight sharing"),
# columns input weights & all biases | output weights | hidden weights. Entries are powers of the
# column's fan_in; TP5 states them up to width-independent constants, which microsoft/mup (and
# this code) anchor so that the base width equals SP. Each triple: (init var, multiplier, Adam LR).
#   Table 3:  (1/fan_in, 1, 1)   | (1/fan_in^2, 1, 1/fan_in) | (1/fan_in, 1, 1/fan_in)
#   Table 8:  (1/fan_in, 1, 1)   | (1, 1/fan_in, 1)          | (1/fan_in, 1, 1/fan_in)
# An input weight's fan_in is finite (vocab for the embedding, 1 for biases and norm gains): its
# entries do not change with width. Attention logits are q.k / d_head (TP5 Section 4, "1/d
# attention"). Neither table has an Adam eps, weight decay or depth rule: those are 1 / absent.
TP5_TABLE = {
    'table3': {'input': (-1, 0, 0), 'output': (-2, 0, -1), 'hidden': (-1, 0, -1)},
    'table8': {'input': (-1, 0, 0), 'output': (0, -1, 0), 'hidden': (-1, 0, -1)},
}
# CompleteP = Dey et al., "Don't be lazy: CompleteP enables compute-efficient deep transformers"
# (arXiv:2505.01618), Table 1, column alpha (m_N = width / base width, m_L = depth / base depth):
#   Embed init var / LR:       sigma_base^2 / eta_base
#   Pre-LN init var / LR:      sigma_base^2 / eta_base m_L^(alpha-1)
#   Hidden init var / LR:      sigma_base^2 m_N^-1 / eta_base m_N^-1 m_L^(alpha-1)
#   Hidden bias LR:            eta_base m_L^(alpha-1)
#   Hidden WD (AdamW):         lambda_base m_N
#   MHA / MLP residual:        X + m_L^-alpha F(LN(X))
#   Final-LN init var / LR:    sigma_base^2 / eta_base
#   Unembed init var / LR / fwd: sigma_base^2 / eta_base / X W^T m_N^-1
#   AdamW eps (residual blocks): eps_base m_N^-1 m_L^-alpha
# WD is torch AdamW's: a group decays by lr_group(t) * wd_group per step; the embedding group
# keeps lambda_base and norms / biases get 0 (the paper's code, EleutherAI/nanoGPT-mup branch
# completep, model.py configure_optimizers).
D_BASE, L_BASE, VOCAB, ETA, LAMBDA = 32, 2, 64, 1e-2, 0.1


def _paper_model(d, L, **kw):
  return ModelConfig(vocab_size=VOCAB, d_model=d, num_layers=L, num_heads=4, mlp_dim=2 * d,
                     reader_bias=True, remat='none').derive(**kw)


def _leaf(pz, *suffix):
  return next(r for p, r in pz.rules.items() if p[-len(suffix):] == suffix)


def _torch_decay(pz, cfg):
  """Per leaf, -update / (eta * lambda * p) of one zero-gradient step of our optimizer."""
  shapes = {p: i.shape for p, i in param_table(cfg).items()}
  ones = {p: jnp.ones(s) for p, s in shapes.items()}
  tx = chain.make_optimizer(train_cfg(lr=ETA, weight_decay=LAMBDA, grad_clip=0.0),
                            multipliers=pz.opt_multipliers(), table=param_table(cfg))
  from flax.traverse_util import unflatten_dict
  v = unflatten_dict(ones)
  # one compiled program (op by op, the update compiled ~90 small programs per width)
  u = jax.jit(lambda v: tx.update(jax.tree.map(jnp.zeros_like, v), tx.init(v), v)[0])(v)
  return {p: float(-x.ravel()[0]) / (ETA * LAMBDA) for p, x in flatten_dict(u).items()}


def _paper_rows(kind, d, L, alpha):
  """{leaf: (init std, total forward multiplier, Adam LR mult, eps mult, decay per eta*lambda)}
  from the tables above, for this repository's leaves (SP std: 1/sqrt(fan_in) kernels, 1 for
  the embedding, constant 1 / 0 for gains / biases)."""
  table = TP5_TABLE['table3' if kind == 'mup_table3' else 'table8']
  m_N, m_L = d / D_BASE, L / L_BASE
  cp = kind == 'completep'
  rows = {}
  # (leaf suffix, TP5 column, fan_in at width d, fan_in at the base, SP std at the base, in block)
  leaves = [(('embed', 'embedding'), 'input', VOCAB, VOCAB, 1.0, False),
            (('readout', 'kernel'), 'output', d, D_BASE, D_BASE ** -0.5, False),
            (('readout', 'bias'), 'input', 1, 1, None, False),
            (('final_norm', 'scale'), 'input', 1, 1, None, False),
            (('attn', 'q', 'kernel'), 'hidden', d, D_BASE, D_BASE ** -0.5, True),
            (('attn', 'o', 'kernel'), 'hidden', d, D_BASE, D_BASE ** -0.5, True),
            (('mlp', 'wo', 'kernel'), 'hidden', 2 * d, 2 * D_BASE, (2 * D_BASE) ** -0.5, True),
            (('attn', 'q', 'bias'), 'input', 1, 1, None, True),
            (('attn_norm', 'scale'), 'input', 1, 1, None, True)]
  for suffix, col, fan_in, fan_in0, std0, block in leaves:
    var_p, mult_p, lr_p = table[col]
    ratio = fan_in / fan_in0
    std = None if std0 is None else std0 * ratio ** (var_p / 2)
    mult = ratio ** mult_p
    lr = ratio ** lr_p
    eps = 1.0
    matrix = std is not None
    # torch AdamW: microsoft/mup MuAdamW sets wd_group = lambda * m for a group at LR eta / m
    # (CompleteP's muP column: hidden WD lambda m_N), so lr_group * wd_group = eta * lambda.
    decay = 1.0 if matrix else 0.0
    if cp and block:
      lr *= m_L ** (alpha - 1)
      eps = m_N ** -1 * m_L ** -alpha
      if matrix:
        decay = (m_N ** -1 * m_L ** (alpha - 1)) * m_N      # lr_group * wd_group / (eta lambda)
      if suffix[-2] in ('o', 'wo'):
        mult *= m_L ** -alpha
    rows[suffix] = (std, mult, lr, eps, decay)
  return rows


@pytest.mark.slow
@pytest.mark.parametrize('kind, alpha', [('mup', 1.0), ('mup_table3', 1.0), ('completep', 1.0),
                                         ('completep', 0.5)])
def test_presets_match_the_papers_tables(kind, alpha):
  """Each preset at two widths and two depths (one != the base depth) against TP5 Table 3 / 8
  and CompleteP Table 1, written out above: init std, forward multiplier (readout via the
  logits, residual branches via o / wo), Adam LR, Adam eps, weight decay, attention scale."""
  for d in (D_BASE, 4 * D_BASE):
    for L in (L_BASE, 8):
      cfg = _paper_model(d, L)
      pz = P.Parametrization(
          cfg.derive(parametrization=scaling.Settings(kind, base_d_model=D_BASE, base_depth=L_BASE,
                                                depth_alpha=alpha)))
      decay = _torch_decay(pz, cfg)
      for suffix, (std, mult, lr, eps, dec) in _paper_rows(kind, d, L, alpha).items():
        r = _leaf(pz, *suffix)
        got_mult = r.fwd_mult * (pz.cfg.logits_mult / cfg.logits_mult
                                 if suffix == ('readout', 'kernel') else 1.0)
        where = (kind, alpha, d, L, suffix)
        assert r.init_std == (None if std is None else pytest.approx(std, rel=1e-12)), where
        assert got_mult == pytest.approx(mult, rel=1e-12), where
        assert r.lr_mult == pytest.approx(lr, rel=1e-12), where
        assert r.eps_mult == pytest.approx(eps, rel=1e-12), where
        assert decay[r.path] == pytest.approx(dec, rel=1e-5), where
      d_head, d_head0 = d // 4, D_BASE // 4
      assert pz.cfg.attn_mult == pytest.approx(d_head0 ** -0.5 * d_head0 / d_head, rel=1e-12)
      model_row = pz.describe()[-1]
      assert (model_row['m_d'], model_row['m_L']) == (d / D_BASE, L / L_BASE)


@pytest.mark.parametrize('kind', ['mup', 'mup_table3', 'completep'])
def test_lora_factors_follow_tp5_input_output_columns(kind):
  """Depth-wise LoRA: A (fan-in = width, fan-out = rank r) is a TP5 output weight, B (fan-in = r,
  fan-out = width) an input weight (Table 3 / Table 8 above); under CompleteP both are block
  parameters (Table 1: LR m_L^(alpha-1), eps m_N^-1 m_L^-alpha; a branch output's B x m_L^-alpha).
  """
  table = TP5_TABLE['table3' if kind == 'mup_table3' else 'table8']
  alpha = 0.5
  for d in (D_BASE, 4 * D_BASE):
    L = 8
    cfg = _paper_model(
        d, L, sharing=dict(scheme='cycle', num_unique=4, lora_rank=2,
                           lora_targets=('q', 'o', 'mlp_out')))
    pz = P.Parametrization(
        cfg.derive(parametrization=scaling.Settings(kind, base_d_model=D_BASE, base_depth=L_BASE,
                                              depth_alpha=alpha)))
    m_N, m_L = d / D_BASE, 4 / L_BASE             # m_L counts unique sets
    for mod, fan_in, fan_in0 in (('q', d, D_BASE), ('o', d, D_BASE), ('wo', 2 * d, 2 * D_BASE)):
      ratio = fan_in / fan_in0
      var_p, mult_p, lr_p = table['output']
      a = _leaf(pz, mod, 'lora_a')
      depth_lr = m_L ** (alpha - 1) if kind == 'completep' else 1.0
      eps = m_N ** -1 * m_L ** -alpha if kind == 'completep' else 1.0
      assert a.init_std == pytest.approx(fan_in0 ** -0.5 * ratio ** (var_p / 2), rel=1e-12)
      assert a.fwd_mult == pytest.approx(ratio ** mult_p, rel=1e-12)
      assert a.lr_mult == pytest.approx(ratio ** lr_p * depth_lr, rel=1e-12)
      assert a.eps_mult == pytest.approx(eps, rel=1e-12)
      b = _leaf(pz, mod, 'lora_b')
      var_p, mult_p, lr_p = table['input']     # fan_in = r: finite, no width dependence
      branch = m_L ** -alpha if kind == 'completep' and mod in ('o', 'wo') else 1.0
      assert (b.init_std, b.fwd_mult) == (None, pytest.approx(branch, rel=1e-12))
      assert b.lr_mult == pytest.approx(depth_lr, rel=1e-12)
      assert b.eps_mult == pytest.approx(eps, rel=1e-12)


@pytest.mark.slow
def test_lora_a_feature_update_is_width_independent_under_mup_not_sp():
  """The derivation for LoRA A (module docstring): after one Adam step the feature update
  x (A_1 - A_0) (effective weights) is Theta(1) in width under mup and grows ~ width under sp.
  Measured on the first layer's query LoRA (its input, norm(embedding), does not depend on LoRA),
  with B set nonzero so that A gets a gradient at step 1."""
  from sharenet.models.layers import INTERMEDIATES
  sizes = {}
  for kind in ('sp', 'mup'):
    for d in (D_BASE, 8 * D_BASE):
      cfg = _paper_model(
          d, 2, sharing=dict(scheme='cycle', num_unique=1, lora_rank=2, lora_targets=('q',)))
      pz = P.Parametrization(
          cfg.derive(parametrization=scaling.Settings(kind, base_d_model=D_BASE)))
      model = DecoderLM(pz.cfg)
      v = pz.init(init_variables(model, jax.random.key(0)))
      v = jax.tree_util.tree_map_with_path(
          lambda p, x: jnp.full_like(x, 0.1) if 'lora_b' in str(p[-1]) else x, v)
      tx = chain.make_optimizer(train_cfg(weight_decay=0.0, grad_clip=0.0),
                                multipliers=pz.opt_multipliers(), table=param_table(cfg))
      toks = tokens(B=1, T=5)   # few tokens: the gradient aligns with each one's x (LLN in d)

      @jax.jit   # one program per (preset, width), not an op-by-op dispatch of each piece
      def feature_update(v, toks):
        g = jax.grad(loss_fn)(v, model, pz.forward, toks)
        u, _ = tx.update(g, tx.init(v), v)
        # Parameters whose only LoRA A is the step's change: x (A_1 - A_0) is what lora_xa sows.
        delta = jax.tree_util.tree_map_with_path(
            lambda p, x, dx: dx if 'lora_a' in str(p[-1]) else x, v, u)
        return model.apply(pz.forward(delta), toks[:, :-1], mutable=[INTERMEDIATES])[1]

      inter = feature_update(v, toks)
      xa = [x for p, x in flatten_dict(inter).items() if p[-1] == 'lora_xa'][0]
      sizes[kind, d] = float(jnp.ravel(xa[0] if isinstance(xa, tuple) else xa)[0])
  mup_ratio = sizes['mup', 8 * D_BASE] / sizes['mup', D_BASE]
  sp_ratio = sizes['sp', 8 * D_BASE] / sizes['sp', D_BASE]
  # Theta(1) under mup (d * eta / m, m = d / d_base): |slope| < 1/3 over 8x; ~ d under sp.
  assert 0.5 < mup_ratio < 2.0, sizes
  assert sp_ratio > 4.0, sizes


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['mup', 'umup'])
def test_the_model_a_config_describes_is_the_model_that_trains(kind, tiny_config):
  """ModelConfig.from_experiment (eval's and generation's path, via workdir_io.restore_state)
  builds the model train_lib trains, its parametrization's scalars included; the parametrization
  reads the model config and does not rewrite it."""
  from sharenet.train import trainer
  c = tiny_config(**{'parametrization.kind': kind, 'parametrization.base_d_model': 16,
                     'parametrization.base_num_heads': 1})
  exp = trainer.setup(c)
  assert exp.pz.cfg is exp.model.cfg
  described = DecoderLM(ModelConfig.from_experiment(c))
  assert described.cfg == exp.model.cfg
  assert (described.cfg.logits_mult != 1.0) if kind == 'mup' else described.cfg.umup_ops
  v = exp.pz.forward(exp.pz.init(init_variables(exp.model, jax.random.key(0))))
  toks = jax.random.randint(jax.random.key(1), (2, 12), 0, c.model.vocab_size)
  trained = exp.model.apply(v, toks)
  np.testing.assert_array_equal(np.asarray(described.apply(v, toks)), np.asarray(trained))
  section_only = DecoderLM(ModelConfig.from_config(c.model, c.train.seq_len))   # sp scalars
  assert not np.allclose(np.asarray(section_only.apply(v, toks)), np.asarray(trained))
  with pytest.raises(ConfigError, match='from_experiment'):
    trainer.setup(c, section_only.cfg)
