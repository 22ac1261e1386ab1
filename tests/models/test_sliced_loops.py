"""SReT's sliced group attention in the loops (model.loop_slices, models/attention.py; Shen et
al., arXiv:2111.05297): a model sliced in every loop against the plain model run on each slice
alone, the folded slices against the same function as masks (packed documents, a length that
is no multiple of the slice), the FLOPs, and bad settings. Cached generation against the full
forward: tests/inference/test_generate.py (plan cycle_sliced)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, accounting, init_variables
from sharenet.models.attention import slice_segments, sliced_attention
from sharenet.kernels import attention as attention_kernel

T = 16


def _cfg(**kw):
  base = dict(vocab_size=64, d_model=32, num_layers=3, num_heads=2, mlp_dim=48, remat='none',
              sharing=dict(scheme='universal', num_unique=1), norm=dict(qk_norm_len=T))
  return ModelConfig(**base).derive(**kw)


def test_every_loop_sliced_is_the_plain_model_on_each_slice():
  """With every loop attending within halves, the logits of a sequence are the plain model's
  on each half alone (RoPE scores depend on relative positions only; float64, but RoPE's angles
  are float32, so the second half's rotations agree to ~1e-7)."""
  with jax.enable_x64(True):
    kw = dict(dtype='float64', param_dtype='float64')
    cfg, plain = _cfg(loop_slices='2', **kw), _cfg(**kw)
    v = init_variables(DecoderLM(cfg), jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, T), 0, 64)
    out = DecoderLM(cfg).apply(v, toks)
    halves = jnp.concatenate([DecoderLM(plain).apply(v, toks[:, :T // 2]),
                              DecoderLM(plain).apply(v, toks[:, T // 2:])], axis=1)
    np.testing.assert_allclose(out, halves, rtol=0, atol=2e-6)
    assert float(jnp.max(jnp.abs(DecoderLM(plain).apply(v, toks) - out))) > 1e-3


@pytest.mark.parametrize('length', [16, 13])
def test_folded_slices_are_the_masked_function(length):
  """The lax.switch branches (slices folded into the batch; a call of 13 padded) equal full
  attention under (document, slice) segment ids, for every branch, with packed documents."""
  lens = (4, 8)
  q, k, v = (jax.random.normal(jax.random.key(i), (2, length, 2, 8)) for i in range(3))
  seg = jnp.asarray(np.repeat([[0] * 6 + [1] * (length - 6)], 2, 0), jnp.int32)
  attend = lambda q, k, v, segment_ids_BT=None: attention_kernel.attention(
      q, k, v, scale=8 ** -0.5, impl='xla', segment_ids_BT=segment_ids_BT)
  for branch in range(3):
    b = jnp.asarray(branch, jnp.int32)
    got = jax.jit(lambda q, k, v, seg, b: sliced_attention(attend, q, k, v, seg, b, lens))(
        q, k, v, seg, b)
    want = attend(q, k, v, segment_ids_BT=slice_segments(seg, (2, length), b, lens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # an independent mask: same document, same slice (full: one slice), causal
    n = (length,) + lens
    pos = np.arange(length)
    mask = ((pos[:, None] >= pos[None, :]) & (pos[:, None] // n[branch] == pos[None] // n[branch])
            & (np.asarray(seg)[0][:, None] == np.asarray(seg)[0][None, :]))
    logits = np.einsum('bthd,bshd->bhts', np.asarray(q), np.asarray(k)) * 8 ** -0.5
    logits = np.where(mask[None, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum('bhts,bshd->bthd', p, np.asarray(v)),
                               rtol=1e-5, atol=1e-6)


def test_a_coordinate_check_sees_the_same_model():
  """Observing the logits (a coordinate check) takes the mask path: the same outputs."""
  cfg = _cfg(loop_slices='4,1', sharing=dict(scheme='cycle', num_unique=1), num_layers=2)
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  toks = jax.random.randint(jax.random.key(1), (2, T), 0, 64)
  plain = DecoderLM(cfg).apply(v, toks)
  observed, state = DecoderLM(cfg).apply(v, toks, mutable=['intermediates'])
  np.testing.assert_allclose(observed, plain, rtol=1e-5, atol=1e-5)
  assert state['intermediates']


def test_sliced_loops_count_their_attention_at_the_slice_length():
  """'4,1' over 4 loops of one set: loops 1 and 3 attend over 4 positions, 2 and 4 over 16."""
  cfg = _cfg(num_layers=4, loop_slices='4,1')
  assert cfg.slice_lens == (4,) and cfg.slice_branch == (1, 0, 1, 0)
  assert accounting.attended_length(cfg, T) == 4 + 16 + 4 + 16
  plain = _cfg(num_layers=4)
  HD = 2 * 16
  diff = accounting.flops_per_token(plain, T) - accounting.flops_per_token(cfg, T)
  assert diff == 3 * 2 * (2 * 16 - 2 * 4) * HD   # train: 3 x forward; QK^T and PV halved


def test_prelude_and_coda_attend_in_full():
  cfg = _cfg(num_layers=4, sharing=dict(scheme='middle_cycle', num_unique=3),
             loop_slices='2')
  assert cfg.slice_branch == (0, 1, 1, 0)


@pytest.mark.parametrize('slices, match', [
    ('3', r"model.loop_slices='3': group count 3 does not divide the training sequence length "
          r'16 into slices; valid: divisors of 16'),
    ('2,x', r"model.loop_slices='2,x' is not a comma list of group counts; valid: e.g. 4,1"),
    ('0', r"group count 0 does not divide"),
])
def test_bad_slicings_are_one_line(slices, match):
  with pytest.raises(ConfigError, match=match) as e:
    _cfg(loop_slices=slices)
  assert '\n' not in str(e.value)
