"""data.source=arrayrecord: process slices, packing, segment mask, resume, eval bytes; uint32 bin.

Fixtures are tiny datasets written in the sharenet-arrayrecord-v1 format (arrayrecord.write_split):
a few dozen short text documents as bytes, with 0 (absent from the text) as end-of-document id.
Expectations are computed from the documents themselves, not from the pipeline.
"""
import math
import os
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet import data
from sharenet.train import evaluation
from sharenet.data import arrayrecord
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables

EOD = 0
VOCAB = 256


def _documents(n, start=0):
  """n distinct short byte documents (no NUL byte), lengths 5..~60."""
  rng = np.random.default_rng(start)
  docs = []
  for i in range(start, start + n):
    words = ' '.join(rng.choice(['alpha', 'beta', 'gamma', 'delta', 'x'], rng.integers(0, 10)))
    docs.append(f'doc {i}: {words}\n')
  return docs


def _write(path, train_texts, val_texts, num_shards=3, val_bytes=None):
  enc = lambda texts: [list(t.encode()) for t in texts]
  train = arrayrecord.write_split(path, 'train', enc(train_texts), EOD, num_shards)
  val = arrayrecord.write_split(path, 'validation', enc(val_texts), EOD, 1)
  train['bytes'] = sum(len(t.encode()) for t in train_texts)
  val['bytes'] = val_bytes or sum(len(t.encode()) for t in val_texts)
  arrayrecord.write_meta(str(path), {'train': train, 'validation': val}, VOCAB, EOD)
  return str(path)


@pytest.fixture(scope='module')
def corpus_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp('ar')
  return _write(path, _documents(40), _documents(8, start=1000), val_bytes=1234)


def _cfg(path, **kw):
  return {'source': 'arrayrecord', 'path': path, **kw}


def _row_streams(path, seq_len, batch, num_batches, pi=0, pc=1, seed=7):
  """Per batch row: (its packed token stream, that stream cut back into documents)."""
  it = data.make_train_iterator(_cfg(path), seq_len, batch * pc, seed, pi, pc)
  windows = [next(it) for _ in range(num_batches)]
  for w in windows:
    assert w.shape == (batch, seq_len + 1) and w.dtype == np.int32
  out = []
  for r in range(batch):
    stream = np.concatenate([w[r] for w in windows])
    cuts = np.flatnonzero(stream == EOD)
    docs = [bytes(stream[a + 1:b].astype(np.uint8)).decode()
            for a, b in zip(np.concatenate([[-1], cuts[:-1]]), cuts)]
    out.append((stream, docs))
  return out


def test_two_processes_read_disjoint_slices_covering_each_epoch(corpus_dir):
  texts = _documents(40)
  batch = 2
  seen = []
  for pi in range(2):
    mine = texts[pi::2]          # records pi, pi + 2, ...: 20 per process
    longest = max(sum(len(t.encode()) + 1 for t in mine[r::batch]) for r in range(batch))
    # Enough windows for more than two epochs of the longest row.
    rows = _row_streams(corpus_dir, 15, batch, math.ceil(2.2 * longest / 16), pi, 2)
    for r, (_, docs) in enumerate(rows):
      own = mine[r::batch]       # row r packs documents r, r + B, ... of the process's slice
      n = len(own)
      assert sorted(docs[:n]) == sorted(own)              # epoch 1: its documents, once each
      assert sorted(docs[n:2 * n]) == sorted(own)         # epoch 2: again, once each
      assert docs[:n] != docs[n:2 * n]                    # reshuffled
      seen += docs[:n]
  assert sorted(seen) == sorted(texts)                    # disjoint, union = every document


def test_packing_keeps_every_token_once_per_epoch(corpus_dir):
  texts = _documents(40)
  batch = 4
  per_row = [texts[r::batch] for r in range(batch)]
  longest = max(sum(len(t.encode()) + 1 for t in own) for own in per_row)
  rows = _row_streams(corpus_dir, 31, batch, math.ceil(2 * longest / 32) + 1)
  for own, (stream, docs) in zip(per_row, rows):
    n = len(own)
    tokens_per_epoch = sum(len(t.encode()) + 1 for t in own)
    # Non-overlapping windows: the row's stream is its documents concatenated, each token once.
    epoch = np.concatenate([list(t.encode()) + [EOD] for t in docs[:n]])
    assert sorted(docs[:n]) == sorted(own)
    np.testing.assert_array_equal(stream[:tokens_per_epoch], epoch)
    assert sorted(docs[n:2 * n]) == sorted(own)   # the next epoch follows without a gap


