"""train.optimizer = muon | shampoo (sharenet/optim/matrix.py, sharenet/optim/shampoo.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict
from optax import contrib

from sharenet.models import scaling
from sharenet.config import defaults
from sharenet.optim import chain, matrix
from sharenet.train import experiment
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, init_variables
from sharenet.models.params import ParamInfo


def _train(**kw):
  base = dict(schedule='constant', warmup_steps=0, lr=0.1, weight_decay=0.0, grad_clip=0.0)
  return defaults.fill('train', {**base, **kw})


def _table(**shapes):
  """{('params', name): ParamInfo} of reader kernels: name=(axes, shape, num_in)."""
  return {('params', k): ParamInfo(('params', k), axes, shape, 'reader', num_in)
          for k, (axes, shape, num_in) in shapes.items()}


def _run(tx, grads_list, params):
  state = tx.init(params)
  ups = []
  for g in grads_list:
    u, state = jax.jit(tx.update)(g, state, params)
    ups.append(u)
  return ups


def test_muon_at_one_matrix_equals_optax():
  table = _table(w=(('embed', 'mlp'), (8, 12), 1))
  t = _train(optimizer='muon')
  g = [{'params': {'w': jax.random.normal(jax.random.key(i), (8, 12))}} for i in range(3)]
  p = {'params': {'w': jnp.zeros((8, 12))}}
  ours = _run(chain.make_chain(t, table=table), g, p)
  ref = _run(contrib.muon(0.1, beta=0.95, ns_steps=5), g, p)
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a['params']['w'], b['params']['w'], rtol=1e-4, atol=1e-6)


def _keller_jordan_muon(grads, lr=0.1, beta=0.95, ns_steps=5, bias_correction=False):
  """Keller Jordan's published Muon (github.com/KellerJordan/Muon, `muon_update` and
  `zeropower_via_newtonschulz5`) restated in numpy for (fan_in, fan_out) kernels: momentum
  m = beta m + (1 - beta) g, Nesterov u = beta m + (1 - beta) g, five quintic Newton-Schulz
  steps (3.4445, -4.7750, 2.0315) on the (fan_out, fan_in) matrix normalised by its Frobenius
  norm, times sqrt(max(1, fan_out / fan_in)), times -lr. Run in float64 (the reference: bf16).
  `bias_correction`: optax's Nesterov form, beta m / (1 - beta^(t+1)) + (1 - beta) g /
  (1 - beta^t), the one deviation docs/optimizers.md states."""
  a, b, c = 3.4445, -4.7750, 2.0315
  m, out = 0.0, []
  for t, g in enumerate(grads, 1):
    G = np.asarray(g, np.float64).T                       # torch's (out, in)
    m = beta * m + (1 - beta) * G
    u = (beta * m / (1 - beta ** (t + 1)) + (1 - beta) * G / (1 - beta ** t)
         if bias_correction else beta * m + (1 - beta) * G)
    X = u.T if u.shape[0] > u.shape[1] else u
    X = X / (np.linalg.norm(X) + 1e-7)
    for _ in range(ns_steps):
      A = X @ X.T
      X = a * X + (b * A + c * A @ A) @ X
    X = X.T if u.shape[0] > u.shape[1] else X
    out.append(-lr * max(1, G.shape[0] / G.shape[1]) ** 0.5 * X.T)
  return out


def test_muon_is_keller_jordans_update_up_to_its_bias_correction():
  """Our Muon against Keller Jordan's update restated in numpy: the first step is his exactly
  (one gradient: both momenta point along it, and Newton-Schulz normalises the scale); later
  steps are his with optax's bias-corrected Nesterov momentum, and differ from his without it
  (the deviation docs/optimizers.md states)."""
  table = _table(w=(('embed', 'mlp'), (8, 12), 1))
  g = [jax.random.normal(jax.random.key(i), (8, 12)) for i in range(3)]
  ours = [u['params']['w'] for u in _run(chain.make_chain(_train(optimizer='muon'), table=table),
                                          [{'params': {'w': x}} for x in g],
                                          {'params': {'w': jnp.zeros((8, 12))}})]
  keller = _keller_jordan_muon(g)
  corrected = _keller_jordan_muon(g, bias_correction=True)
  np.testing.assert_allclose(ours[0], keller[0], rtol=2e-4, atol=2e-6)
  for a, b in zip(ours, corrected):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
  gap = np.abs(np.asarray(ours[1]) - keller[1]).max() / np.abs(keller[1]).max()
  assert gap > 1e-2, gap


def test_muon_rms_scale_is_moonlights_factor_on_optax_muon():
  """train.muon.scale=rms: optax's orthogonalised step with 0.2 sqrt(max(fan_in, fan_out))
  (Moonlight) in place of optax's sqrt(max(1, fan_out / fan_in))."""
  table = _table(w=(('embed', 'mlp'), (8, 12), 1))
  g = [{'params': {'w': jax.random.normal(jax.random.key(i), (8, 12))}} for i in range(3)]
  p = {'params': {'w': jnp.zeros((8, 12))}}
  ours = _run(chain.make_chain(_train(optimizer='muon', muon=dict(scale='rms')), table=table),
              g, p)
  ref = _run(contrib.muon(0.1, beta=0.95, ns_steps=5), g, p)
  factor = 0.2 * 12 ** 0.5 / (12 / 8) ** 0.5
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a['params']['w'], factor * b['params']['w'], rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize('scale, slope', [('shape', 0.0), ('rms', 0.5)])
def test_muon_sp_step_moves_outputs_at_its_first_order_width_slope(scale, slope):
  """docs/optimizers.md's reading of Muon's coordinate check: under SP (one LR at every width)
  the first step of a square kernel moves each output coordinate of the batch that made the
  gradient by ~lr under scale=shape (width slope 0) and ~0.2 lr sqrt(width) under scale=rms
  (slope 0.5). So Muon's SP cannot grow faster than 0.5 per width doubling at first order
  (a coordinate check's "> 0.5" needs higher-order terms)."""
  widths, moves = (64, 128, 256), []
  for n in widths:
    k1, k2 = jax.random.split(jax.random.key(n))
    x_TD = jax.random.normal(k1, (512, n))     # the batch's inputs, rms 1
    dy_TD = jax.random.normal(k2, (512, n))    # the output cotangents
    table = _table(w=(('embed', 'mlp'), (n, n), 1))
    grads = {'params': {'w': x_TD.T @ dy_TD}}
    tx = chain.make_chain(_train(optimizer='muon', lr=1e-2, muon=dict(scale=scale)), table=table)
    update = _run(tx, [grads], {'params': {'w': jnp.zeros((n, n))}})[0]['params']['w']
    moves.append(float(jnp.sqrt(jnp.mean((x_TD @ update) ** 2))))
  measured = np.polyfit(np.log(widths), np.log(moves), 1)[0]
  assert abs(measured - slope) < 0.05, (scale, measured, moves)


