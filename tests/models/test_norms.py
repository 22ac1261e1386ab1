"""Tests for sharenet.models.norms: each activation norm against its formula, gains, collections."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.config import defaults
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.models.norms import KINDS, Norm
from sharenet.models.params import PER_LAYER

D = 16
EPS = 1e-6
# Parameters each kind creates and their initial values (scalars: shape ()).
PARAMS = {
    'layernorm': {'scale': np.ones(D), 'bias': np.zeros(D)},
    'rmsnorm': {'scale': np.ones(D)},
    'crmsnorm': {'scale': np.ones(D)},
    'scalenorm': {'g': np.float32(math.sqrt(D))},
    'dyt': {'alpha': np.float32(0.5), 'scale': np.ones(D), 'bias': np.zeros(D)},
    'l2': {},
    'none': {},
    'lpnorm': {'scale': np.ones(D), 'bias': np.zeros(D)},   # p = 2 (Norm's default)
    'powernorm': {'scale': np.ones(D), 'bias': np.zeros(D)},   # eval mode, phi at init (ones)
    'unified_norm': {'scale': np.ones(D), 'bias': np.zeros(D)},   # eval mode, running_var = 1
    'online_norm': {'scale': np.ones(D), 'bias': np.zeros(D)},   # eval mode, mean 0, var 1
}


def _cfg(**kw):
  base = dict(vocab_size=64, d_model=16, num_layers=2, num_heads=2, mlp_dim=24, remat='none',
              norm=dict(kind='layernorm'))
  return ModelConfig(**base).derive(**kw)


def _tokens(T=10, vocab=64):
  return jax.random.randint(jax.random.key(7), (2, T), 0, vocab)


def _expected(kind, x, p):
  """The norm's formula in float64 numpy over the last axis."""
  x = np.asarray(x, np.float64)
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  sq = np.sum(x ** 2, -1, keepdims=True)
  if kind == 'layernorm':
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return p['scale'] * (x - mu) / np.sqrt(var + EPS) + p['bias']
  if kind == 'lpnorm':   # p = 2, the 2nd absolute central moment (other p: test_norms_family.py)
    xc = x - x.mean(-1, keepdims=True)
    return p['scale'] * xc / np.sqrt(np.mean(np.abs(xc) ** 2, -1, keepdims=True) + EPS) + p['bias']
  if kind == 'rmsnorm':
    return p['scale'] * x / np.sqrt(sq / x.shape[-1] + EPS)
  if kind == 'crmsnorm':
    # x is the compressed form of the zero-mean (d+1)-vector [x, -sum x]: RMS over d+1 entries.
    full = np.concatenate([x, -x.sum(-1, keepdims=True)], -1)
    return p['scale'] * x / np.sqrt(np.mean(full ** 2, -1, keepdims=True) + EPS)
  if kind == 'scalenorm':
    return p['g'] * x / np.maximum(np.sqrt(sq), EPS)
  if kind == 'online_norm':   # eval mode at init (mean 0, var 1), then the clamp to +-5
    return np.clip(p['scale'] * x / np.sqrt(1 + EPS) + p['bias'], -5, 5)
  if kind == 'unified_norm':   # eval mode: the running statistic, 1 at init
    return p['scale'] * x / np.sqrt(1 + EPS) + p['bias']
  if kind == 'powernorm':   # eval mode: group scaling (1 group), then the running phi = 1
    s = x / np.sqrt(sq / x.shape[-1] + EPS)
    return p['scale'] * s / np.sqrt(1 + EPS) + p['bias']
  if kind == 'dyt':
    return p['scale'] * np.tanh(p['alpha'] * x) + p['bias']
  if kind == 'l2':
    return x / np.maximum(np.sqrt(sq), EPS)
  assert kind == 'none'
  return x


def _randomized(params, seed=5):
  """Gains and biases away from their initial values, so each one enters the check."""
  flat = flatten_dict(params)
  keys = jax.random.split(jax.random.key(seed), max(len(flat), 1))
  return unflatten_dict({path: v + 0.3 * jax.random.normal(k, jnp.shape(v))
                         for k, (path, v) in zip(keys, flat.items())})


