"""The fused residual-add + norm Pallas kernels (sharenet/kernels/norms.py), in interpret mode.

Kernel against the jnp reference (values and gradients of x, residual, gain, bias) in float32
and bfloat16; the reference against the float64 formulas and against sharenet.models.norms.Norm; and
the model with model.kernels=pallas against model.kernels=xla under nn.scan (untied plan, and a
cycle plan with per-applied-layer norm gains) and under remat. Interpret mode is ~500x slower
than jnp: shapes are tiny and row counts odd (the kernels pad rows to a block).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta
from flax.traverse_util import flatten_dict

from sharenet.errors import ConfigError
from sharenet.kernels import norms as K
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.models.norms import Norm
from sharenet.models.params import PER_LAYER

EPS = 1e-6
SHAPE = (3, 5, 48)      # 15 rows: padded to 16, two blocks of 8
HAS_BIAS = {'layernorm': True, 'rmsnorm': False, 'crmsnorm': False}


def _inputs(shape=SHAPE, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  d = shape[-1]
  x = (2.0 * jax.random.normal(k[0], shape) + 0.5).astype(dtype)    # nonzero row means
  residual = jax.random.normal(k[1], shape).astype(dtype)
  gain = 1.0 + 0.3 * jax.random.normal(k[2], (d,))
  bias = 0.3 * jax.random.normal(k[3], (d,))
  return x, residual, gain, bias


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def _formula(kind, s, gain, bias):
  """sharenet/models/norms.py's formulas in float64 numpy."""
  s = np.asarray(s, np.float64)
  d = s.shape[-1]
  if kind == 'layernorm':
    c = s - s.mean(-1, keepdims=True)
    y = c / np.sqrt((c ** 2).mean(-1, keepdims=True) + EPS)
  elif kind == 'rmsnorm':
    y = s / np.sqrt((s ** 2).mean(-1, keepdims=True) + EPS)
  else:
    ms = ((s ** 2).sum(-1, keepdims=True) + s.sum(-1, keepdims=True) ** 2) / (d + 1)
    y = s / np.sqrt(ms + EPS)
  y = y * np.asarray(gain, np.float64)
  return y + np.asarray(bias, np.float64) if bias is not None else y


def _grads(fn, kind, x, residual, gain, bias):
  """Gradients of <y, cy> + <s, cs> (fixed random cotangents, so both outputs are used)."""
  k1, k2 = jax.random.split(jax.random.key(9))
  cy = jax.random.normal(k1, x.shape).astype(x.dtype)
  cs = jax.random.normal(k2, x.shape).astype(x.dtype)

  def loss(x, residual, gain, bias):
    s, y = fn(x, residual, gain, bias, kind=kind, eps=EPS)
    return (jnp.sum((y * cy).astype(jnp.float32)) + jnp.sum((s * cs).astype(jnp.float32)))
  return jax.grad(loss, argnums=(0, 1, 2, 3))(x, residual, gain, bias)


# ---- kernel vs reference -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('with_residual', [True, False])
@pytest.mark.parametrize('kind', K.KINDS)
def test_kernel_matches_reference_fp32(kind, with_residual):
  x, residual, gain, bias = _inputs()
  residual = residual if with_residual else None
  bias = bias if HAS_BIAS[kind] else None
  s, y = K.add_norm(x, residual, gain, bias, kind=kind, eps=EPS)
  s_ref, y_ref = K.reference_add_norm(x, residual, gain, bias, kind=kind, eps=EPS)
  np.testing.assert_array_equal(s, s_ref)
  assert _rel(y, y_ref) <= 1e-5
  assert _rel(y, _formula(kind, np.asarray(x) + (0 if residual is None else residual), gain,
                          bias)) <= 1e-5
  got = _grads(K.add_norm, kind, x, residual, gain, bias)
  want = _grads(K.reference_add_norm, kind, x, residual, gain, bias)
  for name, g, w in zip(('x', 'residual', 'gain', 'bias'), got, want):
    if w is None:
      assert g is None, name
    else:
      assert _rel(g, w) <= 1e-4, name
  if residual is not None:   # s = x + residual: both get the same cotangent
    np.testing.assert_array_equal(got[0], got[1])


@pytest.mark.parametrize('kind', K.KINDS)
def test_kernel_matches_reference_bf16(kind):
  """bf16 input, float32 statistics: y within 2 bf16 ulps (2^-7 relative) of the reference;
  gradients (dx in bf16, gains float32 sums of bf16 products) within 2e-2 of the max."""
  x, residual, gain, bias = _inputs(dtype=jnp.bfloat16, seed=1)
  bias = bias if HAS_BIAS[kind] else None
  s, y = K.add_norm(x, residual, gain, bias, kind=kind, eps=EPS)
  s_ref, y_ref = K.reference_add_norm(x, residual, gain, bias, kind=kind, eps=EPS)
  assert s.dtype == y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(s, s_ref)
  assert _rel(y, y_ref) <= 2 ** -7
  got = _grads(K.add_norm, kind, x, residual, gain, bias)
  want = _grads(K.reference_add_norm, kind, x, residual, gain, bias)
  assert got[0].dtype == jnp.bfloat16 and got[2].dtype == jnp.float32
  for name, g, w in zip(('x', 'residual', 'gain', 'bias'), got, want):
    if w is not None:
      assert _rel(g, w) <= 2e-2, name