def test_muon_on_stacked_kernel_is_per_set_on_its_matrix_view():
  """A (layers, embed, heads, head_dim) kernel: Muon per stored set on (embed, heads*head_dim)."""
  shape = (2, 8, 2, 4)
  table = _table(w=(('layers', 'embed', 'heads', 'head_dim'), shape, 1))
  g = [{'params': {'w': jax.random.normal(jax.random.key(i), shape)}} for i in range(2)]
  p = {'params': {'w': jnp.zeros(shape)}}
  ours = _run(chain.make_chain(_train(optimizer='muon'), table=table), g, p)
  for s in range(2):
    gs = [{'w': x['params']['w'][s].reshape(8, 8)} for x in g]
    ref = _run(contrib.muon(0.1, beta=0.95, ns_steps=5), gs, {'w': jnp.zeros((8, 8))})
    for a, b in zip(ours, ref):
      np.testing.assert_allclose(a['params']['w'][s].reshape(8, 8), b['w'], rtol=1e-4, atol=1e-6)


def _shampoo_numpy(grads, b1, b2, eps, adam_eps, lr, graft='adam'):
  """Shampoo grafted to Adam (or, graft='none', vanilla) on one block holding the whole
  matrix, preconditioning every step (sharenet/optim/shampoo.py's docstring), in float64 numpy."""
  fi, fo = grads[0].shape
  L, R = np.zeros((fi, fi)), np.zeros((fo, fo))
  m, v = np.zeros((fi, fo)), np.zeros((fi, fo))

  def root(S):
    w, V = np.linalg.eigh(S + eps * np.eye(len(S)))
    return V @ np.diag(np.maximum(w, eps) ** -0.25) @ V.T
  out = []
  for t, G in enumerate(grads, 1):
    L, R = b2 * L + G @ G.T, b2 * R + G.T @ G
    m, v = b1 * m + (1 - b1) * G, b2 * v + (1 - b2) * G * G
    mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
    adam = mh / (np.sqrt(vh) + adam_eps)
    d = root(L) @ mh @ root(R)
    out.append(-lr * d * (np.linalg.norm(adam) / np.linalg.norm(d) if graft == 'adam' else 1))
  return out


@pytest.mark.parametrize('block', [10, 64])
def test_shampoo_equals_numpy_restatement(block):
  shape = (6, 10)
  table = _table(w=(('embed', 'mlp'), shape, 1))
  t = _train(optimizer='shampoo', shampoo=dict(block_size=block, update_every=1, eps=1e-3))
  rng = np.random.default_rng(0)
  gs = [rng.normal(size=shape).astype(np.float32) for _ in range(3)]
  ours = _run(chain.make_chain(t, table=table), [{'params': {'w': jnp.asarray(x)}} for x in gs],
              {'params': {'w': jnp.zeros(shape)}})
  ref = _shampoo_numpy([x.astype(np.float64) for x in gs], t.b1, t.b2, 1e-3, t.eps, t.lr)
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a['params']['w'], b, rtol=2e-4, atol=1e-6)
  # Not Adam: the preconditioner changes the direction.
  adam = _run(optax.adam(t.lr, t.b1, t.b2, t.eps), [{'w': jnp.asarray(x)} for x in gs],
              {'w': jnp.zeros(shape)})
  assert not np.allclose(adam[-1]['w'], ref[-1], rtol=1e-2)