def test_a_batch_mixes_documents(corpus_dir):
  """Rows are separate streams: the first windows of a batch start different documents."""
  batch = next(data.make_train_iterator(_cfg(corpus_dir), 15, 4, seed=7))
  # Every document starts 'doc <i>: '; a row's first window starts its first document.
  firsts = [bytes(row[:8].astype(np.uint8)).decode().split(':')[0] for row in batch]
  assert all(f.startswith('doc ') for f in firsts) and len(set(firsts)) == 4


def test_state_resumes_mid_document(corpus_dir):
  it = data.make_train_iterator(_cfg(corpus_dir, segment_mask=True), 13, 2, seed=3)
  for _ in range(5):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(6)]
  fresh = data.make_train_iterator(_cfg(corpus_dir, segment_mask=True), 13, 2, seed=3)
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    np.testing.assert_array_equal(got['tokens'], want['tokens'])
    np.testing.assert_array_equal(got['segment_ids'], want['segment_ids'])


def test_window_shuffle_permutes_each_block_of_a_rows_windows(corpus_dir):
  """data.shuffle_windows=K: row r's windows k*K .. (k+1)*K - 1 are its unshuffled windows of
  that block in another order (the stream itself is unchanged)."""
  K, blocks, batch = 6, 3, 2
  plain = data.make_train_iterator(_cfg(corpus_dir), 15, batch, seed=7)
  shuffled = data.make_train_iterator(_cfg(corpus_dir, shuffle_windows=K), 15, batch, seed=7)
  a = np.stack([next(plain) for _ in range(K * blocks)])      # (steps, B, W)
  b = np.stack([next(shuffled) for _ in range(K * blocks)])
  for r in range(batch):
    for k in range(blocks):
      want, got = a[k * K:(k + 1) * K, r], b[k * K:(k + 1) * K, r]
      assert sorted(map(bytes, want.astype(np.uint8))) == sorted(map(bytes, got.astype(np.uint8)))
      assert not np.array_equal(want, got), (r, k)


@pytest.mark.parametrize('steps', [3, 6, 8])   # inside a block, at its end, in the next one
def test_window_shuffle_resumes_exactly(corpus_dir, steps):
  cfg = _cfg(corpus_dir, shuffle_windows=6)
  it = data.make_train_iterator(cfg, 13, 2, seed=3)
  for _ in range(steps):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(9)]
  fresh = data.make_train_iterator(cfg, 13, 2, seed=3)
  fresh.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(fresh), want)


def test_window_shuffle_needs_documents(tmp_path):
  with pytest.raises(ConfigError, match='data.shuffle_windows=4: valid: 0') as e:
    data.validate_data_config({'source': 'stdlib', 'shuffle_windows': 4}, 16, 2)
  assert '\n' not in str(e.value)
  with pytest.raises(ConfigError, match='data.shuffle_windows=-1'):
    data.validate_data_config({'source': 'stdlib', 'shuffle_windows': -1}, 16, 2)


def test_segment_ids_count_documents_within_window(corpus_dir):
  batch = next(data.make_train_iterator(_cfg(corpus_dir, segment_mask=True), 40, 3, seed=1))
  for row, seg in zip(batch['tokens'], batch['segment_ids']):
    doc = 0
    for t, s in zip(row, seg):
      assert s == doc
      doc += int(t == EOD)


def _tiny_model(tiny_config, attention):
  c = tiny_config(**{'model.d_model': 16, 'model.num_layers': 1, 'model.num_heads': 2,
                     'model.mlp_dim': 32, 'model.attention': attention, 'model.kernels': 'xla',
                     'model.dtype': 'float32'})
  return DecoderLM(ModelConfig.from_config(c.model, 16))


@pytest.mark.slow
@pytest.mark.parametrize('attention', ['xla', 'pallas'])
def test_segment_mask_blocks_cross_document_attention(tiny_config, attention):
  model = _tiny_model(tiny_config, attention)
  params = init_variables(model, jax.random.key(0), seq_len=16)
  doc1 = [5, 6, 7, 8, 9, EOD]
  tokens = np.array([doc1 + list(range(20, 30))], np.int32)                 # doc 2 from 6
  changed = np.array([[50, 51, 52, 53, 54, EOD] + list(range(20, 30))], np.int32)
  seg = jnp.asarray(arrayrecord.segment_ids(tokens, EOD))
  assert seg.tolist() == [[0] * 6 + [1] * 10]
  masked = [model.apply(params, jnp.asarray(t), seg) for t in (tokens, changed)]
  open_ = [model.apply(params, jnp.asarray(t)) for t in (tokens, changed)]
  # Document 2's positions see nothing of document 1 under the mask...
  np.testing.assert_allclose(masked[0][0, 6:], masked[1][0, 6:], rtol=0, atol=1e-6)
  # ...and do see it without (the mask is what changed it).
  assert float(jnp.max(jnp.abs(open_[0][0, 6:] - open_[1][0, 6:]))) > 1e-3
  # Within one document the mask is plain causal attention.
  np.testing.assert_allclose(masked[0][0, :6], open_[0][0, :6], rtol=0, atol=1e-5)