def test_any_leading_shape_and_block_size():
  """A 4-D input, one row per block (15 grid steps) and one block for all rows agree."""
  x, residual, gain, _ = _inputs(shape=(1, 3, 5, 32), seed=2)
  want = K.reference_add_norm(x, residual, gain, None, kind='rmsnorm', eps=EPS)
  for rows in (1, 16):
    got = K.add_norm(x, residual, gain, None, kind='rmsnorm', eps=EPS, block_rows=rows)
    assert got[1].shape == x.shape
    assert _rel(got[1], want[1]) <= 1e-5


# ---- reference vs Norm ---------------------------------------------------------------------

@pytest.mark.parametrize('kind', K.KINDS)
def test_reference_is_bit_identical_to_norm(kind):
  x, residual, gain, bias = _inputs(seed=3)
  norm = Norm(kind, eps=EPS)
  params = {'scale': gain} | ({'bias': bias} if HAS_BIAS[kind] else {})
  s, y = K.reference_add_norm(x, residual, gain, params.get('bias'), kind=kind, eps=EPS)
  np.testing.assert_array_equal(y, norm.apply({'params': params}, x + residual))
  # The module's residual form is the same pair, on the kernel path as on the jnp one.
  for kernels in ('xla', 'pallas'):
    s2, y2 = Norm(kind, eps=EPS, kernels=kernels).apply({'params': params}, x, residual)
    np.testing.assert_array_equal(s2, s)
    assert _rel(y2, y) <= 1e-5, kernels


@pytest.mark.parametrize('kind', K.KINDS)
def test_norm_kernel_path_keeps_parameters(kind):
  """Same names, shapes and collection (checkpoints load on either path)."""
  x = jnp.ones((2, 3, 16))
  trees = [meta.unbox(Norm(kind, collection=PER_LAYER, kernels=k).init(
      {'params': jax.random.key(0), PER_LAYER: jax.random.key(1)}, x)) for k in ('xla', 'pallas')]
  flat = [{p: v.shape for p, v in flatten_dict(t).items()} for t in trees]
  assert flat[0] == flat[1] and all(p[0] == PER_LAYER for p in flat[0])


# ---- dispatch and constraints --------------------------------------------------------------

def test_auto_dispatch_and_fallback(monkeypatch, capsys):
  x, residual, gain, _ = _inputs(seed=4)
  want = K.reference_add_norm(x, residual, gain, None, kind='rmsnorm', eps=EPS)
  # CPU: auto and xla are the reference, bit for bit.
  for kernels in ('auto', 'xla'):
    got = K.add_norm_auto(x, residual, gain, None, kind='rmsnorm', eps=EPS, kernels=kernels)
    np.testing.assert_array_equal(got[1], want[1])
  # A shape the kernel cannot take: the reference, with one line on stderr.
  monkeypatch.setattr(K, 'unsupported', lambda shape, platform=None: 'a test shape')
  got = K.add_norm_auto(x, residual, gain, None, kind='rmsnorm', eps=EPS, kernels='pallas')
  np.testing.assert_array_equal(got[1], want[1])
  assert 'add_norm (rmsnorm) kernel cannot take a test shape' in capsys.readouterr().err
  with pytest.raises(ConfigError, match='model.kernels'):
    K.add_norm_auto(x, residual, gain, None, kind='rmsnorm', eps=EPS, kernels='triton')
  with pytest.raises(ValueError, match='valid: layernorm, rmsnorm, crmsnorm'):
    K.add_norm(x, residual, gain, None, kind='dyt', eps=EPS)


def test_lowering_constraints():
  assert K.unsupported((4, 768), 'gpu') and 'power-of-two' in K.unsupported((4, 768), 'gpu')
  assert K.unsupported((4, 1024), 'gpu') is None
  assert K.unsupported((4, 768), 'tpu') is None       # D is the whole row: any D on Mosaic
  for platform in ('gpu', 'tpu'):
    for n, d in ((4096, 1024), (7, 4096), (8192, 256)):
      rows = K.block_rows_for(n, d, platform)
      assert rows & (rows - 1) == 0 and rows <= max(8, n)
      assert platform == 'gpu' or rows >= 8              # Mosaic's sublane tile
  assert K.block_rows_for(4096, 1024, 'gpu') * 1024 <= K.GPU_BLOCK_ELEMENTS
  # bf16 forward with a residual: x, residual in; s, y out; one float32 stat per row; the gain.
  assert K.forward_bytes((2, 4096, 1024), jnp.bfloat16) == 4 * 8192 * 1024 * 2 + 8192 * 4 + 4096


