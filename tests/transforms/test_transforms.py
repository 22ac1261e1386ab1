"""Normalization variants as parameter transforms: conversions, invariances, training smoke."""
import functools
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from configs import tiny as tiny_config
from sharenet.config import defaults
from sharenet.optim import chain
from sharenet.train import experiment, loop, trainer, workdir_io
from sharenet.main import convert_workdir, eval_workdir
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.models.sections import LORA_TARGETS
from sharenet.transforms import Transforms, convert, recursive, reparam
from sharenet.transforms.roles import Leaf
from sharenet.transforms.update import scale_by_adamp


def _cfg(**kw):
  base = dict(vocab_size=64, d_model=16, num_layers=2, num_heads=2, mlp_dim=24, remat='none',
              norm=dict(kind='layernorm'))
  return ModelConfig(**base).derive(**kw)


def _randomize_norms(variables, seed=3):
  """Random gains and biases so that folding is exercised (Jiang et al., arXiv:2305.14858);
  drawn on the host (op by op, jax.random would compile each norm's shape)."""
  rng = np.random.default_rng(seed)
  out = {}
  for path, v in flatten_dict(variables['params']).items():
    parent = path[-2] if len(path) > 1 else ''
    if parent.endswith('_norm') and path[-1] in ('scale', 'bias'):
      noise = 0.3 * rng.standard_normal(v.shape)
      v = jnp.asarray(noise + (path[-1] == 'scale'), v.dtype)
    out[path] = v
  return {**variables, 'params': unflatten_dict(out)}


def _max_diff(a, b):   # on the host: op by op, jnp would compile each shape
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _tokens(T=10, vocab=64):
  return jax.random.randint(jax.random.key(7), (2, T), 0, vocab)


@pytest.mark.slow
@pytest.mark.parametrize('tied', [False, True])
@pytest.mark.parametrize('position,scheme', [('learned', 'untied'), ('rope', 'untied'),
                                             ('rope', 'cycle')])
def test_ln_rms_crms_conversion_is_exact_in_float64(tied, position, scheme):
  with jax.enable_x64(True):
    cfg = _cfg(tie_embeddings=tied, position=position, max_len=16, dtype='float64',
               param_dtype='float64', sharing=dict(scheme=scheme,
                                                   repeats=2 if scheme == 'cycle' else 0),
               num_layers=4 if scheme == 'cycle' else 2, embed_init_std=0.5)
    v0 = _randomize_norms(init_variables(DecoderLM(cfg), jax.random.key(0)))
    toks = _tokens()
    logits0 = DecoderLM(cfg).apply(v0, toks)
    cfg1, v1 = convert.ln_to_rms(cfg, v0)
    logits1 = DecoderLM(cfg1).apply(v1, toks)
    cfg2, v2 = convert.rms_to_crms(cfg1, v1)
    logits2 = DecoderLM(cfg2).apply(v2, toks)
    assert cfg1.norm.kind == 'rmsnorm' and cfg2.norm.kind == 'crmsnorm' and cfg2.d_model == 15
    assert _max_diff(logits1, logits0) <= 1e-9
    assert _max_diff(logits2, logits0) <= 1e-9
    # The logits are not trivially equal: the norms' gains and biases matter.
    assert _max_diff(logits0, DecoderLM(cfg).apply(
        init_variables(DecoderLM(cfg), jax.random.key(0)), toks)) > 1e-3


def test_crms_conversion_refuses_a_stream_that_is_not_zero_mean():
  cfg = _cfg(norm=dict(kind='rmsnorm'))
  with pytest.raises(ConfigError, match='not zero-mean'):
    convert.rms_to_crms(cfg, init_variables(DecoderLM(cfg), jax.random.key(0)))
  with pytest.raises(ConfigError, match='layernorm'):
    convert.ln_to_rms(cfg, init_variables(DecoderLM(cfg), jax.random.key(0)))


