"""Tests for the rest of the normalization family (docs/normalization.md): SELU, weight
conditioning, the compander, Lp norms and Unified Normalization with its fold.

Each method is checked against a numpy restatement of its forward; where the method is the
identity (at init or for a parameter setting) the model's loss is unchanged.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from configs import tiny as tiny_config
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables, param_table
from sharenet.models.mlp import Mlp
from sharenet.models.norms import Norm
from sharenet.train.trainer import loss_fn
from sharenet.transforms import Transforms, reparam
from sharenet.transforms.roles import Leaf


def _tiny(**model_kw):
  c = tiny_config.get_config()
  for k, v in model_kw.items():
    node = c.model
    *head, last = k.split('.')
    for h in head:
      node = node[h]
    node[last] = v
  return c


def _tokens(B=2, T=9, vocab=256):
  return jax.random.randint(jax.random.key(5), (B, T), 0, vocab)


def _loss(c, variables=None, tstate=None, tr=None):
  model = DecoderLM(ModelConfig.from_config(c.model))
  variables = init_variables(model, jax.random.key(0)) if variables is None else variables
  loss, _ = jax.jit(lambda p, s: loss_fn(p, s, _tokens(), model=model, tr=tr))(variables, tstate)
  return float(loss), model, variables


# ------------------------------------------------------------------------------------ SELU

def _np_selu(z):
  lam, alpha = 1.0507009873554805, 1.6732632423543772   # Klambauer et al., eq. 2
  return lam * np.where(z > 0, z, alpha * (np.exp(z) - 1))


def test_selu_mlp_matches_numpy_and_uses_lecun_normal_init():
  c = _tiny(mlp='selu', **{'norm.kind': 'none'})
  cfg = ModelConfig.from_config(c.model)
  table = param_table(cfg)
  kernels = {p: i for p, i in table.items() if p[-1] == 'kernel' and 'mlp' in '/'.join(p)}
  assert kernels and not any('wi_gate' in '/'.join(p) for p in kernels)
  for p, info in kernels.items():   # LeCun normal: N(0, 1/fan_in), read from the metadata
    in_dim = cfg.d_model if p[-2] == 'wi' else cfg.mlp_dim
    assert info.init_std == pytest.approx(in_dim ** -0.5), p
  mlp = Mlp(cfg)
  x = jax.random.normal(jax.random.key(1), (2, 3, cfg.d_model))
  v = nn.unbox(mlp.init(jax.random.key(2), x))
  y = jax.jit(mlp.apply)(v, x)
  wi, wo = (np.asarray(v['params'][n]['kernel'], np.float64) for n in ('wi', 'wo'))
  np.testing.assert_allclose(y, _np_selu(np.asarray(x, np.float64) @ wi) @ wo, rtol=1e-4,
                             atol=1e-5)


def test_selu_keeps_unit_variance_through_a_deep_lecun_stack():
  """The paper's fixed point: zero-mean unit-variance input stays so under selu(x W),
  W ~ N(0, 1/n); gelu with the same init shrinks the variance layer after layer."""
  n, depth = 256, 16
  keys = jax.random.split(jax.random.key(0), depth + 1)
  x_sel = x_gel = jax.random.normal(keys[0], (512, n))
  for k in keys[1:]:
    w = jax.random.normal(k, (n, n)) * n ** -0.5
    x_sel, x_gel = jax.nn.selu(x_sel @ w), jax.nn.gelu(x_gel @ w)
  assert abs(float(jnp.var(x_sel)) - 1.0) < 0.15 and abs(float(jnp.mean(x_sel))) < 0.1
  assert float(jnp.var(x_gel)) < 0.5


def test_unknown_mlp_is_one_line_naming_the_choices():
  with pytest.raises(ConfigError, match='selu') as e:
    ModelConfig.from_config(_tiny(mlp='relu').model)
  assert '\n' not in str(e.value)


# ------------------------------------------------------------------------ weight reparams

def _leaf(shape=(2, 12, 6), axes=('layers', 'embed', 'mlp')):
  return Leaf(('params', 'w', 'kernel'), axes, shape, 'reader')


def _np_conditioned(m, g):
  """Row equilibration of each output unit's fan-in vector to the RMS unit norm, times g."""
  norms = np.sqrt((m ** 2).sum(-2, keepdims=True))                   # (S, 1, O)
  rho = np.sqrt((norms ** 2).mean(-1, keepdims=True))
  return g[:, None, None] * m * rho / norms


