"""The attention core's cached-decoding case (sharenet/kernels/attention.py): queries at
positions against a KV cache with key positions (-1: empty), through the same `attention` entry
as training, on every back-end; the model's cached decode through it; and sharenet/kernels/ as a
leaf that imports nothing from sharenet/models/."""
import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet import kernels
from sharenet.kernels import attention as attn
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.models.lm import init_cache


def qkv(B, T, H, K, Dh, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (B, T, H, Dh)), jax.random.normal(kk, (B, T, K, Dh)),
          jax.random.normal(kv, (B, T, K, Dh)))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ---- the cached-decoding case: queries at positions, a cache with key positions -------------

def decode_case(B=2, T=3, S=9, H=4, K=2, Dh=8, seed=0):
  """q (B, T) at positions, a cache of S slots in no particular order with empty slots (-1)."""
  q, _, _ = qkv(B, T, H, K, Dh, seed=seed)
  _, k, v = qkv(B, S, H, K, Dh, seed=seed + 1)
  q_pos = jnp.array([[4, 5, 6], [0, 1, 2]], jnp.int32)
  k_pos = jnp.array([[0, 1, 2, 3, 4, 5, 6, -1, -1],
                     [-1, -1, 0, 1, 2, -1, 7, 3, -1]], jnp.int32)   # row 1: padding, a late key
  return q, k, v, q_pos, k_pos


def naive_decode(q, k, v, scale, q_pos, k_pos):
  """Per (batch, head, query) softmax over the keys at positions 0..its own, float64 NumPy."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
  B, T, H, _ = q.shape
  G = H // k.shape[2]
  out = np.zeros_like(q)
  for b in range(B):
    for h in range(H):
      for t in range(T):
        seen = (k_pos[b] >= 0) & (k_pos[b] <= q_pos[b, t])
        s = scale * k[b, seen, h // G] @ q[b, t, h]
        p = np.exp(s - s.max())
        out[b, t, h] = (p / p.sum()) @ v[b, seen, h // G]
  return out


@pytest.mark.slow
def test_reference_decode_case_matches_definition():
  q, k, v, q_pos, k_pos = decode_case()
  out = attn.attention(q, k, v, scale=0.3, impl='xla', q_positions_BT=q_pos, k_positions_BS=k_pos)
  assert rel_err(out, naive_decode(q, k, v, 0.3, q_pos, k_pos)) < 1e-5
  # positions 0..T-1 on both sides are the training case, bit for bit
  q, k, v = qkv(2, 7, 4, 2, 8)
  pos = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
  np.testing.assert_array_equal(
      np.asarray(attn.reference(q, k, v, scale=0.3, q_positions_BT=pos, k_positions_BS=pos)),
      np.asarray(attn.reference(q, k, v, scale=0.3)))


@pytest.mark.parametrize('impl', ['chunked', 'pallas', 'cudnn'])
def test_decode_case_on_every_back_end_is_the_reference(impl, monkeypatch, capsys):
  """chunked runs the reference unchunked; the fused kernels take no positions, so they run the
  reference with the one-line fallback note (cudnn reaches it before needing a GPU)."""
  monkeypatch.setattr(kernels, '_noted', set())
  q, k, v, q_pos, k_pos = decode_case()
  run = lambda i: attn.attention(q, k, v, scale=0.3, impl=i, q_positions_BT=q_pos,
                                 k_positions_BS=k_pos)
  np.testing.assert_array_equal(np.asarray(run(impl)), np.asarray(run('xla')))
  err = capsys.readouterr().err
  note = f'{impl} attention kernel cannot take query / key positions (cached decoding)'
  assert (note in err) == (impl != 'chunked'), err


def test_decode_case_shape_errors():
  q, k, v, q_pos, k_pos = decode_case()
  with pytest.raises(ValueError, match='go together'):
    attn.attention(q, k, v, scale=1.0, impl='xla', q_positions_BT=q_pos)
  with pytest.raises(ValueError, match='segment ids'):
    attn.attention(q, k, v, scale=1.0, impl='xla', q_positions_BT=q_pos, k_positions_BS=k_pos,
                   segment_ids_BT=jnp.zeros(q_pos.shape, jnp.int32))
  with pytest.raises(ValueError, match='T = S without positions'):
    attn.attention(q, k, v, scale=1.0, impl='xla')
  with pytest.raises(ValueError, match='k positions'):
    attn.attention(q, k, v, scale=1.0, impl='xla', q_positions_BT=q_pos,
                   k_positions_BS=k_pos[:, :4])


@pytest.mark.slow
def test_model_decodes_through_the_core_on_every_back_end():
  """A cached prefill and one step give the same logits and cache under model.attention = xla,
  chunked and pallas (the reference, via the fallback), with GQA, RoPE and QK-norm."""
  outs = {}
  for a in ('xla', 'chunked', 'pallas'):
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=48,
                      remat='none', attention=a, kernels='xla', num_kv_heads=2,
                      norm=dict(qk_norm='rms'))
    model = DecoderLM(cfg)
    variables = init_variables(model, jax.random.key(0))
    cache = init_cache(cfg, 2, 8)
    toks = jnp.array([[5, 6, 7, 8], [0, 0, 9, 10]], jnp.int32)
    pos = jnp.array([[0, 1, 2, 3], [-1, -1, 0, 1]], jnp.int32)
    l1, cache = model.apply(variables, toks, cache=cache, positions_BT=pos)
    l2, cache = model.apply(variables, jnp.array([[11], [12]], jnp.int32), cache=cache,
                            positions_BT=jnp.array([[4], [2]], jnp.int32))
    outs[a] = [np.asarray(x) for x in (l1, l2, *jax.tree.leaves(cache))]
  for a in ('chunked', 'pallas'):
    for x, y in zip(outs[a], outs['xla']):
      np.testing.assert_array_equal(x, y)


# ---- kernels are leaves -----------------------------------------------------------------------

def imported_modules(path: pathlib.Path, package: str) -> set[str]:
  """Every module a file imports, anywhere in it (function-local imports too), made absolute."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:   # relative: resolved against the file's package
        parts = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(parts + ([base] if base else []))
      names |= {base} | {f'{base}.{a.name}' for a in node.names}
  return names


def test_kernels_import_nothing_from_models(repo_root):
  """Every file under sharenet/kernels/, at any depth, with absolute and relative imports."""
  kernel_dir = pathlib.Path(repo_root) / 'sharenet' / 'kernels'
  files = sorted(kernel_dir.rglob('*.py'))
  assert {f.name for f in files} >= {'__init__.py', 'attention.py', 'einsum.py', 'norms.py'}
  offending = {}
  for f in files:
    package = '.'.join(('sharenet', 'kernels') + f.relative_to(kernel_dir).parent.parts)
    offending[str(f.relative_to(kernel_dir))] = sorted(
        m for m in imported_modules(f, package)
        if m == 'sharenet.models' or m.startswith('sharenet.models.'))
  assert not any(offending.values()), offending
  # the check sees a models import where there is one
  models_file = pathlib.Path(repo_root) / 'sharenet' / 'models' / 'attention.py'
  assert 'sharenet.kernels.attention' in imported_modules(models_file, 'sharenet.models')
