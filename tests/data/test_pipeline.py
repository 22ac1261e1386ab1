"""Tests for sharenet.data: corpora, the grain training stream, eval batches, validation."""
import itertools
import os

import ml_collections
import numpy as np
import pytest

from sharenet import data
from sharenet.data import corpus
from sharenet.errors import ConfigError

STDLIB = ml_collections.ConfigDict({'source': 'stdlib', 'path': '', 'num_workers': 0})


def _cfg(source, path, **kw):
  return ml_collections.ConfigDict({'source': source, 'path': str(path), **kw})


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b):
  return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _write_bin(path, tokens):
  np.asarray(tokens, np.uint16).tofile(path)
  return path


def _name(val, suffix='.txt'):
  names = (f'f{i}{suffix}' for i in itertools.count())
  return next(n for n in names if corpus.is_val_path(n) == val)


def test_stdlib_corpus_split():
  root, files = corpus.stdlib_files()
  assert len(files) > 1000 and files == sorted(files) and files == corpus.stdlib_files()[1]
  assert not any('site-packages' in f.split(os.sep) for f in files)
  sizes = {f: os.path.getsize(os.path.join(root, f)) for f in files}
  val_files = {f for f in files if corpus.is_val_file(f)}
  train, val = data.load_splits(STDLIB)
  assert train.dtype == val.dtype == np.uint8
  assert len(val) == sum(sizes[f] for f in val_files)
  assert len(train) == sum(sizes[f] for f in files if f not in val_files)
  assert 0.005 < len(val) / (len(train) + len(val)) < 0.02
  assert data.load_splits(STDLIB) is data.load_splits(STDLIB)  # cached
  first_val = min(val_files)
  with open(os.path.join(root, first_val), 'rb') as f:
    assert f.read() == val[:sizes[first_val]].tobytes()
  assert data.bytes_per_token(STDLIB) == 1.0 and data.vocab_size(STDLIB) == 256


def test_unigram_bits_per_byte():
  assert 4.5 < data.unigram_bits_per_byte(STDLIB) < 5.0


def test_train_windows_are_contiguous_slices():
  seq_len, batch = 64, 4
  train = data.load_splits(STDLIB)[0]
  buf = train.tobytes()
  it = data.make_train_iterator(STDLIB, seq_len, batch, seed=0)
  for tokens in _take(it, 3):
    assert tokens.shape == (batch, seq_len + 1) and tokens.dtype == np.int32
    for row in tokens:
      needle, p = row.astype(np.uint8).tobytes(), -1
      while True:  # some occurrence of the row must start on a window boundary
        p = buf.find(needle, p + 1)
        assert p >= 0
        if p % seq_len == 0:
          break


