"""MPO kernels with a shared central tensor (model.mpo.*, models/mpo.py; MPOBERT) and the
conversion from plain kernels (convert.py --config.to=mpo, transforms/to_mpo.py): the chain's
contraction against an index-by-index numpy restatement, the decomposition's exactness at full
bonds, the model against an untied one holding the contracted kernels, stored counts, the
conversion's exactness, and bad settings."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, accounting, init_variables, mpo
from sharenet.transforms import to_mpo

D, H, F = 32, 2, 48


def _cfg(**kw):
  base = dict(vocab_size=64, d_model=D, num_layers=2, num_heads=H, mlp_dim=F, mlp='gelu',
              remat='none')
  return ModelConfig(**base).derive(**kw)


def _chain_by_index(tensors, ins, outs):
  """W[(i_1..i_n), (j_1..j_n)] = T_1[:, i_1, j_1, :] ... T_n[:, i_n, j_n, :], entry by entry."""
  W = np.zeros((math.prod(ins), math.prod(outs)))
  for i in itertools.product(*[range(x) for x in ins]):
    for j in itertools.product(*[range(x) for x in outs]):
      m = np.eye(1)
      for k, t in enumerate(tensors):
        m = m @ t[:, i[k], j[k], :]
      W[np.ravel_multi_index(i, ins), np.ravel_multi_index(j, outs)] = m[0, 0]
  return W


@pytest.mark.parametrize('fan_in, fan_out, cores, bond', [(12, 8, 2, 0), (8, 12, 3, 0),
                                                          (16, 8, 3, 3), (16, 16, 4, 5)])
def test_contraction_is_the_chain_entry_by_entry(fan_in, fan_out, cores, bond):
  s = mpo.mpo_shape(fan_in, fan_out, cores, bond)
  assert math.prod(s.ins) == fan_in and math.prod(s.outs) == fan_out
  rng = np.random.default_rng(0)
  tensors = [rng.normal(size=s.tensor(k)) for k in range(cores)]
  np.testing.assert_allclose(np.asarray(mpo.contract(tensors, s)),
                             _chain_by_index(tensors, s.ins, s.outs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('fan_in, fan_out, cores', [(32, 48, 3), (48, 32, 5), (64, 64, 4),
                                                    (32, 32, 2)])
def test_decomposition_is_exact_at_full_bonds_and_truncates_monotonically(fan_in, fan_out,
                                                                         cores):
  w = np.random.default_rng(1).normal(size=(fan_in, fan_out))
  full = mpo.mpo_shape(fan_in, fan_out, cores, 0)
  sizes = [i * j for i, j in zip(full.ins, full.outs)]
  assert full.bonds == tuple([1] + [min(math.prod(sizes[:k]), math.prod(sizes[k:]))
                                    for k in range(1, cores)] + [1])
  err = lambda s: np.linalg.norm(mpo.contract(mpo.decompose(w, s), s) - w) / np.linalg.norm(w)
  assert err(full) < 1e-12
  errors = [err(mpo.mpo_shape(fan_in, fan_out, cores, b)) for b in (1, 2, 4, 8)]
  assert all(a >= b - 1e-12 for a, b in zip(errors, errors[1:])) and errors[0] > 0.1


def test_factors_are_balanced_and_exact():
  assert mpo.factors(768, 5) == (3, 4, 4, 4, 4)     # MPOBERT's 768 -> [4,4,4,4,3]
  assert mpo.factors(3072, 5) == (4, 4, 4, 6, 8)    # its 3072 -> [4,4,8,6,4], reordered
  assert mpo.factors(7, 3) == (1, 1, 7) and math.prod(mpo.factors(48, 4)) == 48


@pytest.mark.slow
def test_the_model_uses_the_contracted_kernels_and_stores_the_centre_once():
  """Each stored set's kernel is the chain of its auxiliary tensors around the shared central
  one: an untied model holding those contracted kernels gives the same logits (float64);
  the centre is stored once per kernel type, the auxiliary tensors per set."""
  with jax.enable_x64(True):
    kw = dict(dtype='float64', param_dtype='float64')
    cfg, plain = _cfg(mpo=dict(cores=3, bond=6), **kw), _cfg(**kw)
    v = flatten_dict(init_variables(DecoderLM(cfg), jax.random.key(0)))
    u = flatten_dict(init_variables(DecoderLM(plain), jax.random.key(1)))
    dims = {'q': (D, D), 'k': (D, D), 'v': (D, D), 'o': (D, D), 'wi': (D, F), 'wo': (F, D)}
    for p in u:
      if p[-1] != 'kernel' or 'block' not in p:
        u[p] = v[p]
        continue
      name = p[-2]
      s = mpo.mpo_shape(*dims[name], 3, 6)
      centre = np.asarray(v[('params', 'mpo', name)])
      aux = {k: np.asarray(v[p[:-1] + (f'mpo_{k}',)]) for k in (0, 2)}
      u[p] = jnp.asarray(np.stack([
          _chain_by_index([aux[0][l], centre, aux[2][l]], s.ins, s.outs) for l in range(2)])
          .reshape(u[p].shape))
    toks = jax.random.randint(jax.random.key(7), (2, 10), 0, 64)
    np.testing.assert_allclose(DecoderLM(cfg).apply(unflatten_dict(v), toks),
                               DecoderLM(plain).apply(unflatten_dict(u), toks),
                               rtol=1e-10, atol=1e-10)
  cfg = _cfg(mpo=dict(cores=3, bond=6))
  n_plain = accounting.params_unique(init_variables(DecoderLM(_cfg()), jax.random.key(0)))
  kernels, expected = 2 * (4 * D * D + 2 * D * F), 0
  for name, dim in dims.items():
    s = mpo.mpo_shape(*dim, 3, 6)
    sizes = [math.prod(s.tensor(k)) for k in range(3)]
    expected += sizes[1] + 2 * (sizes[0] + sizes[2])       # centre once, aux per set
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  assert accounting.params_unique(v) == n_plain - kernels + expected
  assert accounting.matmul_params_per_layer(cfg) == accounting.matmul_params_per_layer(_cfg())


@pytest.mark.slow
def test_gradients_reach_the_centre_and_every_auxiliary_tensor():
  cfg = _cfg(mpo=dict(cores=3), sharing=dict(scheme='cycle', num_unique=1))
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  toks = jax.random.randint(jax.random.key(7), (2, 11), 0, 64)

  def loss(params):
    logits = DecoderLM(cfg).apply({'params': params}, toks[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))

  grads = flatten_dict(jax.grad(loss)(v['params']))
  mpo_grads = {p: float(jnp.max(jnp.abs(g))) for p, g in grads.items()
               if p[0] == 'mpo' or p[-1].startswith('mpo_')}
  assert len(mpo_grads) == 6 * 3 and min(mpo_grads.values()) > 0


@pytest.mark.slow
def test_a_shared_model_converts_exactly_and_an_untied_one_reports_its_error():
  """A universal model (one stored set) converts exactly at full bonds; an untied one keeps
  stored set 0 exact (its centre is the shared one) and reports the others' error."""
  with jax.enable_x64(True):
    kw = dict(dtype='float64', param_dtype='float64')
    toks = jax.random.randint(jax.random.key(7), (2, 10), 0, 64)
    shared = _cfg(sharing=dict(scheme='universal', num_unique=1), **kw)
    v = init_variables(DecoderLM(shared), jax.random.key(0))
    for cores in (2, 3, 4):
      new_cfg, new_v, record = to_mpo.to_mpo(shared, v, cores)
      assert new_cfg.mpo.cores == cores and max(max(e) for e in
                                                record['relative_error'].values()) < 1e-12
      np.testing.assert_allclose(DecoderLM(new_cfg).apply(new_v, toks),
                                 DecoderLM(shared).apply(v, toks), rtol=1e-10, atol=1e-10)
    untied = _cfg(**kw)
    v = init_variables(DecoderLM(untied), jax.random.key(0))
    new_cfg, new_v, record = to_mpo.to_mpo(untied, v, 3, targets=('q', 'o'))
    assert new_cfg.mpo_kernels == ('q', 'o')
    assert all(e[0] < 1e-12 and 0 < e[1] < 1 for e in record['relative_error'].values())


@pytest.mark.parametrize('mpo_keys, match', [
    (dict(cores=1), r'model.mpo.cores=1: a chain of one tensor is the matrix itself'),
    (dict(cores=3, bond=999), r'model.mpo.bond=999 is above full rank: the largest full bond '
                              r'dimension of the target kernels is \d+; valid: 1..\d+, or 0'),
    (dict(cores=3, bond=-1), r'model.mpo.bond=-1 must be >= 0'),
    (dict(cores=3, targets='q,x'), r"model.mpo.targets='x'"),
])
def test_bad_mpo_settings_are_one_line(mpo_keys, match):
  with pytest.raises(ConfigError, match=match) as e:
    _cfg(mpo=mpo_keys)
  assert '\n' not in str(e.value)
