"""Attention back-ends (sharenet/kernels/attention.py) against the XLA reference, on CPU.

The Pallas FlashAttention kernel (Dao et al., arXiv:2205.14135) runs here in Pallas interpret
mode: the same kernel and custom VJP as on a GPU, executed by XLA:CPU, so shapes stay tiny.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sharenet import kernels
from sharenet.train import loop
from sharenet.errors import ConfigError
from sharenet.kernels import attention as attn
from sharenet.models import DecoderLM, ModelConfig, init_variables

# (B, T, H, K, Dh): MHA at a block size; GQA at an odd length (13 -> padded to 16);
# MQA at a length past the 32-wide backward blocks (40 -> 64).
SHAPES = [(2, 16, 4, 4, 16), (1, 13, 4, 2, 32), (1, 40, 2, 1, 16)]


def qkv(B, T, H, K, Dh, dtype=jnp.float32, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (B, T, H, Dh), dtype), jax.random.normal(kk, (B, T, K, Dh), dtype),
          jax.random.normal(kv, (B, T, K, Dh), dtype))


def pallas_cpu(q, k, v, *, scale):
  return attn.attention(q, k, v, scale=scale, impl='pallas')


@functools.lru_cache(maxsize=None)
def loss_and_grads(fn):
  """jit(value_and_grad) of sum(fn(q, k, v, scale) * cotangent) w.r.t. q, k, v and scale."""
  def loss(q, k, v, scale, ct):
    return jnp.sum(fn(q, k, v, scale=scale).astype(jnp.float32) * ct)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ---- the reference itself, against a loop written from the definition -----------------------

def naive_attention(q, k, v, scale):
  """Per (batch, head, query) softmax over keys 0..t, in float64 NumPy."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, Dh = q.shape
  G = H // k.shape[2]
  out = np.zeros_like(q)
  for b in range(B):
    for h in range(H):
      for t in range(T):
        s = scale * k[b, :t + 1, h // G] @ q[b, t, h]
        p = np.exp(s - s.max())
        out[b, t, h] = (p / p.sum()) @ v[b, :t + 1, h // G]
  return out


def test_reference_matches_definition():
  q, k, v = qkv(1, 7, 4, 2, 8)
  out = attn.reference(q, k, v, scale=0.3)
  assert rel_err(out, naive_attention(q, k, v, 0.3)) < 1e-5


# ---- the chunked back-end (the CPU default) ---------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'B{}T{}H{}K{}D{}'.format(*s))
def test_chunked_reference_values_and_grads(shape):
  """Causal query chunks of 1, 5 and 8 (ragged last chunk included) give the unchunked values
  and gradients, with packed-document segment ids too; and the definition's values."""
  q, k, v = qkv(*shape)
  B, T = shape[:2]
  ct = jax.random.normal(jax.random.key(3), q.shape)
  seg = jnp.asarray(np.repeat(np.arange(3), -(-T // 3))[:T][None].repeat(B, 0))
  want = naive_attention(q, k, v, 0.3)
  for segment_ids in (None, seg):
    l0, g0 = loss_and_grads(functools.partial(attn.reference, segment_ids_BT=segment_ids))(
        q, k, v, 0.3, ct)
    for chunk in (1, 5, 8):
      l1, g1 = loss_and_grads(functools.partial(attn.reference, segment_ids_BT=segment_ids,
                                                chunk=chunk))(q, k, v, 0.3, ct)
      assert rel_err(l1, l0) < 1e-4, chunk   # sums of signed terms (loss, d scale): float32
      for a, b in zip(g1, g0):
        assert rel_err(a, b) < 1e-4, chunk
  for chunk in (1, 5, 8):
    # jitted: eagerly, each chunk's ops (a new key length per chunk) would compile one by one
    out = jax.jit(functools.partial(attn.reference, scale=0.3, chunk=chunk))(q, k, v)
    assert rel_err(out, want) < 1e-5, chunk


@pytest.mark.slow
def test_attention_auto_is_chunked_on_cpu_and_the_model_still_sows_attn_logits():
  assert kernels.attention_backend('auto', 'auto') == 'chunked'
  assert kernels.attention_backend('auto', 'xla') == 'chunked'
  assert kernels.attention_backend('xla', 'auto') == 'xla'
  toks = jax.random.randint(jax.random.key(1), (2, 200), 0, 64)   # 2 chunks of CPU_CHUNK
  cfgs = {a: tiny_model(attention=a, num_kv_heads=2) for a in ('xla', 'chunked')}
  variables = init_variables(DecoderLM(cfgs['xla']), jax.random.key(0))
  grad_fn = jax.jit(jax.value_and_grad(model_loss), static_argnums=1)
  (l0, g0), (l1, g1) = (grad_fn(variables, DecoderLM(cfgs[a]), toks) for a in ('xla', 'chunked'))
  assert abs(float(l1) - float(l0)) < 1e-6
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert rel_err(a, b) < 1e-5
  sown = {}
  for a, cfg in cfgs.items():   # a coordinate check sees the same statistic under both
    _, state = DecoderLM(cfg).apply(variables, toks, mutable=['intermediates'])
    sown[a] = [np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)
               if 'attn_logits' in jax.tree_util.keystr(p)]
  assert sown['chunked'] and len(sown['chunked']) == len(sown['xla'])
  for a, b in zip(sown['chunked'], sown['xla']):
    np.testing.assert_allclose(a, b, rtol=1e-6)


# ---- Pallas kernel vs reference -------------------------------------------------------------

@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'B{}T{}H{}K{}D{}'.format(*s))
def test_pallas_values_and_grads_fp32(shape):
  q, k, v = qkv(*shape)
  ct = jax.random.normal(jax.random.key(7), q.shape)
  scale = jnp.float32(0.7)   # a traced scale, as the l2 QK-norm's learned gain is
  (l_ref, g_ref) = loss_and_grads(attn.reference)(q, k, v, scale, ct)
  (l_ker, g_ker) = loss_and_grads(pallas_cpu)(q, k, v, scale, ct)
  assert abs(float(l_ker) - float(l_ref)) <= 1e-5 * max(1.0, abs(float(l_ref)))
  out_ref = attn.reference(q, k, v, scale=scale)
  assert rel_err(pallas_cpu(q, k, v, scale=scale), out_ref) < 1e-5
  for name, a, b in zip(('q', 'k', 'v', 'scale'), g_ker, g_ref):
    assert a.shape == b.shape, name
    assert rel_err(a, b) < 1e-4, name
  assert float(jnp.abs(g_ker[3])) > 0   # the scale gets a gradient through q * scale


def test_pallas_bf16():
  """bf16 in and out (float32 softmax inside both): outputs within 2e-2 relative (bf16 keeps ~3
  significant digits)."""
  q, k, v = qkv(2, 16, 4, 2, 16, dtype=jnp.bfloat16)
  ct = jax.random.normal(jax.random.key(7), q.shape)
  scale = jnp.asarray(0.25, jnp.bfloat16)
  out = pallas_cpu(q, k, v, scale=scale)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, attn.reference(q, k, v, scale=scale)) < 2e-2
  _, g_ref = loss_and_grads(attn.reference)(q, k, v, scale, ct)
  _, g_ker = loss_and_grads(pallas_cpu)(q, k, v, scale, ct)
  # Tensors within 3e-2; the scale's gradient is one bf16 reduction over 2048 products in both
  # back-ends (summed in different orders), so within 1e-1.
  for name, a, b, tol in zip(('q', 'k', 'v', 'scale'), g_ker, g_ref, (3e-2, 3e-2, 3e-2, 1e-1)):
    assert a.dtype == b.dtype == jnp.bfloat16, name
    assert rel_err(a, b) < tol, name


def test_pallas_is_causal():
  """Changing keys and values at positions >= 9 leaves the outputs at positions < 9 unchanged."""
  B, T, H, K, Dh = SHAPES[1]
  q, k, v = qkv(B, T, H, K, Dh)
  k2, v2 = (x.at[:, 9:].set(100.0 * jnp.ones_like(x[:, 9:])) for x in (k, v))
  out, out2 = pallas_cpu(q, k, v, scale=0.3), pallas_cpu(q, k2, v2, scale=0.3)
  np.testing.assert_array_equal(np.asarray(out[:, :9]), np.asarray(out2[:, :9]))
  assert float(jnp.max(jnp.abs(out[:, 9:] - out2[:, 9:]))) > 1.0   # not vacuous


def test_block_sizes_cover_every_length():
  for T in range(1, 300):
    T_pad, block = attn.gpu_block(T)
    assert T <= T_pad and T_pad % block == 0 and block >= 16 and block & (block - 1) == 0
    T_pad, block = attn.tpu_block(T)
    assert T <= T_pad and T_pad % block == 0 and block % 128 == 0


@pytest.mark.slow
def test_pallas_tpu_kernel_in_tpu_interpret_mode():
  """The TPU path (ops.tpu.flash_attention, [B,H,T,D], T padded to 128) under TPU interpretation."""
  from jax.experimental.pallas import tpu as pltpu
  q, k, v = qkv(1, 13, 2, 1, 16)
  ct = jax.random.normal(jax.random.key(7), q.shape)
  scale = jnp.float32(0.7)
  _, g_ref = loss_and_grads(attn.reference)(q, k, v, scale, ct)
  try:
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      out = attn.pallas_tpu_attention(q, k, v, scale=scale)
      _, g_ker = jax.value_and_grad(
          lambda *a: jnp.sum(attn.pallas_tpu_attention(*a[:3], scale=a[3]) * ct),
          argnums=(0, 1, 2, 3))(q, k, v, scale)
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  assert rel_err(out, attn.reference(q, k, v, scale=scale)) < 1e-5
  for name, a, b in zip(('q', 'k', 'v'), g_ker, g_ref):
    assert rel_err(a, b) < 1e-4, name
  # d/dscale = sum(q * dL/d(q*scale)) cancels heavily (here 0.024 from terms of size ~10):
  # measured against the size of its terms.
  terms = np.sum(np.abs(np.asarray(q) * np.asarray(g_ref[0]))) / 0.7
  assert abs(float(g_ker[3]) - float(g_ref[3])) < 1e-5 * terms


# ---- configuration errors -------------------------------------------------------------------

def test_cudnn_on_cpu_is_one_config_error():
  with pytest.raises(ConfigError, match=r'model.attention=cudnn needs an NVIDIA GPU') as e:
    kernels.attention_backend('cudnn', 'auto')
  assert '\n' not in str(e.value)
  cfg = tiny_model(attention='cudnn')
  with pytest.raises(ConfigError, match=r'model.attention=cudnn'):
    jax.eval_shape(lambda: init_variables(DecoderLM(cfg), jax.random.key(0)))


def test_unknown_attention_is_config_error():
  with pytest.raises(ConfigError, match=r"model.attention='flash'.*valid"):
    tiny_model(attention='flash')
  with pytest.raises(ConfigError, match=r'valid: xla, chunked, cudnn, pallas'):
    attn.attention(*qkv(1, 4, 2, 2, 8), scale=1.0, impl='flash')


# ---- inside the model: model.kernels=pallas vs xla ------------------------------------------

def tiny_model(**kw):
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=48, remat='none')
  return ModelConfig(**base).derive(**kw)


def model_loss(variables, model, toks):
  logits = model.apply(variables, toks[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()


# Between them: both plans (cycle = nn.scan with tied weights), GQA and MQA, the l2 QK-norm's
# learned scale, u-muP's unit-scaled attention, and remat dots / full.
MODEL_CASES = {
    'untied_gqa_dots': dict(sharing=dict(scheme='untied'), num_kv_heads=2, remat='dots'),
    'cycle_mqa_l2qk_umup_full': dict(sharing=dict(scheme='cycle', repeats=2), num_layers=4,
                                     norm=dict(qk_norm='l2'), num_kv_heads=1, remat='full',
                                     parametrization=dict(kind='umup')),
}


@pytest.mark.slow
@pytest.mark.parametrize('case', list(MODEL_CASES))
def test_model_pallas_matches_xla(case):
  """Same loss and gradients (every parameter, the learned qk_scale included) as the XLA path.

  model.attention=pallas with model.kernels=xla isolates the attention kernel from the other
  Pallas kernels (model.kernels=pallas selects it too: test_pallas_trains_like_xla). T = 13
  query positions (12 after the shift) exercise the padding to the 16-wide block.
  """
  xla_cfg = tiny_model(kernels='xla', attention='xla', **MODEL_CASES[case])
  ker_cfg = xla_cfg.derive(attention='pallas')
  variables = init_variables(DecoderLM(xla_cfg), jax.random.key(0))
  toks = jax.random.randint(jax.random.key(1), (2, 13), 0, 64)
  grad_fn = jax.jit(jax.value_and_grad(model_loss), static_argnums=1)
  ref_loss, ref_g = grad_fn(variables, DecoderLM(xla_cfg), toks)
  loss, g = grad_fn(variables, DecoderLM(ker_cfg), toks)
  assert abs(float(loss) - float(ref_loss)) < 1e-5
  flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_g))
  flat = dict(jax.tree_util.tree_leaves_with_path(g))
  assert flat.keys() == flat_ref.keys()
  for path, a in flat.items():
    assert rel_err(a, flat_ref[path]) < 1e-4, jax.tree_util.keystr(path)
  if xla_cfg.norm.qk_norm == 'l2':
    scales = [p for p in flat if 'qk_scale' in jax.tree_util.keystr(p)]
    assert scales and all(float(jnp.max(jnp.abs(flat[p]))) > 0 for p in scales)


def test_model_pallas_does_not_sow_attn_logits():
  """The fused kernel never forms the logits: 'attn_logits' is sown on the XLA path only."""
  toks = jnp.zeros((1, 8), jnp.int32)
  names = {}
  for k in ('xla', 'pallas'):
    model = DecoderLM(tiny_model(kernels='xla', attention=k))
    variables = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
    _, state = jax.eval_shape(
        lambda v: model.apply(v, toks, mutable=['intermediates']), variables)
    names[k] = {jax.tree_util.keystr(p) for p, _ in
                jax.tree_util.tree_leaves_with_path(state['intermediates'])}
  assert any('attn_logits' in n for n in names['xla'])
  assert not any('attn_logits' in n for n in names['pallas'])
  assert any('attn_out' in n for n in names['pallas'])


# ---- training: 5 steps of the tiny config -------------------------------------------------

# model.kernels=pallas runs the attention and the fused residual-add + norm kernels: each norm
# kind the kernel family takes, under an untied and a tied (cycle) plan, and GQA.
TRAIN_CASES = {
    'untied_rmsnorm': {'model.sharing.scheme': 'untied'},
    'untied_layernorm': {'model.sharing.scheme': 'untied', 'model.norm.kind': 'layernorm'},
    'untied_crmsnorm_gqa': {'model.sharing.scheme': 'untied', 'model.norm.kind': 'crmsnorm',
                            'model.num_kv_heads': 1},
    'cycle_gqa_layernorm_untied_norms': {
        'model.sharing.scheme': 'cycle', 'model.num_layers': 2, 'model.sharing.repeats': 2,
        'model.num_kv_heads': 1, 'model.norm.kind': 'layernorm',
        'model.sharing.untie_norms': True},
}


@pytest.fixture(scope='module')
def small_corpus(tmp_path_factory):
  """~40 KB of text, so the end-of-run evaluation covers a few batches, not the stdlib corpus."""
  path = tmp_path_factory.mktemp('corpus') / 'corpus.txt'
  path.write_bytes(open(os.__file__, 'rb').read()[:40_000])
  return str(path)


@pytest.mark.slow
@pytest.mark.parametrize('case', list(TRAIN_CASES))
def test_pallas_trains_like_xla(case, tmp_path, tiny_config, losses, small_corpus):
  """model.kernels=pallas trains the tiny config with the XLA path's losses over 5 steps."""
  runs = {}
  for k in ('xla', 'pallas'):
    cfg = tiny_config(**{'train.steps': 5, 'train.batch_size': 2, 'train.seq_len': 16,
                         'train.checkpoint_every': 100, 'train.eval_batch_size': 64,
                         'data.source': 'text', 'data.path': small_corpus,
                         'model.kernels': k, **TRAIN_CASES[case]})
    loop.train_and_evaluate(cfg, str(tmp_path / k))
    runs[k] = losses(str(tmp_path / k))
  assert sorted(runs['pallas']) == sorted(runs['xla']) == [1, 2, 3, 4, 5]
  for step, ref in runs['xla'].items():
    assert abs(runs['pallas'][step] - ref) <= 1e-5 * abs(ref), step