@pytest.mark.slow
@pytest.mark.parametrize('tied', [False, True])
def test_convert_cli_on_a_trained_pre_ln_checkpoint(tmp_path, tied):
  """Train a Pre-LN model, convert (convert.py once, the library once), evaluate each workdir
  with eval.py's code. Tied: the library conversions only (the CLI path is the same code)."""
  c = tiny_config.get_config()
  c.model.norm.kind = 'layernorm'
  c.model.tie_embeddings = tied
  c.train.steps = 12
  c.data.eval_tokens = 8192   # conftest.EVAL_TOKENS: one batch; the conversions carry it over
  src = str(tmp_path / 'ln')
  loop.train_and_evaluate(c, src)
  base = eval_workdir.evaluate_workdir(src)['eval_loss']
  if tied:
    for to in ('rmsnorm', 'crmsnorm'):
      opts = defaults.conversion_config()
      opts.to = to
      convert_workdir.convert_workdir(src, str(tmp_path / to), opts)
      out = eval_workdir.evaluate_workdir(str(tmp_path / to))
      assert abs(out['eval_loss'] - base) <= 1e-4, (to, out['eval_loss'], base)
    return
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cli = subprocess.run([sys.executable, os.path.join(root, 'convert.py'), '--workdir', src,
                        '--out', str(tmp_path / 'crmsnorm'), '--config.to=crmsnorm'],
                       capture_output=True, text=True, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert cli.returncode == 0, cli.stderr
  opts = defaults.conversion_config()
  opts.to = 'rmsnorm'
  convert_workdir.convert_workdir(src, str(tmp_path / 'rmsnorm'), opts)
  for to in ('rmsnorm', 'crmsnorm'):
    dst = str(tmp_path / to)
    out = eval_workdir.evaluate_workdir(dst)
    assert abs(out['eval_loss'] - base) <= 1e-4, (to, out['eval_loss'], base)
    assert workdir_io.load_config(dst).model.norm.kind == to
  opts.to = 'recursive'
  with pytest.raises(ConfigError, match='num_unique >= 1'):
    convert_workdir.convert_workdir(src, str(tmp_path / 'x'), opts)
  opts.to = 'rmsnorm'
  with pytest.raises(ConfigError, match='not empty'):   # never over a run
    convert_workdir.convert_workdir(src, str(tmp_path / 'rmsnorm'), opts)
  # train.py continues a converted run with its own recorded config (configs/workdir.py).
  from configs import workdir as workdir_config
  dst = str(tmp_path / 'crmsnorm')
  cont = workdir_config.get_config(dst)
  cont.train.steps, cont.train.progress = 14, False
  out = loop.train_and_evaluate(cont, dst)
  assert np.isfinite(out['eval_loss']) and out['eval_loss'] < base + 0.1
  assert sorted(int(d) for d in os.listdir(os.path.join(dst, 'checkpoints'))
                if d.isdigit())[-1] == 14


@pytest.mark.parametrize('L,K,scheme,init,expected', [
    (6, 3, 'cycle', 'stepwise', [[0], [2], [5]]),          # round(2.5) == 2 (banker's)
    (6, 3, 'cycle', 'lower', [[0], [1], [2]]),
    (6, 3, 'cycle', 'average', [[0, 3], [1, 4], [2, 5]]),
    (6, 3, 'sequence', 'average', [[0, 1], [2, 3], [4, 5]]),
    (6, 4, 'middle_cycle', 'stepwise', [[0], [1], [4], [5]]),
    (6, 4, 'middle_cycle', 'lower', [[0], [1], [2], [5]]),
    (6, 4, 'middle_cycle', 'average', [[0], [1, 3], [2, 4], [5]]),
    (8, 5, 'middle_sequence', 'stepwise', [[0], [1], [4], [6], [7]]),
    (8, 5, 'middle_sequence', 'average', [[0], [1, 2], [3, 4], [5, 6], [7]]),
])
def test_recursive_init_source_layers(L, K, scheme, init, expected):
  assert recursive.source_layers(_cfg(num_layers=L), K, scheme, init) == expected


def _apply(cfg, variables):
  """The model's forward on _tokens(), one compiled program (op by op: ~300 small compiles)."""
  return jax.jit(DecoderLM(cfg).apply)(variables, _tokens())


@functools.cache
def _untied_source(tied):
  """(config, variables with randomised norms, logits) of the untied model the SVD-LoRA
  conversions start from, once per embedding tying."""
  cfg = _cfg(norm=dict(kind='rmsnorm'), num_layers=6, d_model=32, num_heads=4, mlp_dim=48,
             tie_embeddings=tied)
  v = _randomize_norms(jax.jit(lambda: init_variables(DecoderLM(cfg), jax.random.key(1)))())
  return cfg, v, _apply(cfg, v)


@pytest.mark.slow
@pytest.mark.parametrize('scheme,K,lora_layers,lora_scale,tied', [
    ('cycle', 3, 'shared', 1.0, False), ('cycle', 3, 'shared', 2.0, True),
    ('middle_cycle', 4, 'shared', 0.5, False), ('middle_cycle', 4, 'shared', 2.0, True),
    ('middle_cycle', 4, 'all', 1.0, False), ('middle_cycle', 4, 'all', 0.5, True)])
def test_full_rank_svd_lora_reproduces_the_untied_model(scheme, K, lora_layers, lora_scale, tied):
  """RRT's SVD init (arXiv:2410.20672): at full rank, shared W + scale * A_l B_l == W_l for any
  lora_scale, with LoRA only where lora_layers puts it (middle_cycle 'shared': the unique first
  and last layers hold none and are copied exactly); each scheme tied and untied."""
  src, v, ref = _untied_source(tied)
  cfg = src.derive(sharing=dict(lora_scale=lora_scale))   # the untied model holds no LoRA
  kw = dict(scheme=scheme, num_unique=K, init='average', lora_targets=LORA_TARGETS,
            untie_norms=True, lora_layers=lora_layers)
  rcfg, rv = recursive.to_recursive(cfg, v, lora_rank=32, lora_init='svd', **kw)
  assert rcfg.sharing.lora_scale == lora_scale and rcfg.sharing.lora_layers == lora_layers
  holders = {p[1] for p in flatten_dict(rv['per_layer']) if p[-1].startswith('lora_')}
  n_seg = len(rcfg.plan.segments)
  assert holders == ({'segment_1'} if scheme == 'middle_cycle' and lora_layers == 'shared'
                     else {f'segment_{i}' for i in range(n_seg)})
  out = _apply(rcfg, rv)
  assert _max_diff(out, ref) <= 1e-4
  if scheme == 'cycle' and lora_scale == 1.0:   # strict sharing / truncated rank are not exact
    for rank in (0, 4):
      lcfg, lv = recursive.to_recursive(cfg, v, lora_rank=rank, lora_init='svd', **kw)
      assert _max_diff(_apply(lcfg, lv), ref) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize('tied', [False, True])
def test_stepwise_recursive_copies_the_picked_layers(tied):
  cfg = _cfg(norm=dict(kind='rmsnorm'), num_layers=6, tie_embeddings=tied)
  v = init_variables(DecoderLM(cfg), jax.random.key(2))
  rcfg, rv = recursive.to_recursive(cfg, v, scheme='cycle', num_unique=3, init='stepwise')
  from sharenet.models import layout
  src, dst = layout.unique_sets(v['params'], cfg), layout.unique_sets(rv['params'], rcfg)
  for p in src:
    np.testing.assert_array_equal(dst[p], src[p][np.asarray([0, 2, 5])])
  outside = lambda t: {p: x for p, x in flatten_dict(t['params']).items() if p[0] != 'stack'}
  assert outside(rv).keys() == outside(v).keys()   # embedding (tied or not), final norm, readout
  for p, x in outside(v).items():
    np.testing.assert_array_equal(outside(rv)[p], x)


def test_recursive_conversion_rejects_an_unknown_lora_layers():
  cfg = _cfg(norm=dict(kind='rmsnorm'), num_layers=6)
  v = jax.eval_shape(lambda: init_variables(DecoderLM(cfg), jax.random.key(0)))
  with pytest.raises(ConfigError, match='config.lora_layers=.middle. is unknown; valid: shared'):
    recursive.to_recursive(cfg, v, scheme='cycle', num_unique=3, init='stepwise', lora_rank=2,
                           lora_layers='middle')


# ----------------------------------------------------------------------------- invariances

def _leaf(shape, axes, role='reader', path=('params', 'w', 'kernel')):
  return Leaf(path, axes, shape, role)


def test_weight_norm_is_invariant_to_scaling_v():
  leaf = _leaf((3, 8, 5), ('layers', 'embed', 'mlp'))
  w = jax.random.normal(jax.random.key(0), leaf.shape)
  wn = reparam.WeightNorm()
  extras, _ = wn.init(w, leaf)
  np.testing.assert_allclose(wn.apply(w, extras, {}, leaf), w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(wn.apply(7.3 * w, extras, {}, leaf), wn.apply(w, extras, {}, leaf),
                             rtol=1e-5, atol=1e-6)


def test_sigma_power_iteration_converges_to_svd():
  m = jax.random.normal(jax.random.key(0), (3, 20, 12))
  u0 = jax.random.normal(jax.random.key(1), (3, 12))
  u, v = reparam.power_iteration(m, u0, 100)
  sigma = jnp.einsum('si,sio,so->s', v, m, u)
  np.testing.assert_allclose(sigma, jnp.linalg.svd(m, compute_uv=False)[:, 0], rtol=1e-4)


def test_sigma_reparam_is_identity_at_init_and_tracks_sigma():
  leaf = _leaf((2, 16, 8), ('layers', 'embed', 'mlp'))
  w = jax.random.normal(jax.random.key(0), leaf.shape)
  sr = reparam.SigmaReparam(iters=1)
  extras, state = sr.init(w, leaf)
  np.testing.assert_allclose(sr.apply(w, extras, state, leaf), w, rtol=1e-5, atol=1e-6)
  w2 = w + 0.3 * jax.random.normal(jax.random.key(1), w.shape)
  for _ in range(30):
    state = sr.update_state(w2, extras, state, leaf)
  eff = sr.apply(w2, extras, state, leaf)
  top = jnp.linalg.svd(eff, compute_uv=False)[:, 0]
  np.testing.assert_allclose(top, extras['sr_gamma'], rtol=1e-4)


def _tiny_state(transforms_kw, scheme='untied', steps=3, **train_kw):
  c = tiny_config.get_config()
  c.model.sharing.scheme = scheme
  if scheme == 'cycle':
    c.model.num_layers, c.model.sharing.repeats = 4, 2
  for k, val in transforms_kw.items():
    c.transforms[k] = val
  for k, val in train_kw.items():
    c.train[k] = val
  model = DecoderLM(ModelConfig.from_config(c.model))
  tr = Transforms(c.transforms, model)
  tx = chain.make_optimizer(c.train, tr)
  state = trainer.init_state(model, tx, jax.random.key(0), tr)
  step = jax.jit(functools.partial(trainer.train_step, model=model, tx=tx, grad_accum=1, tr=tr))
  # One batch repeated: its loss must fall (random tokens would leave nothing to learn).
  batches = [jax.random.randint(jax.random.key(1), (4, 33), 0, 256)] * steps
  states, losses = [state], []
  for b in batches:
    state, m = step(state, b)
    states.append(state)
    losses.append(float(m['loss']))
  return tr, states, losses


def _embed_axis_norms(tr, params):
  flat = flatten_dict(params)
  out = []
  for path, leaf in tr.infos.items():
    if leaf.role in ('reader', 'writer', 'readout', 'embedding'):
      out.append(jnp.linalg.norm(flat[path], axis=leaf.embed_axis()).ravel())
  return jnp.concatenate(out)


@pytest.mark.slow
def test_ngpt_projection_keeps_rows_unit_norm_after_every_step():
  tr, states, _ = _tiny_state({'project': 'ngpt'}, weight_decay=0.0)
  for s in states:
    np.testing.assert_allclose(_embed_axis_norms(tr, s.params), 1.0, atol=1e-6)


@pytest.mark.slow
def test_norm_project_keeps_matrix_norms_at_their_initial_values():
  tr, states, _ = _tiny_state({'project': 'norm_project'}, lr=3e-2)
  norms = lambda p: [float(jnp.linalg.norm(flatten_dict(p)[path])) for path, leaf in
                     tr.infos.items() if leaf.role in ('reader', 'writer', 'embedding')]
  n0 = norms(states[0].params)
  for s in states[1:]:
    np.testing.assert_allclose(norms(s.params), n0, rtol=1e-5)
  assert not np.allclose(flatten_dict(states[0].params)[('params', 'readout', 'kernel')],
                         flatten_dict(states[-1].params)[('params', 'readout', 'kernel')])


def _torch_rows(leaf, x):
  """(sets, units, unit length): each stacked set as PyTorch stores it, one row per unit.

  A kernel (in..., out...) is a Linear weight (out, in): units are output features; LoRA
  A (in..., r) and B (r, out...) likewise; an embedding / position table is already (rows,
  embed); a vector or scalar is one unit (NFNets' unitwise_norm of a bias or gain).
  """
  n = leaf.num_stack
  sets = int(np.prod(x.shape[:n])) if n else 1
  x = np.asarray(x).reshape((sets,) + x.shape[n:])
  if leaf.role in ('reader', 'writer', 'readout', 'lora'):
    fan_in = int(np.prod(x.shape[1:1 + leaf.num_in]))
    return x.reshape(sets, fan_in, -1).transpose(0, 2, 1)
  if leaf.role in ('embedding', 'pos_embed'):
    return x
  return x.reshape(sets, 1, -1)


def _from_torch_rows(leaf, rows, shape):
  if leaf.role in ('reader', 'writer', 'readout', 'lora'):
    rows = rows.transpose(0, 2, 1)
  return rows.reshape(shape)


@pytest.mark.slow
def test_agc_clips_each_unit_to_its_ratio():
  """Unit-wise AGC (Brock et al., arXiv:2102.06171, eq. 3, units = rows of the PyTorch weight):
  every unit's ||G_i|| / max(||W_i||, eps) ends <= lambda, clipped units keep their direction
  at ratio exactly lambda, units under lambda are untouched, the final linear layer is not
  clipped. Ratios are computed here from the PyTorch-layout rows, not the library's axes."""
  c = tiny_config.get_config()
  c.model.sharing.scheme, c.model.num_layers, c.model.sharing.repeats = 'cycle', 4, 2
  c.model.sharing.lora_rank = 2
  c.model.position = 'learned'
  model = DecoderLM(ModelConfig.from_config(c.model))
  tr = Transforms({'updates': 'agc'}, model)
  from sharenet.transforms.update import agc
  lam, eps = 0.01, 1e-3
  params = init_variables(model, jax.random.key(0))
  flat_p = flatten_dict(params)
  rng = np.random.default_rng(0)
  grads, target = {}, {}
  for path, leaf in tr.infos.items():
    w = _torch_rows(leaf, flat_p[path])
    g = rng.standard_normal(w.shape)
    # Per unit a target ratio alternating below and above lambda.
    t = np.where(np.arange(w.shape[1]) % 2 == 0, 0.3 * lam, 30 * lam)[None, :]
    wn = np.maximum(np.linalg.norm(w, axis=-1), eps)
    g *= (t * wn / np.linalg.norm(g, axis=-1))[..., None]
    target[path] = t * np.ones(w.shape[:2])
    grads[path] = jnp.asarray(_from_torch_rows(leaf, g, flat_p[path].shape), jnp.float32)
  tx = agc(lam, eps, tr.infos)
  clipped, _ = tx.update(unflatten_dict(grads), tx.init(params), params)
  flat_u = flatten_dict(clipped)
  checked = set()
  for path, leaf in tr.infos.items():
    g0, g1 = _torch_rows(leaf, grads[path]), _torch_rows(leaf, flat_u[path])
    wn = np.maximum(np.linalg.norm(_torch_rows(leaf, flat_p[path]), axis=-1), eps)
    ratio = np.linalg.norm(g1, axis=-1) / wn
    if leaf.role == 'readout':
      np.testing.assert_array_equal(g1, g0)
      continue
    below = target[path] <= lam
    np.testing.assert_allclose(g1[below], g0[below], rtol=1e-6)
    np.testing.assert_allclose(ratio[~below], lam, rtol=1e-4)
    cos = np.sum(g1 * g0, -1) / (np.linalg.norm(g1, axis=-1) * np.linalg.norm(g0, axis=-1))
    np.testing.assert_allclose(cos[~below], 1.0, rtol=1e-5)
    if (~below).any():
      checked.add(leaf.role)
  assert {'reader', 'writer', 'embedding', 'pos_embed', 'lora'} <= checked


@pytest.mark.slow
def test_adamp_update_is_orthogonal_to_a_weight_feeding_a_norm():
  leaf = _leaf((8, 16), ('embed', 'mlp'))
  infos = {leaf.path: leaf}
  x = jax.random.normal(jax.random.key(0), (32, 8))
  target = jax.random.normal(jax.random.key(1), (32, 16))

  def loss(params):   # LayerNorm over the outputs of x W makes the loss invariant to |W|
    h = x @ params['params']['w']['kernel']
    h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-6)
    return jnp.mean((h - target) ** 2)

  params = {'params': {'w': {'kernel': jax.random.normal(jax.random.key(2), (8, 16))}}}
  tx = scale_by_adamp(0.9, 0.999, 1e-8, 0.0, lambda p: jax.tree.map(lambda _: True, p), infos)
  state = tx.init(params)
  for _ in range(3):
    g = jax.grad(loss)(params)
    u, state = tx.update(g, state, params)
    w, d = params['params']['w']['kernel'], u['params']['w']['kernel']
    cos = float(jnp.sum(w * d) / (jnp.linalg.norm(w) * jnp.linalg.norm(d)))
    assert abs(cos) < 1e-5
    params = jax.tree.map(lambda p, q: p - 0.01 * q, params, u)
  # Plain Adam's step is not orthogonal (the check above is not vacuous).
  adam = optax.scale_by_adam(0.9, 0.999, 1e-8)
  u, _ = adam.update(jax.grad(loss)(params), adam.init(params), params)
  w, d = params['params']['w']['kernel'], u['params']['w']['kernel']
  assert abs(float(jnp.sum(w * d) / (jnp.linalg.norm(w) * jnp.linalg.norm(d)))) > 1e-3


def _clovaai_adamp(w_t, grads_t, b1, b2, eps, wd, delta, wd_ratio):
  """AdamP as clovaai/AdamP adamp.py writes it, in numpy, on one PyTorch-layout tensor (rows =
  output channels) held fixed: returns the last step's update u (p <- p - lr * u; the lr factor
  and its bias correction are applied by the caller) and the branch taken."""
  m, v = np.zeros_like(w_t), np.zeros_like(w_t)
  for t, g in enumerate(grads_t, 1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps
    perturb = m / denom
    ratio, branch = 1.0, 'none'
    for name, view in (('channel', lambda x: x.reshape(x.shape[0], -1)),
                       ('layer', lambda x: x.reshape(1, -1))):
      gv, wv = view(g), view(w_t)
      cos = np.abs(np.sum(gv * wv, 1)) / (np.maximum(np.linalg.norm(gv, axis=1), eps) *
                                          np.maximum(np.linalg.norm(wv, axis=1), eps))
      if cos.max() < delta / math.sqrt(wv.shape[1]):
        expand = (-1,) + (1,) * (w_t.ndim - 1)
        p_n = w_t / (np.linalg.norm(wv, axis=1).reshape(expand) + eps)
        perturb = perturb - p_n * view(p_n * perturb).sum(1).reshape(expand)
        ratio, branch = wd_ratio, name
        break
    u = perturb / (1 - b1 ** t) + wd * ratio * w_t
  return u, branch


def _adamp_case(kind, rows, cols, rng, delta):
  """(w, g) in PyTorch layout (rows = output channels): 'channel' = every row's |cos| is half
  the per-channel threshold with one sign (so the whole-tensor |cos| is that value too, above
  its smaller threshold); 'layer' = row 0 parallel, row 1 antiparallel, the rest orthogonal
  (whole |cos| 0, channel max 1); 'none' = g close to w."""
  w = rng.standard_normal((rows, cols))
  noise = rng.standard_normal((rows, cols))
  ortho = noise - w * (np.sum(noise * w, 1, keepdims=True) / np.sum(w * w, 1, keepdims=True))
  ortho *= (np.linalg.norm(w, axis=1) / np.linalg.norm(ortho, axis=1))[:, None]
  if kind == 'channel':
    c = 0.5 * delta / math.sqrt(cols)
    g = c * w + math.sqrt(1 - c * c) * ortho
  elif kind == 'layer':
    g = ortho.copy()
    w[1] *= np.linalg.norm(w[0]) / np.linalg.norm(w[1])
    g[0], g[1] = w[0], -w[1]
  else:
    g = w + 0.1 * noise
  return w, g


# (leaf shape, axes, role, num_in, ours -> PyTorch layout of one set)
ADAMP_LAYOUTS = {
    'kernel': ((8, 16), ('embed', 'mlp'), 'reader', 1, lambda x: x.T),       # Linear (out, in)
    'readout': ((8, 24), ('embed', 'vocab'), 'readout', 1, lambda x: x.T),
    'lora_b': ((4, 16), ('lora', 'embed'), 'lora', 1, lambda x: x.T),        # Linear(r, out)
    'embedding': ((24, 8), ('vocab', 'embed'), 'embedding', 1, lambda x: x),  # nn.Embedding
}


@pytest.mark.parametrize('layout', sorted(ADAMP_LAYOUTS))
def test_adamp_matches_the_reference_per_channel_and_whole_tensor(layout):
  """scale_by_adamp against clovaai's algorithm written out in numpy: a stacked leaf whose
  set 0 triggers only the per-channel test, set 1 only the whole-tensor test and set 2 neither;
  weight decay is multiplied by wd_ratio exactly on the projected sets."""
  shape, axes, role, num_in, to_torch = ADAMP_LAYOUTS[layout]
  b1, b2, eps, wd, delta, wd_ratio = 0.9, 0.999, 1e-8, 0.1, 0.1, 0.25
  leaf = Leaf(('params', 'w', 'kernel'), ('layers',) + axes, (3,) + shape, role, num_in)
  rng = np.random.default_rng(0)
  ws, gs, want = [], [], []
  for kind in ('channel', 'layer', 'none'):
    rows, cols = to_torch(np.zeros(shape)).shape
    w_t, g_t = _adamp_case(kind, rows, cols, rng, delta)
    u_t, branch = _clovaai_adamp(w_t, [g_t, 0.7 * g_t], b1, b2, eps, wd, delta, wd_ratio)
    assert branch == kind                        # the constructed case is the intended one
    ws.append(to_torch(w_t))                     # our layout (the maps are involutions)
    gs.append(to_torch(g_t))
    want.append(to_torch(u_t))
  with jax.enable_x64(True):
    params = {'params': {'w': {'kernel': jnp.asarray(np.stack(ws))}}}
    tx = scale_by_adamp(b1, b2, eps, wd, lambda p: jax.tree.map(lambda _: True, p),
                        {leaf.path: leaf}, delta, wd_ratio)
    state = tx.init(params)
    for g in (np.stack(gs), 0.7 * np.stack(gs)):
      u, state = tx.update({'params': {'w': {'kernel': jnp.asarray(g)}}}, state, params)
    got = np.asarray(u['params']['w']['kernel'])
  np.testing.assert_allclose(got, np.stack(want), rtol=1e-6, atol=1e-9)
  # Not vacuous: on the projected sets the result differs from plain AdamW (delta = 0).
  for i in range(2):
    w_t, g_t = to_torch(ws[i]), to_torch(gs[i])
    u_plain, branch = _clovaai_adamp(w_t, [g_t, 0.7 * g_t], b1, b2, eps, wd, 0.0, wd_ratio)
    assert branch == 'none' and np.max(np.abs(to_torch(u_plain) - got[i])) > 1e-2


def test_adamp_leaves_vectors_and_scalars_unprojected():
  """Only tensors with more than one (non-stack) dimension are projected (adamp.py:
  len(p.shape) > 1): a stacked norm gain gets the plain AdamW step."""
  leaf = Leaf(('params', 'n', 'scale'), ('layers', 'embed'), (2, 8), 'norm_in', 0)
  rng = np.random.default_rng(1)
  w = rng.standard_normal((2, 8))
  g = rng.standard_normal((2, 8))
  g[0] -= w[0] * (g[0] @ w[0]) / (w[0] @ w[0])       # orthogonal: would look scale-invariant
  tx = scale_by_adamp(0.9, 0.999, 1e-8, 0.1, lambda p: jax.tree.map(lambda _: True, p),
                      {leaf.path: leaf})
  params = {'params': {'n': {'scale': jnp.asarray(w, jnp.float32)}}}
  u, _ = tx.update({'params': {'n': {'scale': jnp.asarray(g, jnp.float32)}}}, tx.init(params),
                   params)
  expected = g / (np.abs(g) + 1e-8) + 0.1 * w          # first Adam step + full decay
  np.testing.assert_allclose(np.asarray(u['params']['n']['scale']), expected, rtol=1e-5)


TRAINABLE_TRANSFORMS = [
    {'reparam': 'weight_norm'}, {'reparam': 'sigma_reparam'}, {'reparam': 'weight_std'},
    {'reparam': 'zero_mean_writers'}, {'reparam': 'scale_vectors'},
    {'reparam': 'zero_mean_writers,weight_norm'}, {'project': 'ngpt'}, {'project': 'norm_project'},
    {'updates': 'agc'}, {'updates': 'adamp'},
]


@pytest.mark.slow
@pytest.mark.parametrize('kw', TRAINABLE_TRANSFORMS, ids=lambda kw: '-'.join(kw.values()))
def test_each_transform_trains_under_cycle_sharing(kw):
  _, states, losses = _tiny_state(kw, scheme='cycle', steps=6, lr=1e-2, warmup_steps=1)
  assert all(math.isfinite(l) for l in losses)
  assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize('tied', [False, True])
@pytest.mark.parametrize('reparams', ['weight_norm', 'sigma_reparam', 'zero_mean_writers',
                                      'scale_vectors'])
def test_function_preserving_reparams_leave_the_initial_model_unchanged(reparams, tied):
  c = tiny_config.get_config()
  c.model.norm.kind = 'layernorm'   # zero-mean writers preserve Pre-LN models (Jiang et al.)
  c.model.tie_embeddings = c.model.center_embedding = tied
  model = DecoderLM(ModelConfig.from_config(c.model))
  tr = Transforms({'reparam': reparams}, model)
  v = init_variables(model, jax.random.key(0))
  params, tstate = tr.init(v)
  toks = _tokens(vocab=256)
  np.testing.assert_allclose(model.apply(tr.effective(params, tstate), toks), model.apply(v, toks),
                             rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('tied', [False, True])
def test_zero_mean_writers_train_like_pre_ln_in_float64(tied):
  """Pre-LN and Pre-RMSNorm with forward-recentred writers, from the same raw weights, follow
  the same Adam trajectory (Jiang et al., arXiv:2305.14858). LN biases stay at 0
  (they have no RMSNorm counterpart); the gains are random and trained in both. Tied: the
  RMSNorm model recentres the embedded vectors (model.center_embedding) and its readout reads
  the raw table, as the Pre-LN model's does."""
  with jax.enable_x64(True):
    cfg_ln = _cfg(dtype='float64', param_dtype='float64', tie_embeddings=tied,
                  embed_init_std=0.5)
    cfg_rms = cfg_ln.derive(norm=dict(kind='rmsnorm'), center_embedding=tied)
    v = init_variables(DecoderLM(cfg_ln), jax.random.key(0))
    flat = flatten_dict(_randomize_norms(v)['params'])
    flat = {p: (jnp.zeros_like(x) if p[-1] == 'bias' else x) for p, x in flat.items()}
    v_ln = {'params': unflatten_dict(flat)}
    v_rms = {'params': unflatten_dict({p: x for p, x in flat.items() if p[-1] != 'bias'})}
    toks = jax.random.randint(jax.random.key(1), (4, 2, 11), 0, 64)

    def run(model_cfg, variables, reparams):
      model = DecoderLM(model_cfg)
      tr = Transforms({'reparam': reparams}, model)
      params, tstate = tr.init(variables)
      frozen = lambda p: jax.tree_util.tree_map_with_path(
          lambda path, _: getattr(path[-1], 'key', '') == 'bias', p)
      tx = optax.chain(optax.adam(1e-2), optax.masked(optax.set_to_zero(), frozen))
      opt = tx.init(params)
      loss = lambda p, b: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
          model.apply(tr.effective(p, tstate), b[:, :-1]), b[:, 1:]))
      outs, grad = [], jax.jit(jax.grad(loss))
      for b in toks:
        g = grad(params, b)
        u, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, u)
        outs.append(model.apply(tr.effective(params, tstate), toks[0]))
      return jnp.stack(outs)

    a = run(cfg_ln, v_ln, '')
    b = run(cfg_rms, v_rms, 'zero_mean_writers')
    c = run(cfg_rms, v_rms, '')
    assert _max_diff(a, b) < 1e-6
    assert _max_diff(a, c) > 1e-3    # without the reparam they differ