def test_eval_covers_validation_and_uses_meta_bytes(corpus_dir, tiny_config):
  val_texts = _documents(8, start=1000)
  val = np.concatenate([list(t.encode()) + [EOD] for t in val_texts])
  cfg = _cfg(corpus_dir)
  got, count = [], 0.0
  for tokens, mask in data.eval_batches(cfg, 16, 4):
    for row, m in zip(tokens, mask):
      got += row[1:][m > 0].tolist()
    count += mask.sum()
  assert got == val[1:].tolist() and count == len(val) - 1 == data.num_eval_tokens(cfg)
  assert data.bytes_per_token(cfg) == 1234 / len(val)
  model = _tiny_model(tiny_config, 'xla')
  params = init_variables(model, jax.random.key(1), seq_len=16)
  for seg_cfg in (cfg, _cfg(corpus_dir, segment_mask=True)):
    out = evaluation.evaluate(model, params, seg_cfg, 16, 4)
    np.testing.assert_allclose(out['eval_bits_per_byte'],
                               out['eval_loss'] / math.log(2) * len(val) / 1234, rtol=1e-12)


def test_vocab_mismatch_is_one_line_config_error(corpus_dir):
  with pytest.raises(ConfigError) as e:
    data.validate_data_config(_cfg(corpus_dir), 16, 4, 1, vocab_size=300)
  msg = str(e.value)
  assert '300' in msg and '256' in msg and '--config.model.vocab_size=256' in msg
  assert '\n' not in msg
  data.validate_data_config(_cfg(corpus_dir), 16, 4, 1, vocab_size=256)
  assert data.vocab_size(_cfg(corpus_dir)) == 256


def test_bad_arrayrecord_configs(corpus_dir, tmp_path):
  with pytest.raises(ConfigError, match='meta.json'):
    data.validate_data_config(_cfg(str(tmp_path)), 16, 4)
  with pytest.raises(ConfigError, match='segment_mask'):
    data.make_train_iterator({'source': 'stdlib', 'segment_mask': True}, 16, 4, seed=0)
  with pytest.raises(ConfigError, match='fewer than'):
    data.validate_data_config(_cfg(corpus_dir), 16, 64, process_count=64)
  with pytest.raises(ConfigError, match='streams'):
    data.load_splits(_cfg(corpus_dir))


def test_uint32_bin(tmp_path):
  ids = (np.arange(3000, dtype=np.uint64) * 7919 % 100_003).astype(np.uint32)
  path = str(tmp_path / 'train.bin')
  ids.tofile(path)
  cfg = {'source': 'bin', 'path': path, 'bin_dtype': 'uint32'}
  train, val = data.load_splits(cfg)
  np.testing.assert_array_equal(np.concatenate([train, val]), ids)   # last 1 % is validation
  assert len(val) == 30 and int(ids.max()) > 65535
  it = data.make_train_iterator(cfg, 16, 2, seed=0)
  for row in next(it):
    start = int(np.flatnonzero(ids == row[0])[0])   # ids are distinct
    np.testing.assert_array_equal(row, ids[start:start + 17].astype(np.int32))
  with pytest.raises(ConfigError, match=f'reach id {int(ids[:-30].max())}'):
    data.validate_data_config(cfg, 16, 2, vocab_size=65536)
  data.validate_data_config(cfg, 16, 2, vocab_size=int(ids.max()) + 1)
  with pytest.raises(ConfigError, match='bin_dtype'):
    data.load_splits({**cfg, 'bin_dtype': 'int8'})
  odd = str(tmp_path / 'odd.bin')
  ids[:11].astype(np.uint16).tofile(odd)  # 22 bytes: not whole uint32 ids
  with pytest.raises(ConfigError, match='multiple of 4'):
    data.load_splits({'source': 'bin', 'path': odd, 'bin_dtype': 'uint32'})