def test_weight_conditioning_matches_numpy_narrows_the_spectrum_and_is_idempotent():
  leaf = _leaf()
  # Badly scaled output units: condition number far from 1.
  w = jax.random.normal(jax.random.key(0), leaf.shape) * jnp.logspace(-2, 1, 6)[None, None, :]
  wc = reparam.WeightConditioning()
  extras, state = wc.init(w, leaf)
  extras = {'wcond_g': jnp.array([1.0, 0.7])}
  out = jax.jit(lambda w: wc.apply(w, extras, state, leaf))(w)
  np.testing.assert_allclose(out, _np_conditioned(np.asarray(w, np.float64), np.array([1, .7])),
                             rtol=1e-5, atol=1e-6)
  kappa = lambda m: np.linalg.cond(np.asarray(m, np.float64))
  assert all(kappa(out[i]) < kappa(w[i]) / 5 for i in range(2))
  # identity on equal-norm units (g = 1): applying it twice changes nothing
  one = {'wcond_g': jnp.ones(2)}
  once = wc.apply(w, one, state, leaf)
  np.testing.assert_allclose(wc.apply(once, one, state, leaf), once, rtol=1e-5, atol=1e-7)
  # the Frobenius norm (the init scale) is kept
  np.testing.assert_allclose(jnp.linalg.norm(once, axis=(1, 2)), jnp.linalg.norm(w, axis=(1, 2)),
                             rtol=1e-5)


def _np_compand(m, s, gamma):
  return np.sign(m) * s * (np.maximum(np.abs(m), 1e-6 * s) / s) ** gamma


def test_compander_matches_numpy_and_companders():
  leaf = _leaf()
  w = jax.random.normal(jax.random.key(0), leaf.shape) * 0.05
  wc = reparam.Compander(gamma=0.5)
  extras, state = wc.init(w, leaf)
  np.testing.assert_allclose(extras['wc_s'], np.sqrt(np.mean(np.asarray(w) ** 2, (1, 2))),
                             rtol=1e-5)
  out = jax.jit(lambda w, e: wc.apply(w, e, state, leaf))(w, extras)
  s = np.asarray(extras['wc_s'], np.float64)[:, None, None]
  np.testing.assert_allclose(out, _np_compand(np.asarray(w, np.float64), s, 0.5), rtol=1e-5,
                             atol=1e-7)
  small, large = jnp.abs(w) < 0.5 * s, jnp.abs(w) > 2 * s     # lifted from 0, large ones capped
  assert bool(jnp.all(jnp.abs(out)[small] > jnp.abs(w)[small]))
  assert bool(jnp.all(jnp.abs(out)[large] < jnp.abs(w)[large]))
  grads = jax.jit(jax.grad(lambda e: jnp.sum(wc.apply(w, e, state, leaf) ** 2)))(extras)
  assert all(bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).sum()) > 0
             for g in grads.values())            # s and gamma are learnable
  with pytest.raises(ConfigError, match='compander_gamma'):
    reparam.Compander(gamma=0.0)


@pytest.mark.slow
def test_identity_settings_leave_the_model_unchanged():
  """compander with gamma = 1; weight conditioning of a model whose kernels are already
  conditioned. Both act on the stored tree (one pool entry per shared set of the cycle)."""
  c = _tiny(**{'sharing.scheme': 'cycle', 'num_layers': 4, 'sharing.repeats': 2})
  base, model, v = _loss(c)
  c.transforms.reparam, c.transforms.compander_gamma = 'compander', 1.0
  tr = Transforms(c.transforms, model)
  params, tstate = tr.init(v)
  assert 'reparam' in params and flatten_dict(params['reparam'])
  assert _loss(c, params, tstate, tr)[0] == pytest.approx(base, abs=1e-5)
  c.transforms.reparam = 'weight_conditioning'
  tr = Transforms(c.transforms, model)
  params, tstate = tr.init(v)
  conditioned = tr.effective(params, tstate)              # W~ with g = 1
  ref = _loss(c, {k: x for k, x in conditioned.items()})[0]
  params2, tstate2 = tr.init(conditioned)
  assert _loss(c, params2, tstate2, tr)[0] == pytest.approx(ref, abs=1e-5)