@pytest.mark.parametrize('section,value,match', [
    ('reparam', 'spectral', 'transforms.reparam'), ('project', 'sphere', 'transforms.project'),
    ('updates', 'lion', 'transforms.updates'), ('reparam_paths', 'nothing$', 'selects no'),
])
def test_bad_transform_config_is_one_line_error(section, value, match):
  kw = {section: value}
  if section == 'reparam_paths':
    kw['reparam'] = 'weight_norm'
  model = DecoderLM(_cfg())
  with pytest.raises(ConfigError, match=match):
    Transforms(kw, model)


def test_reparam_selection_by_path_and_role():
  model = DecoderLM(_cfg(norm=dict(kind='rmsnorm')))
  by_role = Transforms({'reparam': 'weight_norm', 'reparam_roles': 'writer'}, model)
  assert {l.path[-2] for _, l in by_role.reparam.targets} == {'o', 'wo'}
  by_path = Transforms({'reparam': 'sigma_reparam', 'reparam_paths': 'attn/(q|k)/kernel$'}, model)
  assert {l.path[-2] for _, l in by_path.reparam.targets} == {'q', 'k'}
  with pytest.raises(ConfigError, match='reparam_roles'):
    Transforms({'reparam': 'weight_norm', 'reparam_roles': 'gain'}, model)