@pytest.mark.slow
def test_resume_after_kill_is_bit_identical_on_arrayrecord(corpus_dir, tmp_path, losses,
                                                           tiny_config, train_cmd,
                                                           subprocess_env):
  """train.py on prepared shards killed (-9) after its step-8 checkpoint and resumed: steps
  9-16 give the uninterrupted run's losses (trained in this process) bit for bit."""
  from sharenet.train import loop
  overrides = {'data.source': 'arrayrecord', 'data.path': corpus_dir,
               'data.segment_mask': True, 'train.steps': 16, 'train.checkpoint_every': 8,
               'train.seq_len': 16}
  flags = [f'--config.{k}={v}' for k, v in overrides.items()]
  ref_dir, workdir = str(tmp_path / 'ref'), str(tmp_path / 'killed')
  loop.train_and_evaluate(tiny_config(**overrides), ref_dir)
  proc = subprocess.Popen(train_cmd(workdir, *flags), env=subprocess_env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt = os.path.join(workdir, 'checkpoints', '8')
  deadline = time.time() + 300
  while not os.path.isdir(ckpt) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert os.path.isdir(ckpt), 'the run never wrote its step-8 checkpoint'
  out = subprocess.run(train_cmd(workdir, *flags), env=subprocess_env, check=True,
                       capture_output=True, text=True)
  assert 'resumed from checkpoint at step 8' in out.stdout
  ref, resumed = losses(ref_dir), losses(workdir)
  assert len(ref) == 16
  assert [resumed[s] for s in range(9, 17)] == [ref[s] for s in range(9, 17)]


@pytest.mark.slow
def test_train_step_consumes_segment_ids_and_splits_them_for_grad_accum(corpus_dir, tiny_config):
  from sharenet.train import trainer
  from sharenet.models import ModelConfig as MC
  c = tiny_config(**{'model.d_model': 16, 'model.num_layers': 1, 'model.mlp_dim': 32,
                     'model.kernels': 'xla', 'model.attention': 'xla', 'train.seq_len': 16})
  exp = trainer.setup(c, MC.from_config(c.model, 16))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  batch = next(data.make_train_iterator(_cfg(corpus_dir, segment_mask=True), 16, 4, seed=2))
  assert batch['segment_ids'].max() > 0   # some window holds two documents
  masked = trainer.loss_fn(state.params, state.tstate, batch, model=exp.model)[0]
  plain = trainer.loss_fn(state.params, state.tstate, batch['tokens'], model=exp.model)[0]
  assert abs(float(masked) - float(plain)) > 1e-6
  out = [jax.jit(trainer.make_train_step(exp, g))(state, batch)[1] for g in (1, 2)]
  np.testing.assert_allclose(out[1]['loss'], out[0]['loss'], rtol=1e-5)
  np.testing.assert_allclose(out[1]['grad_norm'], out[0]['grad_norm'], rtol=1e-4)
  np.testing.assert_allclose(out[0]['loss'], masked, rtol=1e-6)


@pytest.mark.slow
def test_attention_kernels_with_segment_ids_equal_per_document_attention():
  """reference, Pallas GPU (interpret) and Pallas TPU (TPU interpret) with segment ids == causal
  attention run on each document separately (outputs and gradients)."""
  from jax.experimental.pallas import tpu as pltpu
  from sharenet.kernels import attention as attn
  B, T, H, K, Dh = 1, 13, 2, 1, 16
  q, k, v, ct = (jax.random.normal(jax.random.key(i), (B, T, n, Dh))
                 for i, n in enumerate((H, K, K, H)))
  bounds = [0, 5, 6, 13]   # documents [0, 5), [5, 6), [6, 13)
  seg = jnp.asarray(np.repeat(np.arange(3), np.diff(bounds))[None], jnp.int32)
  per_doc = lambda q, k, v: jnp.concatenate(
      [attn.reference(q[:, a:b], k[:, a:b], v[:, a:b], scale=0.5)
       for a, b in zip(bounds[:-1], bounds[1:])], axis=1)
  kernels_ = {
      'reference': lambda q, k, v: attn.reference(q, k, v, scale=0.5, segment_ids_BT=seg),
      'pallas_gpu': lambda q, k, v: attn.pallas_gpu_attention(q, k, v, scale=0.5, interpret=True,
                                                             segment_ids_BT=seg),
      'pallas_tpu': lambda q, k, v: attn.pallas_tpu_attention(q, k, v, scale=0.5,
                                                             segment_ids_BT=seg)}
  grads = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2))(q, k, v)
  want, want_g = per_doc(q, k, v), grads(per_doc)
  for name, f in kernels_.items():
    if name == 'pallas_tpu':
      try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
          out, g = f(q, k, v), grads(f)
      finally:
        pltpu.reset_tpu_interpret_mode_state()
    else:
      out, g = f(q, k, v), grads(f)
    np.testing.assert_allclose(out, want, atol=2e-5, err_msg=name)
    for a, b in zip(g, want_g):
      np.testing.assert_allclose(a, b, atol=1e-4, err_msg=name)