# ------------------------------------------------------------------------------ Lp norm

def _np_lpnorm(x, p, scale, bias, eps=1e-6):
  """Liao et al.'s Lp normalization over the features: centred, over the p-th root of the p-th
  absolute central moment."""
  xc = x - x.mean(-1, keepdims=True)
  return scale * xc / (np.mean(np.abs(xc) ** p, -1, keepdims=True) + eps) ** (1 / p) + bias


@pytest.mark.parametrize('p', [1.0, 3.0])
def test_lpnorm_matches_numpy(p):
  x = jax.random.normal(jax.random.key(0), (2, 3, 16)) * 3 + 1
  norm = Norm('lpnorm', 1e-6, p=p)
  v = nn.unbox(norm.init(jax.random.key(1), x))
  v = jax.tree.map(lambda a: a + jax.random.normal(jax.random.key(2), a.shape) * 0.1, v)
  y = jax.jit(norm.apply)(v, x)
  sb = {k: np.asarray(a, np.float64) for k, a in v['params'].items()}
  np.testing.assert_allclose(y, _np_lpnorm(np.asarray(x, np.float64), p, sb['scale'], sb['bias']),
                             rtol=1e-5, atol=1e-5)


def test_lpnorm_with_p2_is_layernorm_and_p_le_0_is_one_line():
  x = jax.random.normal(jax.random.key(0), (4, 16)) * 2 - 1
  lp, ln = Norm('lpnorm', 1e-6, p=2.0), Norm('layernorm', 1e-6)
  v = nn.unbox(ln.init(jax.random.key(1), x))
  np.testing.assert_allclose(lp.apply(v, x), ln.apply(v, x), rtol=1e-5, atol=1e-6)
  for p in (0.0, -1.0):
    with pytest.raises(ConfigError, match='model.norm.p') as e:
      ModelConfig.from_config(_tiny(**{'norm.kind': 'lpnorm', 'norm.p': p}).model)
    assert '\n' not in str(e.value)


# ------------------------------------------------------------------------------ norm study

@pytest.mark.parametrize('variant', ['lpnorm', 'selu', 'weight_conditioning', 'compander',
                                     'powernorm', 'unified_norm', 'online_norm'])
def test_new_variants_are_valid_norm_study_cells(variant):
  """The study can run them later (python -m sharenet.studies.norm_study
  --config.study.variants=lpnorm,selu,weight_conditioning,compander,powernorm): every cell
  validates."""
  from configs import norm_study as study_config
  from sharenet.train import experiment
  from sharenet.studies import common, norm_study
  for scheme in norm_study.SCHEMES:
    c = common.with_overrides(study_config.get_config(), {**norm_study.SCHEMES[scheme],
                                                          **norm_study.VARIANTS[variant][1]})
    cfg = experiment.validate(c)
    assert cfg.norm.kind == c.model.norm.kind and cfg.mlp == c.model.mlp


# ---------------------------------------------------------------- PowerNorm's functional core

def _np_power_norm(x, gain, bias, phi, ema_gz, dy, step, warmup, eps, a_fwd, a_bkw):
  """MaskPowerNorm's PowerFunction (sIncerass/powernorm) restated in float64 numpy: forward,
  running phi, and the approximate backward with its Gamma (ema_gz) update."""
  psi2 = (x * x).mean(0)
  z = x / np.sqrt((psi2 if step <= warmup else phi) + eps)
  y = gain * z + bias
  if step < warmup:
    phi = phi * (step - 1) / step + psi2 / step
  phi = a_fwd * phi + (1 - a_fwd) * psi2
  g = dy * gain
  g_hat = g - (1 - a_bkw) * ema_gz * z
  ema_gz = ema_gz + (g_hat * z).mean(0)
  dx = g_hat / np.sqrt(psi2 + eps)
  return y, phi, ema_gz, dx, (dy * z).sum(0), dy.sum(0)