def test_zero_mean_writers_with_tied_embeddings_needs_centering():
  """The table's line (config/compat.py); with model.center_embedding the pair works."""
  c = tiny_config.get_config()
  c.transforms.reparam, c.model.tie_embeddings = 'zero_mean_writers', True
  with pytest.raises(ConfigError, match='would recentre the tied readout too'):
    experiment.validate(c)
  c.model.center_embedding = True
  experiment.validate(c)
  Transforms({'reparam': 'zero_mean_writers'},
             DecoderLM(_cfg(tie_embeddings=True, center_embedding=True)))


@pytest.mark.slow
def test_mup_composes_with_transforms_and_scalar_norm_params():
  """muP multipliers (by logical axes) and transform gains (unknown to the parametrization:
  multiplier 1) in one optimizer; DyT's scalar alpha is a vector-like leaf."""
  c = tiny_config.get_config()
  c.model.norm.kind = 'dyt'
  c.model.sharing.scheme, c.model.num_layers, c.model.sharing.repeats = 'cycle', 4, 2
  c.parametrization.kind, c.parametrization.base_d_model = 'mup', 16
  c.transforms.reparam = 'weight_norm'
  c.transforms.project = 'norm_project'
  from sharenet.train import experiment
  model, tx, pz, tr = trainer.setup(c, experiment.validate(c))
  state = trainer.init_state(model, tx, jax.random.key(0), tr, pz)
  assert 'reparam' in state.params
  step = jax.jit(functools.partial(trainer.train_step, model=model, tx=tx, grad_accum=1, tr=tr,
                                   pz=pz))
  batch = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
  losses = []
  for _ in range(4):
    state, m = step(state, batch)
    losses.append(float(m['loss']))
  assert all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]
