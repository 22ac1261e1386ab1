"""Tests for sharenet.train.evaluation: per-token NLL and the full-split evaluation."""
import math

import jax
import ml_collections
import numpy as np
import pytest

from sharenet import data
from sharenet.train import evaluation
from sharenet.models import DecoderLM, ModelConfig, init_variables

SEQ_LEN, BATCH = 16, 4
_apply = jax.jit(lambda model, params, tokens: model.apply(params, tokens), static_argnums=0)


@pytest.fixture(scope='module')
def model_and_params():
  model = DecoderLM(ModelConfig(vocab_size=256, d_model=16, num_layers=1, num_heads=2,
                                mlp_dim=32, remat='none'))
  return model, jax.jit(lambda: init_variables(model, jax.random.key(0)))()


def _nll_by_hand(model, params, tokens):
  """-log softmax(logits)[target] in float64, from the model's logits."""
  logits = np.asarray(_apply(model, params, tokens[:, :-1]), np.float64)
  top = logits.max(-1, keepdims=True)
  log_z = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
  target = np.take_along_axis(logits, np.asarray(tokens[:, 1:])[..., None], -1)[..., 0]
  return log_z - target


def test_token_nll_is_the_log_softmax_nll(model_and_params):
  model, params = model_and_params
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 256)
  nll, _ = jax.jit(evaluation.token_nll, static_argnums=0)(model, params, tokens)
  assert nll.shape == (2, 8)
  np.testing.assert_allclose(nll, _nll_by_hand(model, params, tokens), rtol=1e-5)


def test_evaluate_counts_every_validation_token_once(model_and_params, text_cfg, monkeypatch):
  """Against the unpadded windows scored one by one; the mask total is the split length - 1."""
  model, params = model_and_params
  counts = []
  step = evaluation._eval_step

  def counting_step(*args):
    s, n = step(*args)
    counts.append(float(n))
    return s, n

  monkeypatch.setattr(evaluation, '_eval_step', counting_step)
  out = evaluation.evaluate(model, params, text_cfg, SEQ_LEN, BATCH)
  val = np.asarray(data.load_splits(text_cfg)[1], np.int32)
  assert len(val) == 300
  # 299 targets in 19 windows: 5 batches of 4 rows, the last window short and one row all padding.
  assert len(counts) == 5 and sum(counts) == len(val) - 1 == data.num_eval_tokens(text_cfg)
  starts = range(0, len(val) - 1, SEQ_LEN)
  full = np.stack([val[j:j + SEQ_LEN + 1] for j in starts if j + SEQ_LEN < len(val)])
  short = [val[None, j:] for j in starts if j + SEQ_LEN >= len(val)]
  assert len(full) + len(short) == 19 and len(short) == 1
  total = sum(_nll_by_hand(model, params, w).sum() for w in [full, *short])
  assert out['eval_loss'] == pytest.approx(total / (len(val) - 1), rel=1e-5)
  assert out['eval_bits_per_byte'] == pytest.approx(out['eval_loss'] / math.log(2), rel=1e-12)


def test_bits_per_byte_divides_by_bytes_per_token(model_and_params, text_cfg, monkeypatch):
  model, params = model_and_params
  base = evaluation.evaluate(model, params, text_cfg, SEQ_LEN, BATCH)
  monkeypatch.setattr(evaluation.data, 'bytes_per_token', lambda cfg: 2.5)
  out = evaluation.evaluate(model, params, text_cfg, SEQ_LEN, BATCH)
  assert out['eval_loss'] == base['eval_loss']
  assert out['eval_bits_per_byte'] == pytest.approx(base['eval_loss'] / math.log(2) / 2.5,
                                                    rel=1e-12)


def test_token_files_report_bits_per_token(model_and_params, tmp_path):
  """`bin` sources have no bytes per token: the metric is bits per token."""
  model, params = model_and_params
  path = tmp_path / 'train.bin'
  np.random.default_rng(1).integers(0, 256, 20_000).astype(np.uint16).tofile(path)
  cfg = ml_collections.ConfigDict({'source': 'bin', 'path': str(path)})
  assert data.bytes_per_token(cfg) is None
  out = evaluation.evaluate(model, params, cfg, SEQ_LEN, BATCH)
  assert out['eval_bits_per_byte'] == pytest.approx(out['eval_loss'] / math.log(2), rel=1e-12)
  assert 4.0 < out['eval_loss'] < 7.0   # near ln 256 = 5.55 for an untrained model