@pytest.mark.parametrize('step', [3, 20])   # in warmup (batch moment) and after (running phi)
def test_power_norm_forward_and_approximate_backward_match_the_reference(step):
  from sharenet.models import norm_stats as ns
  warmup, eps, a_fwd, a_bkw = 10, 1e-5, 0.9, 0.9
  k = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(k[0], (12, 8)) * 2
  gain, bias = 1 + 0.1 * jax.random.normal(k[1], (8,)), 0.1 * jax.random.normal(k[2], (8,))
  phi = 1 + jax.random.uniform(k[3], (8,))
  ema_gz, dy = 0.1 * jax.random.normal(k[4], (8,)), jax.random.normal(k[5], (12, 8))

  def f(x, gain, bias, tap):   # psi2 enters stop-gradient'ed, as norm_stats.apply_power_norm
    psi2 = jax.lax.stop_gradient(ns.batch_moment(x))
    v = jnp.where(step <= warmup, psi2, phi)
    return ns.power_norm(x, gain, bias, v, psi2, ema_gz, tap, eps, a_bkw)

  y, vjp = jax.vjp(jax.jit(f), x, gain, bias, jnp.zeros(8))
  dx, dgain, dbias, d_ema = vjp(dy)
  new_phi = ns.update_phi(phi, ns.batch_moment(x), step, a_fwd, warmup)
  ref = _np_power_norm(*(np.asarray(a, np.float64) for a in (x, gain, bias, phi, ema_gz, dy)),
                       step, warmup, eps, a_fwd, a_bkw)
  got = (y, new_phi, ema_gz + d_ema, dx, dgain, dbias)
  for name, a, b in zip(('y', 'phi', 'ema_gz', 'dx', 'dgain', 'dbias'), got, ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
  # the approximate backward is not autodiff's (which would differentiate psi2 in warmup)
  exact = jax.grad(lambda x: jnp.sum(dy * gain[None] * x *
                                     jax.lax.rsqrt(ns.batch_moment(x) + eps)[None]))(x)
  assert step > warmup or not np.allclose(dx, exact, atol=1e-3)
  # eval mode: the running phi alone
  np.testing.assert_allclose(ns.power_norm_eval(x, gain, bias, phi, eps),
                             gain[None] * x / jnp.sqrt(phi + eps)[None] + bias[None],
                             rtol=1e-6)


def test_group_scale_is_rms_per_channel_group():
  from sharenet.models import norm_stats as ns
  x = jax.random.normal(jax.random.key(0), (5, 12)) * 3
  out = np.asarray(ns.group_scale(x, 3, 1e-5)).reshape(5, 3, 4)
  np.testing.assert_allclose(np.mean(out ** 2, -1), np.ones((5, 3)), rtol=1e-4)


def test_power_norm_module_keeps_the_reference_statistics_over_steps():
  """norms.Norm(kind='powernorm') over 6 training steps (3 in warmup) against MaskPowerNorm
  restated in numpy: group scaling, output, the running phi, Gamma (ema_gz; the reference
  back-propagates the summed token loss, sharenet the mean, and its Gamma is the reference's),
  the last batch moment, the step count; then eval mode reads phi alone."""
  import flax.linen as nn
  from sharenet.models import norm_stats as ns
  from sharenet.models.norms import Norm
  eps, a_fwd, a_bkw, warmup, G, C = 1e-5, 0.9, 0.8, 3, 2, 8
  from sharenet.models.sections import NormConfig
  norm = Norm('powernorm', eps, stats=NormConfig(kind='powernorm', stats_momentum=a_fwd,
                                                 stats_grad_momentum=a_bkw,
                                                 stats_warmup=warmup, groups=G))
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(6, 3, 4, C)) * rng.uniform(0.5, 2, C)
  dys = rng.normal(size=(6, 12, C))
  variables = nn.unbox(norm.init(jax.random.key(0), jnp.asarray(xs[0], jnp.float32)))
  params = jax.tree.map(lambda a: a + 0.1 * jnp.arange(C, dtype=a.dtype) / C,
                        variables['params'])
  stats = variables[ns.NORM_STATS]
  gain, bias = (np.asarray(params[k], np.float64) for k in ('scale', 'bias'))
  phi, ema_gz = np.ones(C), np.zeros(C)
  for step in range(1, 7):
    x, dy = jnp.asarray(xs[step - 1], jnp.float32), jnp.asarray(dys[step - 1], jnp.float32)

    def loss(p, s):   # the token mean of a summed-loss reference's dy . y
      y, _ = norm.apply({'params': p, ns.NORM_STATS: s}, x, mutable=[ns.NORM_STATS])
      return jnp.sum(dy * y.reshape(12, C)) / 12, y
    (_, y), (dp, cot) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, stats)
    stats = ns.update(stats, cot, norm.stats)
    g = xs[step - 1].reshape(12, G, C // G)
    s = (g / np.sqrt((g * g).mean(-1, keepdims=True) + eps)).reshape(12, C)
    y_ref, phi, ema_gz, _, dgain, dbias = _np_power_norm(s, gain, bias, phi, ema_gz,
                                                         dys[step - 1], step, warmup, eps,
                                                         a_fwd, a_bkw)
    np.testing.assert_allclose(np.asarray(y).reshape(12, C), y_ref, rtol=1e-4, atol=1e-5)
    for got, want in ((stats['phi'], phi), (stats['gz'], ema_gz),
                      (stats['psi2'], (s * s).mean(0)), (dp['scale'], dgain / 12),
                      (dp['bias'], dbias / 12)):
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)
    assert float(stats['count']) == step
  y_eval = norm.apply({'params': params, ns.NORM_STATS: stats}, jnp.asarray(xs[0], jnp.float32))
  g = xs[0].reshape(12, G, C // G)
  s = (g / np.sqrt((g * g).mean(-1, keepdims=True) + eps)).reshape(12, C)
  np.testing.assert_allclose(np.asarray(y_eval).reshape(12, C),
                             gain * s / np.sqrt(phi + eps) + bias, rtol=1e-4, atol=1e-5)


def _norm_train_step(norm, cfg, N, C):
  """A jitted training step of statistics norm module `norm` under the loss sum(dy . y) / N
  (the token mean of a summed-loss reference's dy . y): (params, stats, x, dy) -> (y, dx,
  d params, next stats from the cotangents)."""
  from sharenet.models import norm_stats as ns

  @jax.jit
  def step(params, stats, x, dy):
    def loss(x, p, s):
      y, _ = norm.apply({'params': p, ns.NORM_STATS: s}, x, mutable=[ns.NORM_STATS])
      return jnp.sum(dy * y.reshape(N, C)) / N, y
    (_, y), (dx, dp, cot) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        x, params, stats)
    return y, dx, dp, ns.update(stats, cot, cfg)
  return step


