"""data.source=hf: training straight from a streamed dataset (sharenet/data/hf_stream.py).

The dataset is a local directory of parquet files the test writes, read through the same
`datasets.load_dataset(..., streaming=True)` call a hub name takes (the hub is unreachable here).
Expectations come from the documents themselves and from prepare's shards of the same files.
"""
import subprocess
import sys

import numpy as np
import pytest
from conftest import kill_after_checkpoint

from sharenet import data
from sharenet.data import arrayrecord, corpus, hf_stream
from sharenet.errors import ConfigError

SEQ = 16
EOD = 256   # the bytes tokenizer's end-of-document id


def _texts(n, seed=0):
  rng = np.random.default_rng(seed)
  words = ['alpha', 'beta', 'gamma', 'delta', 'éclair', 'x']
  return [f'doc {i}: ' + ' '.join(rng.choice(words, rng.integers(1, 12))) for i in range(n)]


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  import pyarrow as pa
  import pyarrow.parquet as pq
  root = tmp_path_factory.mktemp('hf') / 'ds'
  root.mkdir()
  texts = _texts(400)
  for i in range(4):
    pq.write_table(pa.table({'text': texts[i::4], 'id': list(range(i, 400, 4))}),
                   root / f'part-{i}.parquet')
  order = [t for i in range(4) for t in texts[i::4]]   # the stream's order: file by file
  return str(root), order


def _cfg(path, **kw):
  return {'source': 'hf', 'path': path, 'eval_tokens': 2000, **kw}


def _split(order):
  val = [t for t in order if corpus.text_fraction(t) < hf_stream.VAL_FRACTION]
  return [t for t in order if t not in val], val


def _row_docs(batches, row):
  """Row `row`'s packed stream cut back into documents (the last, partial one dropped)."""
  stream = np.concatenate([b[row] for b in batches])
  cuts = np.flatnonzero(stream == EOD)
  return [bytes(stream[a + 1:b].astype(np.uint8)).decode()
          for a, b in zip(np.concatenate([[-1], cuts[:-1]]), cuts)]


def _expected_rows(train, batch, steps):
  """The rule restated on the documents: row after row, a row that runs out of its document
  takes the stream's next train document (bytes + EOD) and fills its window."""
  docs = iter(train)
  rest = [[] for _ in range(batch)]
  out = np.zeros((steps, batch, SEQ + 1), np.int32)
  for s in range(steps):
    for r in range(batch):
      while len(rest[r]) < SEQ + 1:
        rest[r] += list(next(docs).encode()) + [EOD]
      out[s, r], rest[r] = rest[r][:SEQ + 1], rest[r][SEQ + 1:]
  return out


def test_rows_pack_the_train_documents_in_stream_order(dataset):
  path, order = dataset
  train, val = _split(order)
  assert val and len(train) > 300
  it = data.make_train_iterator(_cfg(path), SEQ, 4, seed=0)
  batches = np.stack([next(it) for _ in range(60)])
  assert batches.dtype == np.int32
  np.testing.assert_array_equal(batches, _expected_rows(train, 4, 60))
  rows = [_row_docs(batches, r) for r in range(4)]
  assert all(d in train for r in rows for d in r[1:])   # whole train documents, no validation


def test_resume_is_exact_also_across_an_epoch(dataset):
  path, order = dataset
  cfg = _cfg(path, shuffle_windows=2)
  it = data.make_train_iterator(cfg, SEQ, 4, seed=0)
  tokens_per_epoch = sum(len(t.encode()) + 1 for t in _split(order)[0])
  steps = tokens_per_epoch // (4 * (SEQ + 1))   # about one epoch
  for _ in range(steps - 3):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(12)]   # runs past the epoch's end
  again = data.make_train_iterator(cfg, SEQ, 4, seed=0)
  again.set_state(state)
  np.testing.assert_array_equal(np.stack([next(again) for _ in range(12)]), np.stack(want))
  assert it.get_state() != state


def test_two_processes_read_disjoint_documents(dataset):
  path, order = dataset
  docs = []
  for p in range(2):
    it = data.make_train_iterator(_cfg(path), SEQ, 4, 0, p, 2)
    batches = [next(it) for _ in range(20)]
    docs.append({d for r in range(2) for d in _row_docs(batches, r)})
  assert docs[0] and docs[1] and not docs[0] & docs[1]