def test_vanilla_shampoo_equals_numpy_restatement_and_damping_multiplies_eps():
  """graft=none: the step is -lr L^-1/4 M R^-1/4 itself (not Adam's size); a per-leaf damping
  multiplier k (the second-order muP's) is the same as eps x k."""
  from sharenet.parametrization.rules import OptMultipliers
  shape = (6, 10)
  table = _table(w=(('embed', 'mlp'), shape, 1))
  rng = np.random.default_rng(2)
  gs = [rng.normal(size=shape).astype(np.float32) for _ in range(3)]
  run = lambda t, mult=None: _run(chain.make_chain(t, multipliers=mult, table=table),
                                  [{'params': {'w': jnp.asarray(x)}} for x in gs],
                                  {'params': {'w': jnp.zeros(shape)}})
  t = _train(optimizer='shampoo', shampoo=dict(update_every=1, eps=1e-3, graft='none'))
  ref = _shampoo_numpy([x.astype(np.float64) for x in gs], t.b1, t.b2, 1e-3, t.eps, t.lr,
                       graft='none')
  for a, b in zip(run(t), ref):
    np.testing.assert_allclose(a['params']['w'], b, rtol=2e-4, atol=1e-6)
  grafted = _shampoo_numpy([x.astype(np.float64) for x in gs], t.b1, t.b2, 1e-3, t.eps, t.lr)
  assert not np.allclose(grafted[-1], ref[-1], rtol=1e-2)
  ones = {'params': {'w': 1.0}}
  mult = OptMultipliers(ones, ones, False, None, {'params': {'w': 100.0}})
  big = _train(optimizer='shampoo', shampoo=dict(update_every=1, eps=0.1, graft='none'))
  for a, b in zip(run(t, mult), run(big)):
    np.testing.assert_allclose(a['params']['w'], b['params']['w'], rtol=1e-5, atol=1e-7)
  assert not np.allclose(run(t, mult)[-1]['params']['w'], ref[-1], rtol=1e-2)


def test_shampoo_blocks_are_independent_and_padded():
  """Block size 4 on a (6, 10) matrix: each (<=4 x <=4) block equals Shampoo on that block
  alone (the ragged edge zero-padded, exactly)."""
  shape = (6, 10)
  table = _table(w=(('embed', 'mlp'), shape, 1))
  t = _train(optimizer='shampoo', shampoo=dict(block_size=4, update_every=1, eps=1e-3))
  rng = np.random.default_rng(1)
  gs = [rng.normal(size=shape).astype(np.float32) for _ in range(2)]
  ours = _run(chain.make_chain(t, table=table), [{'params': {'w': jnp.asarray(x)}} for x in gs],
              {'params': {'w': jnp.zeros(shape)}})
  for i0, i1 in ((0, 4), (4, 6)):
    for j0, j1 in ((0, 4), (4, 8), (8, 10)):
      ref = _shampoo_numpy([x[i0:i1, j0:j1].astype(np.float64) for x in gs], t.b1, t.b2, 1e-3,
                           t.eps, t.lr)
      np.testing.assert_allclose(ours[-1]['params']['w'][i0:i1, j0:j1], ref[-1], rtol=2e-4,
                                 atol=1e-6)


