"""Factorized embeddings (model.embed_dim, model.embed_projection; models/embeddings.py) against
numpy restatements of ALBERT's factorization and Subformer's SAFE."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.config import compat
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, accounting, init_variables, param_table, scaling
from sharenet.models.config import ModelConfig

BASE = dict(d_model=32, num_heads=4, mlp_dim=64, num_layers=2, vocab_size=40, mlp='gelu',
            dtype='float64', param_dtype='float64')
E = 16


def _cfg(proj='linear', **kw):
  return ModelConfig(**{**BASE, 'embed_dim': E, 'embed_projection': proj, **kw})


def _vars(cfg, seed=0):
  """Initialised variables with every parameter moved off its init (unit gains would hide a
  norm's gain in the restatement)."""
  v = init_variables(DecoderLM(cfg), jax.random.key(seed))
  leaves, tree = jax.tree.flatten(v)
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(tree, [x + 0.1 * rng.normal(size=x.shape) for x in leaves])


def _rms(x, g, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g


def _rope(x_THD, base):
  T, _, d = x_THD.shape
  freq = base ** (-np.arange(0, d, 2) / d)
  ang = np.arange(T)[:, None] * freq[None]
  sin, cos = np.sin(ang)[:, None], np.cos(ang)[:, None]
  x1, x2 = x_THD[..., :d // 2], x_THD[..., d // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _gelu(x):   # flax's default: the tanh approximation
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _lift(cfg, p, tokens_T):
  """The stream entering the blocks, restated: table rows, then ALBERT's E x D projection or
  SAFE's pre-norm layer at width E (h = e + Attn(norm e); act(norm(h) W1) W2)."""
  e = np.asarray(p['embed']['embedding'])[tokens_T]
  q = p['embed_proj']
  if cfg.embed_projection == 'linear':
    return e @ np.asarray(q['up']['kernel'])
  k = lambda n: np.asarray(q[n]['kernel'])
  eps = cfg.norm.eps
  a = _rms(e, np.asarray(q['attn_norm']['scale']), eps)
  H, dh = E // cfg.d_head, cfg.d_head
  qh, kh, vh = (np.einsum('te,ehd->thd', a, k(n)) for n in ('q', 'k', 'v'))
  qh, kh = _rope(qh, cfg.rope_base), _rope(kh, cfg.rope_base)
  T = len(tokens_T)
  s = np.einsum('thd,shd->hts', qh, kh) / math.sqrt(dh)
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  h = e + np.einsum('hts,shd,hde->te', w, vh, k('o'))
  assert k('q').shape == (E, H, dh)
  f = _gelu(_rms(h, np.asarray(q['mlp_norm']['scale']), eps) @ k('fc1'))
  return f @ k('fc2')


@pytest.mark.parametrize('proj', ['linear', 'self_attentive'])
@pytest.mark.parametrize('tied', [False, True])
def test_the_model_restates_the_factorization(proj, tied):
  """The embedded stream is the restated lift of the (vocab, E) table; a tied readout reads
  the final normed stream through W_down (D -> E) and the table: logits = (x W_down) T^T."""
  with jax.enable_x64(True):
    cfg = _cfg(proj, tie_embeddings=tied)
    v = _vars(cfg)
    p = jax.tree.map(np.asarray, v['params'])
    tokens = np.random.default_rng(1).integers(0, 40, (2, 7))
    model = DecoderLM(cfg)
    x = np.asarray(model.apply(v, jnp.asarray(tokens), method=model.embed))
    for b in range(2):
      # rotary angles are float32 in the model at every dtype (layers.rope)
      tol = 1e-10 if proj == 'linear' else 1e-6
      np.testing.assert_allclose(x[b], _lift(cfg, p, tokens[b]), rtol=tol, atol=tol * 0.1)
    h = np.random.default_rng(2).normal(size=(2, 5, 32))
    logits = np.asarray(model.apply(v, jnp.asarray(h), method=model.head))
    n = _rms(h, p['final_norm']['scale'], cfg.norm.eps)
    want = (n @ p['readout_proj']['kernel'] @ p['embed']['embedding'].T if tied
            else n @ p['readout']['kernel'])
    np.testing.assert_allclose(logits, want, rtol=1e-10, atol=1e-12)


def test_packed_documents_lift_within_their_own():
  """With segment ids the self-attentive lift attends within each packed document: a document's
  rows equal the restated lift of that document alone (rotary attention depends on position
  differences only, so the packed offset does not matter)."""
  with jax.enable_x64(True):
    cfg = _cfg('self_attentive')
    v = _vars(cfg)
    p = jax.tree.map(np.asarray, v['params'])
    tokens = np.random.default_rng(3).integers(0, 40, (1, 9))
    seg = np.asarray([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
    model = DecoderLM(cfg)
    x = np.asarray(model.apply(v, jnp.asarray(tokens), segment_ids_BT=jnp.asarray(seg),
                               method=model.embed))
    for doc in (0, 1):
      rows = seg[0] == doc
      np.testing.assert_allclose(x[0, rows], _lift(cfg, p, tokens[0, rows]), rtol=1e-6,
                                 atol=1e-7)


@pytest.mark.parametrize('proj', ['linear', 'self_attentive'])
def test_stored_parameters_flops_and_roles(proj):
  """The table stores V x E; the lift's and a tied readout's kernels are the accounting's
  weights per token (io_matmul_params) and are hidden matrices on the width axis
  'embed_factor' (muP scales E with d_model: the base model's E is halved with d_model)."""
  cfg = _cfg(proj, tie_embeddings=True, dtype='float32', param_dtype='float32')
  table = param_table(cfg)
  by = {'/'.join(p[1:]): i for p, i in table.items()}
  assert by['embed/embedding'].shape == (40, E)
  assert by['embed/embedding'].axes == ('vocab', 'embed_factor')
  io = [i for k, i in by.items() if k.startswith(('embed_proj/', 'readout_proj/'))
        and k.endswith('kernel')]
  assert accounting.io_matmul_params(cfg) == sum(math.prod(i.shape) for i in io) + 40 * E
  assert all(i.role in ('reader', 'writer') and
             {'embed_factor', 'embed_factor_hidden'} & set(i.axes) for i in io)
  plain = ModelConfig(**{**BASE, 'tie_embeddings': True, 'dtype': 'float32',
                         'param_dtype': 'float32'})
  unique = lambda c: accounting.params_unique(init_variables(DecoderLM(c), jax.random.key(0)))
  assert unique(plain) - unique(cfg) == 40 * 32 - 40 * E - sum(
      math.prod(i.shape) for i in table.values() if i.path[1] in ('embed_proj', 'readout_proj'))
  extra_attn = 2 * 64 * E if proj == 'self_attentive' else 0
  assert accounting.flops_per_token(cfg, 64, train=False) - accounting.flops_per_token(
      plain, 64, train=False) == 2 * (accounting.io_matmul_params(cfg) - 40 * 32) + extra_attn
  base = scaling.base_config(cfg.derive(parametrization=dataclasses.replace(
      cfg.parametrization, kind='mup', base_d_model=16, base_num_heads=2)))
  assert base.embed_dim == E // 2


@pytest.mark.parametrize('kw,match', [
    (dict(embed_dim=32), r'model\.embed_dim=32: factorized embeddings need 0 < embed_dim < '
                         r'd_model=32'),
    (dict(embed_dim=12, embed_projection='self_attentive'),
     r'model\.embed_dim=12: the self-attentive embedding attends with heads of head_dim 8'),
    (dict(embed_projection='conv'), r'model\.embed_projection'),
])
def test_bad_factorizations_are_one_line(kw, match):
  with pytest.raises(ConfigError, match=match) as e:
    ModelConfig(**{**BASE, 'embed_dim': E, **kw})
  assert '\n' not in str(e.value)


def test_the_self_attentive_embedding_refuses_cached_decoding():
  """SAFE attends over the sequence before the blocks and keeps no cache: generation refuses it
  in one line (the compatibility table's)."""
  why = compat.refusal('embed_self_attentive', 'generation')
  assert why and 'no cache' in why
  assert compat.refusal('embed_linear', 'generation') is None


def test_the_self_attentive_embedding_shards_and_a_repeated_axis_is_refused():
  """The SAFE block's E -> E kernel has two axis names, so the train loop's sharding specs
  place it (it once had ('embed_factor', 'embed_factor'), which flax's logical_to_mesh_axes
  refuses: train.py failed); `param` refuses a repeated name where it is created."""
  import flax.linen as nn
  from sharenet.models import logical_axes
  from sharenet.models.params import param
  from sharenet.train import sharding
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, mlp_dim=64,
                    embed_dim=16, embed_projection='self_attentive')
  model = DecoderLM(cfg)
  v = nn.unbox(init_variables(model, jax.random.key(0)))
  mesh = sharding.make_mesh(default_mesh())
  specs = sharding.param_specs(logical_axes(model), v, mesh, sharding.rules_of(default_mesh()),
                               [])
  assert specs
  class Twice(nn.Module):
    @nn.compact
    def __call__(self):
      return param(self, 'w', (4, 4), ('embed', 'embed'), 'reader', std=0.5, num_in=1)
  with pytest.raises(ValueError, match=r"parameter w: logical axes \('embed', 'embed'\) repeat"):
    Twice().init(jax.random.key(0))


def default_mesh():
  from sharenet.config import defaults
  return defaults.default_config().mesh