def test_bin_windows_cover_epoch_and_reshuffle(tmp_path):
  seq_len, batch, num_windows = 8, 4, 12
  path = _write_bin(tmp_path / 'train.bin', np.arange(seq_len * num_windows + 1))
  _write_bin(tmp_path / 'val.bin', np.arange(50))
  cfg = _cfg('bin', path)
  assert data.bytes_per_token(cfg) is None
  it = data.make_train_iterator(cfg, seq_len, batch, seed=3)
  epochs = [np.concatenate(_take(it, num_windows // batch)) for _ in range(2)]
  for rows in epochs:
    np.testing.assert_array_equal(rows, rows[:, :1] + np.arange(seq_len + 1))
    assert sorted(rows[:, 0]) == list(range(0, seq_len * num_windows, seq_len))
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled every epoch


def test_seeds_and_get_set_state():
  args = (STDLIB, 32, 4)
  a = _take(data.make_train_iterator(*args, seed=0), 4)
  assert _same(a, _take(data.make_train_iterator(*args, seed=0), 4))
  assert not _same(a, _take(data.make_train_iterator(*args, seed=1), 4))
  assert _same(a, _take(data.make_train_iterator(_cfg('stdlib', '', seed=0), *args[1:], seed=1), 4))
  it = data.make_train_iterator(*args, seed=0)
  _take(it, 2)
  state = it.get_state()
  expected = _take(it, 3)
  fresh = data.make_train_iterator(*args, seed=0)
  fresh.set_state(state)
  assert _same(expected, _take(fresh, 3))


def test_multi_process_shards_form_global_batch():
  args = (STDLIB, 16, 8)
  full = _take(data.make_train_iterator(*args, seed=2), 3)
  parts = [_take(data.make_train_iterator(*args, seed=2, process_index=p, process_count=2), 3)
           for p in range(2)]
  for step, global_batch in enumerate(full):
    assert parts[0][step].shape == (4, 17)
    np.testing.assert_array_equal(np.concatenate([parts[0][step], parts[1][step]]),
                                  global_batch)


@pytest.mark.parametrize('seq_len,batch', [(256, 8), (100, 3)])
def test_eval_batches_predict_every_val_token_once(seq_len, batch):
  val = data.load_splits(STDLIB)[1]
  batches = list(data.eval_batches(STDLIB, seq_len, batch))
  assert len(batches) == data.num_eval_batches(STDLIB, seq_len, batch)
  for tokens, mask in batches:
    assert tokens.shape == (batch, seq_len + 1) and tokens.dtype == np.int32
    assert mask.shape == (batch, seq_len) and mask.dtype == np.float32
  assert sum(m.sum() for _, m in batches) == data.num_eval_tokens(STDLIB) == len(val) - 1
  targets = np.concatenate([t[:, 1:][m > 0] for t, m in batches])
  np.testing.assert_array_equal(targets, val[1:])
  inputs = np.concatenate([t[:, :-1][m > 0] for t, m in batches])
  np.testing.assert_array_equal(inputs, val[:-1])
  sharded = [list(data.eval_batches(STDLIB, seq_len, 4, process_index=p, process_count=2))
             for p in range(2)]
  assert sum(m.sum() for part in sharded for _, m in part) == len(val) - 1


def test_eval_tokens_evaluates_a_prefix_of_validation():
  """data.eval_tokens=n: the first n validation targets, once each, in the same windows."""
  val = data.load_splits(STDLIB)[1]
  cfg = dict(STDLIB, eval_tokens=1000)
  batches = list(data.eval_batches(cfg, 100, 3))
  assert len(batches) == data.num_eval_batches(cfg, 100, 3) == 4
  assert sum(m.sum() for _, m in batches) == data.num_eval_tokens(cfg) == 1000
  targets = np.concatenate([t[:, 1:][m > 0] for t, m in batches])
  np.testing.assert_array_equal(targets, val[1:1001])
  full = next(iter(data.eval_batches(STDLIB, 100, 3)))
  np.testing.assert_array_equal(batches[0][0], full[0])
  _one_line_error('data.eval_tokens=-1 must be >= 0', data.validate_data_config,
                  dict(STDLIB, eval_tokens=-1), 16, 4)


def _one_line_error(match, fn, *args, **kw):
  with pytest.raises(ConfigError, match=match) as e:
    fn(*args, **kw)
  assert '\n' not in str(e.value)
  return str(e.value)


def test_config_errors(tmp_path):
  validate = data.validate_data_config
  msg = _one_line_error('data.source', validate, _cfg('parquet', ''), 64, 8)
  assert 'stdlib, text, bin' in msg
  _one_line_error('data.path.*matches no files', validate, _cfg('text', tmp_path / '*.txt'), 64, 8)
  (tmp_path / 'empty.txt').write_bytes(b'')
  _one_line_error('data.path.*only empty files', validate, _cfg('text', tmp_path / '*.txt'), 64, 8)
  _one_line_error('train.batch_size.*process_count=3', validate, STDLIB, 64, 8, process_count=3)
  (tmp_path / 'a.txt').write_bytes(b'x' * 1000)  # tail split: 990 train, 10 val bytes
  cfg = _cfg('text', tmp_path / '*.txt')
  validate(cfg, 9, 8)
  assert '10 validation tokens' in _one_line_error('train.seq_len', validate, cfg, 10, 8)
  assert '990 train tokens' in _one_line_error('train.seq_len', validate, cfg, 990, 8)
  _one_line_error('vocab_size', validate, STDLIB, 64, 8, vocab_size=100)


def test_text_source_splits_by_file(tmp_path):
  val_name, train_name = _name(True), _name(False)
  (tmp_path / 'sub').mkdir()
  (tmp_path / 'sub' / val_name).write_bytes(b'val text\n' * 20)
  (tmp_path / 'sub' / train_name).write_bytes(b'train text\n' * 20)
  (tmp_path / 'sub' / 'zz.md').write_bytes(b'not matched')
  cfg = _cfg('text', tmp_path / 'sub' / '*.txt')
  train, val = data.load_splits(cfg)
  assert train.tobytes() == b'train text\n' * 20 and val.tobytes() == b'val text\n' * 20
  data.validate_data_config(cfg, 16, 2, vocab_size=256)
  tokens = next(data.make_train_iterator(cfg, 16, 2, seed=0))
  assert tokens.shape == (2, 17) and tokens.dtype == np.int32


def test_text_single_file_tail_split(tmp_path):
  text = bytes(range(256)) * 4
  (tmp_path / _name(True)).write_bytes(text)  # a lone file is split by bytes, not by hash
  train, val = data.load_splits(_cfg('text', tmp_path / '*.txt'))
  assert train.tobytes() + val.tobytes() == text and len(val) == len(text) // 100


def test_bin_sources(tmp_path):
  tokens = np.arange(3000) % 1000
  single = _write_bin(tmp_path / 'tokens.bin', tokens)
  train, val = data.load_splits(_cfg('bin', single))
  assert train.dtype == np.uint16 and len(val) == 30
  np.testing.assert_array_equal(np.concatenate([train, val]), tokens)
  paired = _write_bin(tmp_path / 'shard_train.bin', tokens)
  _write_bin(tmp_path / 'shard_val.bin', tokens[:100] + 7)
  cfg = _cfg('bin', paired)
  train, val = data.load_splits(cfg)
  assert len(train) == 3000 and val[0] == 7
  data.validate_data_config(cfg, 64, 4, vocab_size=1000)
  assert 'id 999' in _one_line_error('vocab_size=999', data.validate_data_config, cfg, 64, 4,
                                        vocab_size=999)
  assert data.unigram_bits_per_byte(cfg) > 0
  rows = next(data.make_train_iterator(cfg, 64, 4, seed=0))
  assert rows.shape == (4, 65) and np.all(np.diff(rows, axis=1) % 1000 == 1)