def test_shampoo_roots_take_one_matrix_per_lapack_call_on_the_cpu():
  """sharenet/kernels/linalg.py: jaxlib 0.10's batched CPU eigh blocks an XLA pool thread on its batch,
  so two at once deadlock a 2-thread pool (a Shampoo step at width 128 hung in about half of
  the runs). Shampoo's update, lowered for the CPU, calls LAPACK's eigh on one matrix at a time
  (no batch dimension), for the left (3 x 3) and right (4 x 4) roots of a 3-block leaf, also
  when the update is vmapped (as the LR sweep vmaps whole steps), and the values equal the
  batched call's bit for bit."""
  import re
  from sharenet.kernels import linalg
  shape = (3, 10)
  table = _table(w=(('embed', 'mlp'), shape, 1))
  tx = chain.make_chain(_train(optimizer='shampoo', shampoo=dict(block_size=4, update_every=1)),
                        table=table)
  p = {'params': {'w': jnp.zeros(shape)}}
  g = {'params': {'w': jax.random.normal(jax.random.key(0), shape)}}
  state = tx.init(p)
  calls = lambda f, *a: re.findall(r'custom_call @lapack_\w*syevd\w*\(.*num_batch_dims = "(\d+)"',
                                   jax.jit(f).lower(*a).as_text())
  assert calls(tx.update, g, state, p) == ['0', '0']   # left and right, inside lax.map
  # the vmapped LR sweep maps whole steps: vmap must not batch the calls again
  g4 = jax.tree.map(lambda a: jnp.stack([a] * 4), g)
  assert calls(jax.vmap(lambda g: tx.update(g, state, p)[0]), g4) == ['0', '0']
  x = jax.random.normal(jax.random.key(1), (2, 6, 4, 4))
  x = x @ jnp.swapaxes(x, -1, -2)
  per_matrix = jax.vmap(lambda x: linalg.per_matrix(jnp.linalg.eigh, x))
  for ours, batched in zip(per_matrix(x), jnp.linalg.eigh(x)):
    np.testing.assert_array_equal(ours, batched)
  one = x[0, :1]                                              # a one-block leaf: no batch either
  assert calls(lambda x: linalg.per_matrix(jnp.linalg.eigh, x), one) == ['0']
  for ours, batched in zip(linalg.per_matrix(jnp.linalg.eigh, one), jnp.linalg.eigh(one)):
    np.testing.assert_array_equal(ours, batched)
  assert re.findall(r'num_batch_dims = "(\d+)"', jax.jit(jnp.linalg.eigh).lower(x).as_text()) \
      == ['2']                                                # what the batched call lowers to


def test_shampoo_update_every_keeps_roots():
  """update_every=2: the step-2 direction uses the step-1 roots (differs from every step)."""
  shape = (4, 5)
  table = _table(w=(('embed', 'mlp'), shape, 1))
  gs = [{'params': {'w': jax.random.normal(jax.random.key(i), shape)}} for i in range(2)]
  p = {'params': {'w': jnp.zeros(shape)}}
  run = lambda n: _run(chain.make_chain(_train(optimizer='shampoo', shampoo=dict(
      update_every=n, eps=1e-3)), table=table), gs, p)
  every, second = run(1), run(2)
  np.testing.assert_allclose(every[0]['params']['w'], second[0]['params']['w'], rtol=1e-6)
  assert not np.allclose(every[1]['params']['w'], second[1]['params']['w'], rtol=1e-4)


@pytest.mark.parametrize('name', ['muon', 'shampoo'])
def test_tied_set_update_is_the_update_of_its_summed_gradient(name):
  """A set applied twice (x -> tanh(x W) -> tanh(. W)) is one stored W: its gradient is the sum of
  the two uses' (an untied copy's), so the update is the optimizer's on that sum, which is not
  the sum of the optimizer's per-use updates (orthogonalisation / preconditioning is nonlinear)."""
  table = _table(w=(('embed', 'mlp'), (6, 6), 1))
  x = jax.random.normal(jax.random.key(0), (5, 6))
  w = jax.random.normal(jax.random.key(1), (6, 6)) / 3
  loss2 = lambda w1, w2: jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)
  tied = jax.grad(lambda w: loss2(w, w))(w)
  g1, g2 = jax.grad(loss2, argnums=(0, 1))(w, w)
  np.testing.assert_allclose(tied, g1 + g2, rtol=1e-5, atol=1e-6)
  t = _train(optimizer=name, shampoo=dict(eps=1e-3))
  tx = chain.make_chain(t, table=table)
  p = {'params': {'w': w}}
  upd = lambda g: tx.update({'params': {'w': g}}, tx.init(p), p)[0]['params']['w']
  np.testing.assert_allclose(upd(tied), upd(g1 + g2), rtol=1e-5, atol=1e-7)
  assert not np.allclose(upd(tied), upd(g1) + upd(g2), rtol=1e-2)


def test_non_matrix_leaves_stay_on_adam():
  """A norm gain beside a Muon kernel gets exactly Adam's update."""
  table = {**_table(w=(('embed', 'mlp'), (4, 6), 1)),
           ('params', 'g'): ParamInfo(('params', 'g'), ('embed',), (4,), 'norm_in', 0)}
  g = {'params': {'w': jnp.ones((4, 6)), 'g': jnp.arange(4.0)}}
  p = jax.tree.map(jnp.zeros_like, g)
  for name in ('muon', 'shampoo'):
    u = _run(chain.make_chain(_train(optimizer=name), table=table), [g], p)[0]
    ref = _run(optax.adam(0.1, 0.9, 0.95, 1e-8), [g['params']['g']], p['params']['g'])[0]
    np.testing.assert_allclose(u['params']['g'], ref, rtol=1e-6)