def _np_unified_norm_step(x, dy, gain, bias, st, t, M, warmup, eps, m, outlier):
  """UN2dFunction (hikvision-research/Unified-Normalization) restated in float64 numpy: one
  training step's forward, backward and state updates; `st` is updated in place."""
  x2 = (x * x).mean(0)
  recorded = np.var(np.sqrt(st['buffer_x2']), ddof=1)
  st['buffer_x2'][t % M] = x2
  skip = M <= 1
  if t >= warmup and outlier:
    buf = st['buffer_x2']
    am, gm = buf.mean(0), np.exp(np.log(buf).mean(0))
    if ((am - gm) > recorded * M).sum() > 0:
      buf[t % M] = st['running_var']
      skip = True
      st['skips'] += 1
  if t <= M or t < warmup or skip:
    var = x2
  else:
    var = np.exp(np.log(st['buffer_x2']).mean(0))
  r = np.sqrt(var + eps) / np.sqrt(st['running_var'] + eps)
  r = np.ones_like(r) if t <= max(1000, warmup) or skip else np.clip(r, 0.2, 5)
  z = x / np.sqrt(var + eps)
  st['running_var'] = m * st['running_var'] + (1 - m) * var
  y = gain * z + bias
  g = dy * gain * r
  gz = (g * z).mean(0)
  st['buffer_gz'][t % M] = st['ema_gz'] if skip else gz
  mean_gz = gz if (t <= M or t < warmup or skip) else st['buffer_gz'].mean(0)
  st['ema_gz'] = st['ema_gz'] * m + (1 - m) * mean_gz
  dx = (g - (mean_gz if skip else st['ema_gz']) * z) / np.sqrt(var + eps)
  return y, dx, (dy * r * z).sum(0), dy.sum(0), skip