@pytest.mark.slow
def test_same_documents_as_prepare_and_eval_bytes(dataset, tmp_path):
  path, order = dataset
  out = str(tmp_path / 'shards')
  subprocess.run([sys.executable, '-m', 'sharenet.data.prepare', '--input', f'hf:{path}',
                  '--tokenizer', 'bytes', '--out', out], check=True, capture_output=True)
  train, val = _split(order)
  meta = arrayrecord.meta(out)
  assert meta['splits']['validation']['documents'] == len(val)
  assert meta['splits']['train']['documents'] == len(train)
  shard_val = arrayrecord.split_tokens(out, 'validation')
  cfg = _cfg(path, eval_tokens=10**6)
  tokens, num_bytes = hf_stream.validation(cfg)
  assert sorted(bytes(t) for t in np.split(tokens, np.flatnonzero(tokens == EOD)[:-1] + 1)) == \
      sorted(bytes(t) for t in np.split(shard_val, np.flatnonzero(shard_val == EOD)[:-1] + 1))
  assert num_bytes == sum(len(t.encode()) for t in val) == meta['splits']['validation']['bytes']
  assert data.bytes_per_token(cfg) == arrayrecord.bytes_per_token(out)
  assert data.num_eval_tokens(_cfg(path, eval_tokens=100)) == 100


def test_segment_mask_and_vocab(dataset):
  path, _ = dataset
  b = next(data.make_train_iterator(_cfg(path, segment_mask=True), SEQ, 4, seed=0))
  np.testing.assert_array_equal(b['segment_ids'], arrayrecord.segment_ids(b['tokens'], EOD))
  assert data.vocab_size(_cfg(path)) == 257
  data.validate_data_config(_cfg(path), SEQ, 4, 1, vocab_size=257)


def test_bad_hf_configs_are_one_line_each(dataset, tmp_path):
  path, _ = dataset
  cases = [
      (_cfg(path), dict(vocab_size=256), 'set --config.model.vocab_size=257'),
      (_cfg(path, eval_tokens=0), {}, 'data.eval_tokens > 0'),
      (_cfg(path, num_workers=2), {}, 'data.num_workers=2 with data.source=hf'),
      (_cfg(path, text_field='body'), {}, r"no column 'body' \(it has: text, id\)"),
      (_cfg(str(tmp_path / 'nothing')), {}, 'cannot load it'),
      ({'source': 'hf', 'eval_tokens': 10}, {}, 'data.path is empty'),
      (_cfg(path, tokenizer='sentencepiece:/no/such.model'), {}, 'data.tokenizer'),
  ]
  for cfg, kw, match in cases:
    with pytest.raises(ConfigError, match=match) as e:
      data.validate_data_config(cfg, SEQ, 4, 1, **kw)
    assert '\n' not in str(e.value)
  with pytest.raises(ConfigError, match='not loaded whole'):
    data.load_splits(_cfg(path))
  bad = tmp_path / 'bad'
  bad.mkdir()
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({'text': [f'fine {i}' for i in range(50)] + [None] * 3}),
                 bad / 'p.parquet')
  it = data.make_train_iterator(_cfg(str(bad)), 4, 2, seed=0)
  with pytest.raises(ConfigError, match=r"row 50: .* holds NoneType, not text") as e:
    for _ in range(200):
      next(it)
  assert '\n' not in str(e.value)


@pytest.mark.slow
def test_train_on_hf_resumes_after_kill_bit_identically(dataset, tmp_path, losses, tiny_config,
                                                        train_cmd, subprocess_env):
  """train.py on data.source=hf killed (-9) after its step-8 checkpoint and resumed: steps
  9-16 give the uninterrupted run's losses bit for bit."""
  from sharenet.train import loop
  path, _ = dataset
  overrides = {'data.source': 'hf', 'data.path': path, 'model.vocab_size': 257,
               'train.steps': 16, 'train.checkpoint_every': 8, 'train.seq_len': SEQ}
  flags = [f'--config.{k}={v}' for k, v in overrides.items()]
  ref_dir, workdir = str(tmp_path / 'ref'), str(tmp_path / 'killed')
  loop.train_and_evaluate(tiny_config(**overrides), ref_dir)
  kill_after_checkpoint(train_cmd(workdir, *flags), subprocess_env, workdir, 8)
  out = subprocess.run(train_cmd(workdir, *flags), env=subprocess_env, check=True,
                       capture_output=True, text=True)
  assert 'resumed from checkpoint at step 8' in out.stdout
  ref, resumed = losses(ref_dir), losses(workdir)
  assert len(ref) == 16
  assert [resumed[s] for s in range(9, 17)] == [ref[s] for s in range(9, 17)]


def test_a_stream_of_validation_documents_only_is_one_line(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  texts = [t for t in _texts(2000) if corpus.text_fraction(t) < hf_stream.VAL_FRACTION][:3]
  root = tmp_path / 'val_only'
  root.mkdir()
  pq.write_table(pa.table({'text': texts}), root / 'p.parquet')
  it = data.make_train_iterator(_cfg(str(root)), 4, 2, seed=0)
  with pytest.raises(ConfigError, match=r'reads no train documents \(3 read, all validation\)'):
    next(it)