@pytest.mark.parametrize('kw, match', [
    (dict(optimizer='shampoo', shampoo=dict(block_size=0)), 'block_size=0 must be >= 1; valid'),
    (dict(optimizer='muon', matrix_roles='reader,norm_in'), "cannot take role 'norm_in'.*valid"),
    (dict(optimizer='lion'), "train.optimizer='lion' is unknown; valid: adamw, muon, shampoo, scion"),
    (dict(optimizer='shampoo', shampoo=dict(graft='sgd')),
     "train.shampoo.graft='sgd' is unknown; valid: adam, none"),
    (dict(optimizer='muon', muon=dict(scale='adam')),
     "train.muon.scale='adam' is unknown; valid: shape, rms"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ConfigError, match=match) as e:
    chain.make_chain(_train(**kw), table=_table(w=(('embed', 'mlp'), (4, 6), 1)))
  assert '\n' not in str(e.value)


def test_muon_on_a_kernel_without_fan_out_is_one_line():
  table = {('params', 'w'): ParamInfo(('params', 'w'), ('embed',), (4,), 'reader', 1)}
  with pytest.raises(ConfigError, match='cannot take it.*valid train.matrix_roles') as e:
    chain.make_chain(_train(optimizer='muon'), table=table)
  assert '\n' not in str(e.value)


# ---- parametrizations (sharenet/parametrization/optimizer_rules.py) -----------------------

D0 = 32


def _tiny(d, kind='sp', base=D0):
  from sharenet.models import ModelConfig
  cfg = ModelConfig(vocab_size=64, d_model=d, num_layers=2, num_heads=4, mlp_dim=3 * d // 2,
                    sharing=dict(scheme='cycle', repeats=2), remat='none')
  return cfg.derive(parametrization=scaling.Settings(kind=kind, base_d_model=base))


def _pz(d, kind, name, **kw):
  from sharenet.parametrization import rules as P
  if name == 'shampoo_vanilla':
    name, kw = 'shampoo', {**kw, 'shampoo': dict(graft='none')}
  if name == 'muon_rms':
    name, kw = 'muon', {**kw, 'muon': dict(scale='rms')}
  return P.Parametrization(_tiny(d, kind), _train(optimizer=name, **kw))


def _expected(name, leaf, d, mlp):
  """Independent restatement: (lr, init, fwd) of a leaf named `leaf` at width d, base D0.
  Muon muP: hidden step sqrt(fan_out/fan_in) over optax's sqrt(max(1, fan_out/fan_in))
  (muon_rms: over Moonlight's 0.2 sqrt(max(fan_in, fan_out))), relative to the base; vanilla
  Shampoo (Ishikawa & Karakida; blocked: Qiu et al. Table 1): hidden LR (fan_out/fan_in)^(1/2) (n_in
  n_out)^(-1/2) over 128-blocks, relative to the base,
  SP init; Adam leaves (and every leaf under grafted Shampoo): TP5 Table 8."""
  m = d / D0
  fans = {'q': (d, d), 'k': (d, d), 'v': (d, d), 'o': (d, d), 'wi_gate': (d, mlp),
          'wi_up': (d, mlp), 'wo': (mlp, d)}
  if leaf in fans:
    if name == 'shampoo':
      return 1 / m, 1.0, 1.0
    if name == 'shampoo_vanilla':
      fi, fo = fans[leaf]
      blocks = lambda n: -(-n // 128)
      lr = lambda a, b: (b / a / (blocks(a) * blocks(b))) ** 0.5
      return lr(fi, fo) / lr(fi * D0 // d, fo * D0 // d), 1.0, 1.0
    fi, fo = fans[leaf]
    fi0, fo0 = fi * D0 // d, fo * D0 // d
    spectral = lambda a, b: (b / a) ** 0.5 / max(1.0, b / a) ** 0.5
    if name == 'muon_rms':
      spectral = lambda a, b: (b / a) ** 0.5 / (0.2 * max(a, b) ** 0.5)
    return spectral(fi, fo) / spectral(fi0, fo0), 1.0, 1.0
  if leaf == 'readout':   # its 1/m forward multiplier sits on the logits (cfg.logits_mult)
    return 1.0, m ** 0.5, 1.0
  return 1.0, 1.0, 1.0


@pytest.mark.parametrize('name', ['muon', 'muon_rms', 'shampoo', 'shampoo_vanilla'])
def test_mup_multipliers_equal_the_restated_table_at_three_widths(name):
  seen = set()
  for d in (32, 64, 128):
    pz = _pz(d, 'mup', name)
    for path, r in pz.rules.items():
      leaf = path[-2] if path[-1] == 'kernel' else path[-1]
      lr, init, fwd = _expected(name, leaf, d, 3 * d // 2)
      assert (r.lr_mult, r.init_scale, r.fwd_mult) == pytest.approx((lr, init, fwd)), (d, path)
      # vanilla Shampoo's damping ~ b_in b_out / fan_out^2 relative to the base
      damping = 1.0
      if name == 'shampoo_vanilla' and r.role == 'hidden':
        fans = {'wi_gate': (d, 3 * d // 2), 'wi_up': (d, 3 * d // 2), 'wo': (3 * d // 2, d)}
        fi, fo = fans.get(leaf, (d, d))
        scale = lambda a, b: min(a, 128) * min(b, 128) / b ** 2
        damping = scale(fi, fo) / scale(fi * D0 // d, fo * D0 // d)
      assert r.damping_mult == pytest.approx(damping), (d, path)
      seen.add(leaf)
    assert pz.cfg.logits_mult == pytest.approx(D0 / d)
  assert {'q', 'wo', 'readout', 'embedding'} <= seen, seen


def _spectral_step(name, kind, d):
  """{hidden kernel: the spectral norm of its first update over sqrt(fan_out / fan_in)}, the
  update measured by running the optimizer (the parametrization's multipliers included) on a
  rank-one gradient x^T delta of unit coordinates per kernel (one feature direction, as one
  token's backprop gives) at width d."""
  from sharenet.models import param_table
  pz = _pz(d, kind, name)
  cfg = pz.cfg
  table = param_table(cfg)
  t = _train(optimizer=name.split('_')[0], weight_decay=0.0,
             **({'shampoo': dict(graft='none')} if name == 'shampoo_vanilla' else {}),
             **({'muon': dict(scale='rms')} if name == 'muon_rms' else {}))
  tx = chain.make_chain(t, multipliers=pz.opt_multipliers(), table=table)
  params = init_variables(DecoderLM(cfg), jax.random.key(0))
  flat = flatten_dict(params)
  rng = np.random.default_rng(d)
  grads, dims = {}, {}
  for path, x in flat.items():
    info = table[path]
    g = np.zeros(x.shape, np.float32)
    if info.role in ('reader', 'writer'):   # the hidden kernels
      stack, fan_in, fan_out = matrix.matrix_dims(info)   # scan axes, then the matrix view
      rank_one = np.outer(rng.choice([-1.0, 1.0], fan_in), rng.choice([-1.0, 1.0], fan_out))
      g = np.broadcast_to(rank_one.reshape(x.shape[len(stack):]), x.shape).astype(np.float32)
      dims[path] = (len(stack), fan_in, fan_out)
    grads[path] = jnp.asarray(g)
  update = flatten_dict(tx.update(unflatten_dict(grads), tx.init(params), params)[0])
  out = {}
  for path, (lead, fan_in, fan_out) in dims.items():
    u = np.asarray(update[path])[(0,) * lead].reshape(fan_in, fan_out)
    out[path[-2] if path[-1] == 'kernel' else path[-1]] = \
        np.linalg.norm(u, 2) / (fan_out / fan_in) ** 0.5
  return out


@pytest.mark.slow
@pytest.mark.parametrize('name', ['adamw', 'muon', 'muon_rms', 'shampoo', 'shampoo_vanilla'])
def test_mup_first_steps_meet_the_spectral_condition_at_every_width(name):
  """Measured, not restated: each hidden kernel's first update under muP has the same spectral
  norm over sqrt(fan_out / fan_in) at widths 32 and 128 (the spectral condition for feature
  learning, Yang, Simon & Bernstein, arXiv:2310.17813), within 10 %. Under SP the same
  measurement grows 4x (Adam, grafted Shampoo) or 2x (Muon's RMS step) over those widths; Muon
  with optax's shape factor takes the condition already, and so does vanilla Shampoo until its
  128-blocks split a matrix (the MLP kernels at width 128: sqrt 2)."""
  mup = {d: _spectral_step(name, 'mup', d) for d in (D0, 4 * D0)}
  sp = {d: _spectral_step(name, 'sp', d) for d in (D0, 4 * D0)}
  assert set(mup[D0]) >= {'q', 'o', 'wi_up', 'wo'}, sorted(mup[D0])
  for leaf in mup[D0]:
    assert mup[4 * D0][leaf] / mup[D0][leaf] == pytest.approx(1.0, rel=0.1), leaf
    grows = {'adamw': 4.0, 'shampoo': 4.0, 'muon_rms': 2.0}.get(name, 1.0)
    if name == 'shampoo_vanilla' and leaf.startswith('w'):   # mlp_dim 192: two blocks
      grows = 2 ** 0.5
    assert sp[4 * D0][leaf] / sp[D0][leaf] == pytest.approx(grows, rel=0.1), leaf


def test_muon_lr_mult_follows_fan_out_over_fan_in():
  from sharenet.parametrization.optimizer_rules import muon_lr_mult
  assert muon_lr_mult(64, 64, 32, 32) == 1.0
  # fan_out fixed at 16 while fan_in doubles: spectral step ~ sqrt(16/64) vs sqrt(16/32).
  assert muon_lr_mult(64, 16, 32, 16) == pytest.approx(2 ** -0.5)
  # fan_out 4x fan_in at base and 8x at target: optax's own factor already grows with it.
  assert muon_lr_mult(16, 128, 16, 64) == pytest.approx(1.0)
  # Moonlight's RMS scale 0.2 sqrt(max(fan_in, fan_out)) grows with width: a square kernel 4x
  # wider takes half the LR; fan_out 8x fan_in vs 4x at base: sqrt 2 x 1/sqrt 2 -> 1
  assert muon_lr_mult(128, 128, 32, 32, 'rms') == pytest.approx(0.5)
  assert muon_lr_mult(16, 128, 16, 64, 'rms') == pytest.approx(1.0)


def test_vanilla_shampoo_mults_follow_the_second_order_mup():
  """Ishikawa & Karakida's exponents for e_L = e_R = 1/4, with Qiu et al.'s blocking
  (optimizer_rules.py): LR ~ (fan_out/fan_in)^(1/2) (n_in n_out)^(-1/2), damping ~
  b_in b_out / fan_out^2, relative to the base."""
  from sharenet.parametrization.optimizer_rules import shampoo_mults
  assert shampoo_mults(64, 64, 32, 32, 128) == (1.0, 1.0)
  # an input-like matrix: fan_in fixed, fan_out doubles -> LR x sqrt 2, damping / 2
  assert shampoo_mults(16, 64, 16, 32, 128) == pytest.approx((2 ** 0.5, 0.5))
  # an output-like matrix: fan_in doubles, fan_out fixed -> LR / sqrt 2, damping x 2
  assert shampoo_mults(64, 16, 32, 16, 128) == pytest.approx((2 ** -0.5, 2.0))
  # a hidden matrix past the block size: 2 x 2 blocks of 128 -> LR / 2 (Adam's 1 / width),
  # damping / 4; 4 x 4 blocks -> LR / 4, damping / 16
  assert shampoo_mults(256, 256, 64, 64, 128) == pytest.approx((0.5, 0.25))
  assert shampoo_mults(512, 512, 64, 64, 128) == pytest.approx((0.25, 1 / 16))


@pytest.mark.parametrize('name', ['muon', 'muon_rms', 'shampoo', 'shampoo_vanilla'])
def test_base_width_mup_rules_equal_sp(name):
  """At base width every multiplier of the optimizer's muP is exactly SP's (1), so the chain and
  the init are SP's and training is bit-identical (end to end: the slow test below)."""
  sp, mu = _pz(D0, 'sp', name), _pz(D0, 'mup', name)
  fields = ('init_scale', 'fwd_mult', 'lr_mult', 'wd_mult', 'eps_mult', 'damping_mult')
  for path in sp.rules:
    assert [getattr(mu.rules[path], f) for f in fields] == [1.0] * 6, path
    assert [getattr(sp.rules[path], f) for f in fields] == [1.0] * 6, path
  assert mu.opt_multipliers() is None and sp.opt_multipliers() is None


@pytest.mark.parametrize('kind', ['umup', 'mup_table3', 'completep'])
def test_adam_only_parametrization_is_one_line(kind, tiny_config):
  """The table's line (config/compat.py), checked before anything is built."""
  config = tiny_config(**{'parametrization.kind': kind, 'train.optimizer': 'muon'})
  with pytest.raises(ConfigError, match=f'kind={kind}.* with train.optimizer=muon: this '
                                        'parametrization is written for AdamW') as e:
    experiment.validate(config)
  assert '\n' not in str(e.value)


def test_muon_mup_on_the_readout_is_one_line():
  with pytest.raises(ConfigError, match='hidden kernels on Muon only.*valid train.matrix_roles'):
    _pz(64, 'mup', 'muon', matrix_roles='reader,writer,readout')
  with pytest.raises(ConfigError, match=r'hidden kernels on vanilla Shampoo \(train.shampoo.'
                                        r'graft=none\) only.*valid train.matrix_roles') as e:
    _pz(64, 'mup', 'shampoo_vanilla', matrix_roles='reader,writer,embedding')
  assert '\n' not in str(e.value)
  _pz(64, 'mup', 'shampoo', matrix_roles='reader,writer,embedding')   # grafted: Adam's rules


@pytest.mark.slow
@pytest.mark.parametrize('name', ['muon', 'muon_rms', 'shampoo', 'shampoo_vanilla'])
def test_base_width_mup_trains_bitwise_like_sp(name):
  """Three steps of the tiny model under the optimizer: base-width muP == SP bit for bit; half
  the base width changes them (not vacuous)."""
  from sharenet.parametrization import rules as P
  from sharenet.models import DecoderLM, init_variables, param_table

  def run(kind, base):
    graft = 'none' if name == 'shampoo_vanilla' else 'adam'
    t = _train(optimizer=name.split('_')[0], lr=1e-2, weight_decay=0.1, grad_clip=1.0,
               shampoo=dict(block_size=16, eps=1e-3, graft=graft),
               muon=dict(scale='rms' if name == 'muon_rms' else 'shape'))
    pz = P.Parametrization(_tiny(D0, kind, base), t)
    model = DecoderLM(pz.cfg)
    tx = chain.make_optimizer(t, multipliers=pz.opt_multipliers(), table=param_table(pz.cfg))
    p = pz.init(init_variables(model, jax.random.key(0)))

    def loss(p, toks):
      logits = model.apply(pz.forward(p), toks[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

    @jax.jit
    def step(p, s, toks):
      u, s = tx.update(jax.grad(loss)(p, toks), s, p)
      return optax.apply_updates(p, u), s
    s = tx.init(p)
    for i in range(3):
      p, s = step(p, s, jax.random.randint(jax.random.key(i), (2, 12), 0, 64))
    return jax.tree.leaves(p)

  sp = run('sp', D0)
  for a, b in zip(sp, run('mup', D0)):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(sp, run('mup', D0 // 2)))


@pytest.mark.parametrize('name', ['adamw', 'muon'])
def test_qk_lr_multiplies_the_query_and_key_kernels_only(name):
  from sharenet.parametrization import rules as P
  t = _train(optimizer=name)
  cfg = _tiny(64, 'mup')
  plain = P.Parametrization(cfg, t).rules
  cfg2 = cfg.derive(parametrization=scaling.Settings(kind='mup', base_d_model=D0, qk_lr=4.0))
  scaled = P.Parametrization(cfg2, t).rules
  changed = {p[-2] for p in plain if scaled[p].lr_mult != plain[p].lr_mult}
  assert changed == {'q', 'k'}
  for p in plain:
    if p[-2] in changed:
      assert scaled[p].lr_mult == pytest.approx(4.0 * plain[p].lr_mult)
  with pytest.raises(ConfigError, match='qk_lr=0.0 must be > 0'):
    scaling.Settings(qk_lr=0.0).validate()


@pytest.mark.parametrize('overrides, match', [
    ({'train.optimizer': 'shampoo', 'train.shampoo.block_size': 0},
     'train.shampoo.block_size=0 must be >= 1; valid'),
    ({'train.optimizer': 'muon', 'train.matrix_roles': 'reader,bias'},
     "cannot take role 'bias'.*valid: reader, writer"),
    ({'train.optimizer': 'muon', 'parametrization.kind': 'umup'},
     'with train.optimizer=muon.*written for AdamW.*valid with muon / shampoo: sp, mup'),
])
def test_config_validation_is_one_line_before_building(tiny_config, overrides, match):
  from sharenet.train import experiment
  with pytest.raises(ConfigError, match=match) as e:
    experiment.validate(tiny_config(**overrides))
  assert '\n' not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize('name, other', [('shampoo', 'muon'), ('muon', 'shampoo'),
                                         ('kfac', 'shampoo')])
def test_run_resumes_exactly_and_refuses_another_optimizer(tmp_path, tiny_config, losses, name,
                                                           other):
  """A Shampoo (Muon, K-FAC) workdir resumed from its step-3 checkpoint gives the uninterrupted
  run's losses at steps 4-6 bit for bit: Shampoo's statistics, inverse roots (recomputed every 2
  steps, so the resumed run starts between two recomputations), step counter and graft moments
  (Muon's momentum; K-FAC's factors and inverses, also every 2 steps) are restored, and the final optimizer states are equal. Resuming it under
  the other optimizer is one ConfigError line naming the change and the way out
  (train.restore=params), and trains nothing."""
  import os
  import shutil
  import orbax.checkpoint as ocp
  from sharenet.train import loop
  over = {'train.optimizer': name, 'train.shampoo.update_every': 2,
          'train.shampoo.block_size': 16, 'train.kfac.update_every': 2, 'train.steps': 6,
          'train.checkpoint_every': 3}
  ref, resumed = str(tmp_path / 'ref'), str(tmp_path / 'resumed')
  loop.train_and_evaluate(tiny_config(**over), ref)
  shutil.copytree(os.path.join(ref, 'checkpoints'), os.path.join(resumed, 'checkpoints'),
                  ignore=shutil.ignore_patterns('6'))
  shutil.copy(os.path.join(ref, 'config.json'), resumed)
  loop.train_and_evaluate(tiny_config(**over), resumed)
  want, got = losses(ref), losses(resumed)
  assert sorted(want) == list(range(1, 7)) and sorted(got) == [4, 5, 6], (want, got)
  assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]
  restore = lambda d: ocp.CheckpointManager(os.path.join(d, 'checkpoints')).restore(
      6, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']['opt_state']
  a, b = restore(ref), restore(resumed)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # not vacuous: the state holds accumulated block statistics (momenta), far from their init
  assert any(np.ndim(x) == 3 and float(np.abs(x).max()) > 1e-3 for x in jax.tree.leaves(a))
  with pytest.raises(ConfigError, match=f"train.optimizer '{name}' -> '{other}'") as e:
    loop.train_and_evaluate(tiny_config(**{**over, 'train.optimizer': other}), resumed)
  assert '\n' not in str(e.value) and 'train.restore=params' in str(e.value)
  assert sorted(losses(resumed)) == [4, 5, 6]