# ---- the model: pallas vs xla --------------------------------------------------------------

def _model_cfg(norm, scheme, **kw):
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, mlp_dim=48, remat='none',
              norm=dict(kind=norm), kernels='xla')
  sharing = dict(scheme=scheme)
  if scheme == 'cycle':   # one set applied twice, its norm gains per applied layer
    sharing.update(repeats=2, untie_norms=True)
  return ModelConfig(**base, sharing=sharing).derive(**kw)


def _loss(variables, model, tokens_BT):
  logits = model.apply(variables, tokens_BT[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:]).mean()


@functools.partial(jax.jit, static_argnums=1)
def _loss_and_grad(variables, cfg, tokens_BT):
  return jax.value_and_grad(_loss)(variables, DecoderLM(cfg), tokens_BT)


@pytest.fixture(scope='module')
def xla_reference():
  """(cfg, variables with gains away from 1, tokens, loss, grads) per (norm, scheme)."""
  cache = {}
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 64)   # 2 x 7 = 14 rows

  def get(norm, scheme):
    if (norm, scheme) not in cache:
      cfg = _model_cfg(norm, scheme)
      v = init_variables(DecoderLM(cfg), jax.random.key(1))
      leaves, tree = jax.tree.flatten(v)
      keys = jax.random.split(jax.random.key(2), len(leaves))
      v = jax.tree.unflatten(tree, [l + 0.1 * jax.random.normal(k, l.shape)
                                    for k, l in zip(keys, leaves)])
      cache[norm, scheme] = (cfg, v, tokens, *_loss_and_grad(v, cfg, tokens))
    return cache[norm, scheme]
  return get


def _assert_same(loss, grads, ref_loss, ref_grads):
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  flat, ref = flatten_dict(grads), flatten_dict(ref_grads)
  assert flat.keys() == ref.keys()
  for path, g in flat.items():
    assert _rel(g, ref[path]) <= 1e-4, path


@pytest.mark.slow
@pytest.mark.parametrize('scheme', ['untied', 'cycle'])
@pytest.mark.parametrize('norm', K.KINDS)
def test_model_pallas_matches_xla(norm, scheme, xla_reference):
  cfg, v, tokens, ref_loss, ref_grads = xla_reference(norm, scheme)
  pcfg = cfg.derive(kernels='pallas')
  if scheme == 'cycle':
    assert PER_LAYER in v
  _assert_same(*_loss_and_grad(v, pcfg, tokens), ref_loss, ref_grads)


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['dots', pytest.param('full', marks=pytest.mark.slow)])
def test_model_pallas_under_remat(remat, xla_reference):
  cfg, v, tokens, ref_loss, ref_grads = xla_reference('rmsnorm', 'cycle')
  pcfg = cfg.derive(kernels='pallas', remat=remat)
  _assert_same(*_loss_and_grad(v, pcfg, tokens), ref_loss, ref_grads)


def test_pre_norm_block_fuses_the_attention_residual(monkeypatch):
  """On the kernel path each pre-norm block calls the kernel once with a residual (the MLP
  norm), once without (the attention norm); the final norm once without. The parameter tree
  is the xla path's (checkpoints and per-layer gains carry over)."""
  calls = []
  real = K.add_norm

  def spy(x, residual, *args, **kw):
    calls.append(residual is not None)
    return real(x, residual, *args, **kw)
  monkeypatch.setattr(K, 'add_norm', spy)
  cfg = _model_cfg('rmsnorm', 'cycle')
  shapes = lambda c: jax.tree.map(jnp.shape, jax.eval_shape(
      lambda: init_variables(DecoderLM(c), jax.random.key(1))))
  xla_shapes = shapes(cfg)
  assert not calls
  assert shapes(cfg.derive(kernels='pallas')) == xla_shapes
  assert PER_LAYER in xla_shapes
  # nn.scan traces the block body once per scan level; the final norm once.
  assert calls.count(True) >= 1 and calls.count(True) == calls.count(False) - 1


@pytest.mark.slow
@pytest.mark.parametrize('placement, umup', [('peri', False), ('pre', True)])
def test_model_pallas_other_placements(placement, umup):
  """Peri-norm (norms on branch outputs too) and u-muP's residual rule (pre-norm, no fused add;
  alphas (0.5, 0.5)) run every norm through the unfused kernel; the same loss and gradients as
  xla."""
  cfg = _model_cfg('layernorm', 'cycle').derive(
      norm=dict(placement=placement),
      parametrization=dict(kind='umup', residual_mult=0.5) if umup else {})
  assert cfg.umup_residual == ((0.5, 0.5) if umup else ())
  v = init_variables(DecoderLM(cfg), jax.random.key(1))
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 64)
  _assert_same(*_loss_and_grad(v, cfg.derive(kernels='pallas'), tokens),
               *_loss_and_grad(v, cfg, tokens))