@pytest.mark.parametrize('outlier', [False, True])
def test_unified_norm_matches_the_reference_over_a_thousand_steps(outlier):
  """norms.Norm(kind='unified_norm') for 1,006 training steps against UN2dFunction restated in
  numpy: the batch statistic in warmup and the first window, then the window's geometric mean
  (fluctuation smoothing), the gradient compensation r after step 1,000, the backward's window
  and EMA of gz, the outlier filter (a batch 30x larger after warmup is skipped), the running
  statistic, and eval mode on it; output, dx, the gains' gradients and every statistic each
  step (sharenet's loss is the token mean: its dx and gains' gradients are 1/N of the
  reference's, its statistics equal)."""
  import flax.linen as nn
  from sharenet.models import norm_stats as ns
  from sharenet.models.sections import NormConfig
  from sharenet.models.norms import Norm
  eps, m, warmup, M, C, N, steps = 1e-5, 0.9, 5, 3, 6, 8, 1006
  cfg = NormConfig(kind='unified_norm', stats_momentum=m, stats_warmup=warmup, stats_window=M,
                   outlier_filter=outlier)
  norm = Norm('unified_norm', eps, stats=cfg)
  rng = np.random.default_rng(1)
  scale = rng.uniform(0.5, 2, C)
  variables = nn.unbox(norm.init(jax.random.key(0), jnp.ones((2, 4, C))))
  params = jax.tree.map(lambda a: a + 0.1 * jnp.arange(C, dtype=a.dtype) / C,
                        variables['params'])
  gain, bias = (np.asarray(params[k], np.float64) for k in ('scale', 'bias'))
  stats = variables[ns.NORM_STATS]
  ref = {'running_var': np.ones(C), 'ema_gz': np.zeros(C), 'buffer_x2': np.zeros((M, C)),
         'buffer_gz': np.zeros((M, C)), 'skips': 0}

  step = _norm_train_step(norm, cfg, N, C)

  skipped = []
  for t in range(1, steps + 1):
    x = rng.normal(size=(2, 4, C)) * scale * rng.uniform(0.7, 1.4)
    if t == 30:
      x = x * 30.0   # an outlier batch after warmup
    dy = rng.normal(size=(N, C))
    y, dx, dp, stats = step(params, stats, jnp.asarray(x, jnp.float32),
                            jnp.asarray(dy, jnp.float32))
    y_ref, dx_ref, dgain, dbias, skip = _np_unified_norm_step(
        x.reshape(N, C), dy, gain, bias, ref, t, M, warmup, eps, m, outlier)
    skipped.append(skip)
    if t in (1, 3, 4, 5, 6, 29, 30, 31, 999, 1000, 1001, steps):
      np.testing.assert_allclose(np.asarray(y).reshape(N, C), y_ref, rtol=2e-4, atol=1e-5)
      np.testing.assert_allclose(np.asarray(dx).reshape(N, C), dx_ref / N, rtol=2e-3,
                                 atol=1e-6, err_msg=str(t))
      np.testing.assert_allclose(np.asarray(dp['scale']), dgain / N, rtol=2e-3, atol=1e-6)
      np.testing.assert_allclose(np.asarray(dp['bias']), dbias / N, rtol=1e-4, atol=1e-6)
      for k in ('running_var', 'ema_gz', 'buffer_x2', 'buffer_gz'):
        np.testing.assert_allclose(np.asarray(stats[k]), ref[k], rtol=2e-3, atol=1e-6,
                                   err_msg=f'{k} at step {t}')
  assert float(stats['count']) == steps and float(stats['skips']) == ref['skips']
  assert (ref['skips'] > 0) == outlier and skipped[29] == outlier
  x = rng.normal(size=(2, 4, C))
  y_eval = norm.apply({'params': params, ns.NORM_STATS: stats}, jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(np.asarray(y_eval),
                             gain * x / np.sqrt(ref['running_var'] + eps) + bias, rtol=1e-3,
                             atol=1e-5)


def _np_online_norm_step(x, dy, gain, bias, st, a_fwd, a_bkw, eps, clamp):
  """OnlineNorm1d (Cerebras/online-normalization, numpy_on/online_norm_1d.py) restated: the
  rows in order, Norm1d's forward and control-process backward, the affine map and activation
  clamping; `st` (m, var, u, v) is updated in place. -> (y, dx, d gain, d bias)."""
  n = x.shape[0]
  center, scale = np.empty_like(x), np.empty_like(x)
  for i in range(n):
    center[i], scale[i] = st['m'], np.sqrt(st['var'] + eps)
    st['var'] = a_fwd * st['var'] + a_fwd * (1 - a_fwd) * (x[i] - st['m']) ** 2
    st['m'] = st['m'] + (1 - a_fwd) * (x[i] - st['m'])
  out = (x - center) / scale
  y = np.clip(out * gain + bias, -clamp, clamp)
  g_aff = np.where(np.abs(y) >= clamp, 0.0, dy)
  dgain, dbias = (g_aff * out).sum(0), g_aff.sum(0)
  g = g_aff * gain
  dx = np.empty_like(x)
  for i in range(n):
    grad = g[i] - (1 - a_bkw) * st['v'] * out[i]
    st['v'] = st['v'] + grad * out[i]
    grad = grad / scale[i]
    dx[i] = grad - (1 - a_bkw) * st['u']
    st['u'] = st['u'] + dx[i]
  return y, dx, dgain, dbias


def test_online_norm_matches_the_reference_over_steps():
  """norms.Norm(kind='online_norm') for 4 training steps against OnlineNorm1d restated in
  numpy (the rows as a stream carried across steps, the control processes u and v, clamping at
  +-5, which a scaled input reaches): output, dx, the gains' gradients and the four statistics
  each step; eval mode reads the last statistics. sharenet's loss is the token mean: its dx and
  gains' gradients are 1/N of the reference's."""
  import flax.linen as nn
  from sharenet.models import norm_stats as ns
  from sharenet.models.sections import NormConfig
  from sharenet.models.norms import Norm
  eps, a_fwd, a_bkw, C, N = 1e-5, 0.9, 0.8, 6, 12
  cfg = NormConfig(kind='online_norm', stats_momentum=a_fwd, stats_grad_momentum=a_bkw)
  norm = Norm('online_norm', eps, stats=cfg)
  rng = np.random.default_rng(2)
  variables = nn.unbox(norm.init(jax.random.key(0), jnp.ones((3, 4, C))))
  params = jax.tree.map(lambda a: a + 0.3 * jnp.arange(C, dtype=a.dtype) / C,
                        variables['params'])
  gain, bias = (np.asarray(params[k], np.float64) for k in ('scale', 'bias'))
  stats = variables[ns.NORM_STATS]
  ref = {'m': np.zeros(C), 'var': np.ones(C), 'u': np.zeros(C), 'v': np.zeros(C)}

  step = _norm_train_step(norm, cfg, N, C)

  clamped = 0
  for t in range(4):
    x = rng.normal(size=(3, 4, C)) * rng.uniform(0.5, 2, C) + rng.normal(size=C)
    if t == 2:
      x = x * 8.0   # some outputs reach the clamp
    dy = rng.normal(size=(N, C))
    y, dx, dp, stats = step(params, stats, jnp.asarray(x, jnp.float32),
                            jnp.asarray(dy, jnp.float32))
    y_ref, dx_ref, dgain, dbias = _np_online_norm_step(x.reshape(N, C), dy, gain, bias, ref,
                                                       a_fwd, a_bkw, eps, 5.0)
    clamped += int((np.abs(y_ref) >= 5).sum())
    np.testing.assert_allclose(np.asarray(y).reshape(N, C), y_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx).reshape(N, C), dx_ref / N, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dp['scale']), dgain / N, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dp['bias']), dbias / N, rtol=1e-3, atol=1e-6)
    for k, r in (('mean', 'm'), ('var', 'var'), ('u', 'u'), ('v', 'v')):
      np.testing.assert_allclose(np.asarray(stats[k]), ref[r], rtol=1e-4, atol=1e-6,
                                 err_msg=f'{k} at step {t}')
  assert clamped > 0 and float(stats['count']) == 4
  x = rng.normal(size=(3, 4, C))
  y_eval = norm.apply({'params': params, ns.NORM_STATS: stats}, jnp.asarray(x, jnp.float32))
  want = np.clip((x - ref['m']) / np.sqrt(ref['var'] + eps) * gain + bias, -5, 5)
  np.testing.assert_allclose(np.asarray(y_eval), want, rtol=1e-4, atol=1e-5)