@pytest.mark.parametrize('kind', KINDS)
def test_each_kind_matches_its_formula(kind):
  x = 2.0 * jax.random.normal(jax.random.key(0), (3, 4, D)) + 0.5   # nonzero mean per row
  norm = Norm(kind, eps=EPS)
  v = meta.unbox(norm.init(jax.random.key(1), x))
  params = v.get('params', {})
  assert set(params) == set(PARAMS[kind])
  for name, want in PARAMS[kind].items():
    assert params[name].shape == np.shape(want), name
    np.testing.assert_allclose(params[name], want, rtol=1e-6, err_msg=name)
  np.testing.assert_allclose(norm.apply(v, x), _expected(kind, x, params), rtol=1e-5, atol=1e-6)
  params = _randomized(params)
  state = {k: c for k, c in v.items() if k != 'params'}   # powernorm's running statistics
  np.testing.assert_allclose(norm.apply({'params': params, **state}, x),
                             _expected(kind, x, params), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('kind', ['layernorm', 'rmsnorm', 'crmsnorm', 'dyt'])
def test_bfloat16_input_keeps_its_dtype_and_is_computed_in_float32(kind):
  x = jax.random.normal(jax.random.key(0), (2, D)).astype(jnp.bfloat16)
  norm = Norm(kind, eps=EPS)
  v = norm.init(jax.random.key(1), x)
  y = norm.apply(v, x)
  assert y.dtype == jnp.bfloat16
  want = _expected(kind, x.astype(jnp.float32), meta.unbox(v)['params'])
  np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize('kind', ['layernorm', 'scalenorm', 'dyt'])
def test_per_layer_collection_holds_the_gains(kind):
  x = jax.random.normal(jax.random.key(0), (2, D))
  norm = Norm(kind, eps=EPS, collection=PER_LAYER)
  v = norm.init({'params': jax.random.key(1), PER_LAYER: jax.random.key(2)}, x)
  assert 'params' not in v
  gains = meta.unbox(v)[PER_LAYER]
  assert set(gains) == set(PARAMS[kind])
  # Boxed with logical axes, so the gains shard like 'params' ones ('embed' by default).
  boxed = v[PER_LAYER]['scale' if kind != 'scalenorm' else 'g']
  assert boxed.names == (('embed',) if kind != 'scalenorm' else ())
  gains = _randomized(gains)
  np.testing.assert_allclose(norm.apply({PER_LAYER: gains}, x), _expected(kind, x, gains),
                             rtol=1e-5, atol=1e-6)


def test_unknown_kind_is_a_one_line_error():
  x = jnp.ones((2, D))
  with pytest.raises(ValueError, match=r"unknown norm 'batchnorm'; valid: layernorm, rmsnorm") as e:
    Norm('batchnorm').init(jax.random.key(0), x)
  assert '\n' not in str(e.value)


def test_eps_guards_an_all_zero_row():
  x = jnp.zeros((1, D))
  for kind in KINDS:
    v = Norm(kind).init(jax.random.key(0), x)
    y = Norm(kind).apply(v, x)
    assert bool(jnp.all(jnp.isfinite(y))), kind


# Moved from tests/transforms/test_transforms.py.

@pytest.mark.parametrize('kind', ['scalenorm', 'l2'])
def test_scale_invariant_norms(kind):
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  norm = Norm(kind)
  v = norm.init(jax.random.key(1), x)
  np.testing.assert_allclose(norm.apply(v, 4.5 * x), norm.apply(v, x), rtol=1e-5, atol=1e-6)
  if kind == 'scalenorm':   # output norm equals g = sqrt(d)
    np.testing.assert_allclose(jnp.linalg.norm(norm.apply(v, x), axis=-1), 4.0, rtol=1e-5)


def test_l2_qk_norm_gain_starts_from_the_training_length():
  """g_0 = log2(L^2 - L) with L the training sequence length (Henry et al., arXiv:2010.04245,
  section 3), not the position limit max_len."""
  cfg = _cfg(norm=dict(kind='rmsnorm', qk_norm='l2', qk_norm_len=16), max_len=2048)
  flat = flatten_dict(init_variables(DecoderLM(cfg), jax.random.key(0))['params'])
  scales = [x for p, x in flat.items() if p[-1] == 'qk_scale']
  assert scales and all(np.allclose(s, math.log2(16 * 16 - 16)) for s in scales)
  c = defaults.default_config()
  c.model.norm.qk_norm, c.model.max_len, c.train.seq_len = 'l2', 4096, 32
  assert ModelConfig.from_config(c.model, c.train.seq_len).norm.qk_norm_len == 32
  c.model.norm.qk_norm_len = 24   # an explicit L wins
  assert ModelConfig.from_config(c.model, c.train.seq_len).norm.qk_norm_len == 24
  with pytest.raises(ConfigError, match='qk_norm_len'):
    _cfg(norm=dict(qk_norm='l2', qk_norm_len=1))


@pytest.mark.parametrize('gain', [pytest.param(None, marks=pytest.mark.slow), 3.0, 40.0])
def test_l2_qk_norm_logits_are_bounded_by_the_gain(gain):
  """|logit| = g |q_hat . k_hat| <= g for every head and position pair, with q_hat, k_hat the
  unit vectors the module produced; the module's own logits (their sown mean |.|) match
  g q_hat . k_hat, also after g is changed."""
  cfg = _cfg(norm=dict(kind='rmsnorm', qk_norm='l2', qk_norm_len=16), position='none', num_heads=4,
             num_kv_heads=2)
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  flat = dict(flatten_dict(v['params']))
  if gain is not None:
    flat = {p: (jnp.full_like(x, gain) if p[-1] == 'qk_scale' else x) for p, x in flat.items()}
  g = np.asarray([x for p, x in flat.items() if p[-1] == 'qk_scale'][0], np.float64)  # (L,)
  v = {**v, 'params': unflatten_dict(flat)}
  toks = jax.random.randint(jax.random.key(3), (3, 12), 0, 64)
  _, st = DecoderLM(cfg).apply(v, toks, capture_intermediates=True, mutable=['intermediates'])
  attn = st['intermediates']['stack']['segment_0']['level']['block']['attn']
  q = np.asarray(attn['q_norm']['__call__'][0][0], np.float64)   # (L, B, T, H, D)
  k = np.asarray(attn['k_norm']['__call__'][0][0], np.float64)   # (L, B, T, K, D)
  np.testing.assert_allclose(np.linalg.norm(q, axis=-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(k, axis=-1), 1.0, atol=1e-5)
  k = np.repeat(k, q.shape[3] // k.shape[3], axis=3)             # query head h reads kv h // G
  logits = g[:, None, None, None, None] * np.einsum('lbthd,lbshd->lbhts', q, k)
  causal = np.tril(np.ones((12, 12), bool))
  assert np.all(np.abs(logits) <= g[:, None, None, None, None] * (1 + 1e-5))
  mean_abs = np.abs(logits)[..., causal].mean(axis=(1, 2, 3))    # per layer
  np.testing.assert_allclose(np.asarray(attn['attn_logits'][0][0]), mean_abs, rtol=1e-4)
  assert bool(jnp.all(jnp.isfinite(DecoderLM(cfg).apply(v, toks))))


def test_fixnorm_embeddings_have_norm_sqrt_d_at_the_input():
  cfg = _cfg(norm=dict(kind='rmsnorm', fixnorm=True), tie_embeddings=True)
  from sharenet.models.layers import Embed
  emb = Embed(64, 16, 1.0, fixnorm=True)
  v = emb.init(jax.random.key(0), _tokens())
  np.testing.assert_allclose(jnp.linalg.norm(emb.apply(v, _tokens()), axis=-1), 4.0, rtol=1e-5)
  assert bool(jnp.all(jnp.isfinite(DecoderLM(cfg).apply(
      init_variables(DecoderLM(cfg), jax.random.key(0)), _tokens()))))


def test_dyt_is_linear_for_small_alpha_and_crmsnorm_matches_its_formula():
  x = jax.random.normal(jax.random.key(0), (3, 16))
  dyt = Norm('dyt', dyt_alpha=1e-4)
  v = dyt.init(jax.random.key(1), x)
  np.testing.assert_allclose(dyt.apply(v, x), 1e-4 * x, rtol=1e-6, atol=1e-9)
  crms = Norm('crmsnorm', eps=0.0)
  v = crms.init(jax.random.key(1), x)
  full = jnp.concatenate([x, -jnp.sum(x, -1, keepdims=True)], -1)   # the zero-mean 17-vector
  expected = x / jnp.sqrt(jnp.mean(full ** 2, -1, keepdims=True))
  np.testing.assert_allclose(crms.apply(v, x), expected, rtol=1e-5)
