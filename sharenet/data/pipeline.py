"""Training stream (grain), evaluation batches and up-front config validation.

This docstring describes the in-memory sources (stdlib, text, bin). `data.source=arrayrecord`
streams packed documents instead (sharenet/data/arrayrecord.py) and differs in four ways:
windows do not overlap (each token is in exactly one window per epoch), and each batch row is
its own packed stream over every B-th document of the process's slice; each process reads and
packs only its own record slice, slice p of P for the processes holding batch rows
[p*B/P, (p+1)*B/P) (`sharding.process_rows`), so the global batch, the processes' batches
concatenated in process order, depends on the process count (a run resumes only with the same
one, as grain's per-process checkpoints already require); with `data.num_workers` > 0 each worker
packs its own sub-slice, so the stream is another one than with 0 workers; and with
`data.segment_mask` a batch is {'tokens', 'segment_ids'} instead of one array. Evaluation and
checkpointing are the same.

Training: the train split is cut into `(len - 1) // seq_len` windows of `seq_len + 1` tokens
with stride `seq_len` (window i = tokens[i*L : i*L + L + 1]), so inputs `w[:, :-1]` and targets
`w[:, 1:]` tile the split contiguously. Window indices are shuffled with `seed` (reshuffled every
epoch by grain's `repeat`) and repeated forever; epochs run into each other without a gap.

Multi-host rule: global batch s is stream elements [s*B, (s+1)*B) for global `batch_size` B,
the same for every process_count. Process p yields rows [p*B/P, (p+1)*B/P) of it, so
concatenating the processes' batches in process order gives the process_count=1 batch. Each
process reads only its own rows.

`data.num_workers` > 0 adds grain worker processes (`mp_prefetch`). The stream is identical,
but the state has another shape, so a checkpoint restores only with the same num_workers;
absl flags must be parsed (`app.run`) and `it.close()` should be called at exit. Rarely worth
it: a batch is one gather from a memory-resident array.

Checkpointing: the iterator is a `grain.DatasetIterator`; `get_state()` returns a small
JSON-able dict and `set_state(state)` resumes the exact stream. With an orbax
`CheckpointManager` (orbax-checkpoint 0.12.8), pass the iterator itself in a Composite:

  mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(train_state),
      data=grain.checkpoint.CheckpointSave(it)))           # = checkpoint_save_args(it)
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      data=grain.checkpoint.CheckpointRestore(it)))        # = checkpoint_restore_args(it)

Restore mutates `it` in place (and also returns it as `restored.data`). Grain writes one JSON
file per process, `data/process_{i}-of-{n}.json`, using `jax.process_index()`, so each host
saves and restores its own position; restoring needs the same process_count.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import grain
import numpy as np

from sharenet.data import arrayrecord, corpus, hf_stream, mixture
from sharenet.errors import ConfigError


def _seed(data_cfg: Any, seed: int) -> int:
  data_seed = corpus.get_field(data_cfg, 'seed')
  # None or a negative data.seed means 'use train.seed'; grain wants uint32 seeds.
  return (seed if data_seed is None or data_seed < 0 else data_seed) % 2**32


class _Windows(grain.transforms.Map):
  """Maps a batch of window indices to int32 token windows of shape (B, seq_len + 1)."""

  def __init__(self, data_cfg: Any, seq_len: int):
    source, path = corpus.source_and_path(data_cfg)
    self._cfg = {'source': source, 'path': path,
                 'bin_dtype': corpus.get_field(data_cfg, 'bin_dtype')}
    self._seq_len, self._tokens = seq_len, None

  def __getstate__(self) -> dict[str, Any]:
    # Worker processes reload (cached) instead of pickling the corpus or a memmap's contents.
    return {**self.__dict__, '_tokens': None}

  def map(self, element: np.ndarray) -> np.ndarray:
    if self._tokens is None:
      self._tokens = corpus.load_splits(self._cfg)[0]
    offsets = np.asarray(element)[:, None] * self._seq_len + np.arange(self._seq_len + 1)
    return np.asarray(self._tokens[offsets], dtype=np.int32)


def make_train_iterator(data_cfg: Any, seq_len: int, batch_size: int, seed: int,
                        process_index: int = 0,
                        process_count: int = 1) -> grain.DatasetIterator:
  """Infinite, checkpointable iterator of int32 (batch_size // process_count, seq_len + 1)
  (with arrayrecord and data.segment_mask, a dict of such 'tokens' and 'segment_ids')."""
  if batch_size % process_count:
    raise ConfigError(f'train.batch_size={batch_size} is not divisible by '
                      f'process_count={process_count}')
  source, path = corpus.source_and_path(data_cfg)
  _check_segment_mask(data_cfg, source)
  spec = corpus.get_field(data_cfg, 'mixture')
  if spec:
    it_ds = mixture.train_dataset(_mixture(data_cfg, seed), seq_len, batch_size,
                                  _seed(data_cfg, seed), process_index, process_count,
                                  corpus.get_field(data_cfg, 'segment_mask'),
                                  corpus.get_field(data_cfg, 'shuffle_windows') or 0)
  elif source == 'hf':
    it_ds = hf_stream.train_dataset(data_cfg, seq_len, batch_size // process_count,
                                    _seed(data_cfg, seed), process_index, process_count,
                                    corpus.get_field(data_cfg, 'segment_mask'),
                                    corpus.get_field(data_cfg, 'shuffle_windows') or 0)
  elif source == 'arrayrecord':
    it_ds = arrayrecord.train_dataset(path, seq_len, batch_size // process_count,
                                      _seed(data_cfg, seed), process_index, process_count,
                                      corpus.get_field(data_cfg, 'segment_mask'),
                                      corpus.get_field(data_cfg, 'shuffle_windows') or 0)
  else:
    num_windows = (len(corpus.load_splits(data_cfg)[0]) - 1) // seq_len
    ds = (grain.MapDataset.range(num_windows)
          .shuffle(seed=_seed(data_cfg, seed))
          .repeat()
          .batch(batch_size // process_count, drop_remainder=True)
          [process_index::process_count]
          .map(_Windows(data_cfg, seq_len)))
    # Data is in memory (or mmapped) and gathering is cheap: reading threads only add GIL churn.
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  num_workers = corpus.get_field(data_cfg, 'num_workers')
  if num_workers > 0:
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return iter(it_ds)


def _mixture(data_cfg: Any, seed: int) -> mixture.Mixture:
  return mixture.parse(corpus.get_field(data_cfg, 'mixture'),
                       corpus.get_field(data_cfg, 'mixture_schedule') or '', _seed(data_cfg, seed))


def mixture_of(data_cfg: Any, seed: int) -> mixture.Mixture | None:
  """The run's data.mixture (parsed and checked; `seed` is train.seed), or None without one."""
  corpus.source_and_path(data_cfg)   # a mixture beside data.path or another source: one line
  return _mixture(data_cfg, seed) if corpus.get_field(data_cfg, 'mixture') else None


def eval_sources(data_cfg: Any) -> list[tuple[str | None, float, Any]]:
  """What evaluation reads: [(None, 1.0, data_cfg)], or with data.mixture one
  (name, data.mixture weight, that directory's data config) per source."""
  mix = mixture_of(data_cfg, 0)
  if mix is None:
    return [(None, 1.0, data_cfg)]
  return [(s.name, s.weight, corpus.with_fields(data_cfg, path=s.path, mixture='',
                                                mixture_schedule=''))
          for s in mix.sources]


def checkpoint_save_args(it: grain.DatasetIterator) -> Any:
  """Orbax args saving the iterator's position (an item of `ocp.args.Composite`)."""
  return grain.checkpoint.CheckpointSave(it)


def checkpoint_restore_args(it: grain.DatasetIterator) -> Any:
  """Orbax args restoring the iterator's position into `it` in place."""
  return grain.checkpoint.CheckpointRestore(it)


DOCUMENT_SOURCES = ('arrayrecord', 'hf')   # packed documents, not one token stream


def _check_segment_mask(data_cfg: Any, source: str) -> None:
  if corpus.get_field(data_cfg, 'segment_mask') and source not in DOCUMENT_SOURCES:
    raise ConfigError(f'data.segment_mask=True needs documents (data.source=arrayrecord or hf); '
                      f'data.source={source!r} is one token stream')
  shuffle = corpus.get_field(data_cfg, 'shuffle_windows') or 0
  if shuffle < 0 or shuffle and source not in DOCUMENT_SOURCES:
    raise ConfigError(f'data.shuffle_windows={shuffle}: valid: 0 (off), or a number of packed '
                      f'windows >= 1 with data.source=arrayrecord or hf (data.source={source!r} '
                      f'already samples its windows uniformly)')


def _eod_id(data_cfg: Any) -> int:
  source, path = corpus.source_and_path(data_cfg)
  return corpus.for_data(data_cfg).eod_id if source == 'hf' else arrayrecord.meta(path)['eod_id']


def has_loss_mask(data_cfg: Any) -> bool:
  """Whether the run's batches carry a loss mask (shards of fine-tuning pairs)."""
  source, path = corpus.source_and_path(data_cfg)
  return source == 'arrayrecord' and arrayrecord.has_loss_mask(path)


def bytes_per_token(data_cfg: Any) -> float | None:
  """corpus.bytes_per_token, and for data.source=hf its evaluated validation documents' (UTF-8
  bytes / tokens, sharenet/data/hf_stream.py)."""
  if corpus.source_and_path(data_cfg)[0] == 'hf':
    return hf_stream.bytes_per_token(data_cfg)
  return corpus.bytes_per_token(data_cfg)


def _val_tokens(data_cfg: Any) -> np.ndarray:
  """The evaluated validation tokens as one array (arrayrecord: its documents in record order):
  the whole split, or its first data.eval_tokens + 1 (that many predicted)."""
  source, path = corpus.source_and_path(data_cfg)
  if corpus.get_field(data_cfg, 'mixture'):
    raise ConfigError('data.mixture has one validation split per source; evaluate each '
                      '(pipeline.eval_sources)')
  if source == 'arrayrecord':
    val = arrayrecord.split_tokens(path, 'validation')
  elif source == 'hf':
    val = hf_stream.validation(data_cfg)[0]
  else:
    val = corpus.load_splits(data_cfg)[1]
  limit = corpus.get_field(data_cfg, 'eval_tokens') or 0
  return val[:limit + 1] if limit > 0 else val


def num_eval_tokens(data_cfg: Any) -> int:
  """Number of predicted validation tokens: all but the split's first token."""
  return len(_val_tokens(data_cfg)) - 1


def num_eval_batches(data_cfg: Any, seq_len: int, batch_size: int) -> int:
  """Number of batches `eval_batches` yields."""
  return math.ceil(math.ceil(num_eval_tokens(data_cfg) / seq_len) / batch_size)


def eval_batches(data_cfg: Any, seq_len: int, batch_size: int, process_index: int = 0,
                 process_count: int = 1) -> Iterator[tuple[Any, np.ndarray]]:
  """Yields (tokens (B, seq_len+1) int32, mask (B, seq_len) float32) covering validation once.

  arrayrecord: the validation documents concatenated in record order (unshuffled, each ending
  in the end-of-document id) are that token array; with data.segment_mask the first item is
  {'tokens', 'segment_ids'} (arrayrecord.segment_ids of each window, as in training).

  Windows use stride seq_len, so window j predicts val[j*L+1 : j*L+L+1] and only val[0] is
  never a target: mask.sum() over all batches == num_eval_tokens. The last window is
  zero-padded and the last batch filled with all-masked rows, so every batch has full shape
  (one compilation). With process_count > 1 each process gets its rows of every global batch
  (same rule as training) and the masks of all processes sum to num_eval_tokens.
  """
  if batch_size % process_count:
    raise ConfigError(f'eval batch_size={batch_size} is not divisible by '
                      f'process_count={process_count}')
  val = _val_tokens(data_cfg)
  source, path = corpus.source_and_path(data_cfg)
  _check_segment_mask(data_cfg, source)
  eod_id = _eod_id(data_cfg) if corpus.get_field(data_cfg, 'segment_mask') else None
  masked = source == 'arrayrecord' and arrayrecord.has_loss_mask(path)
  local = batch_size // process_count
  span = np.arange(seq_len + 1)
  for b in range(num_eval_batches(data_cfg, seq_len, batch_size)):
    rows = b * batch_size + process_index * local + np.arange(local)
    pos = rows[:, None] * seq_len + span
    valid = pos < len(val)
    ids = np.where(valid, val[np.minimum(pos, len(val) - 1)], 0)
    counted = valid
    if masked:   # only the tokens the loss counts (sharenet/data/arrayrecord.py, "Loss mask")
      ids, loss = arrayrecord.split_loss_bit(ids)
      counted = valid & (loss > 0)
    tokens = ids.astype(np.int32)
    mask = counted[:, 1:].astype(np.float32)
    if eod_id is None:
      yield tokens, mask
    else:
      yield {'tokens': tokens, 'segment_ids': arrayrecord.segment_ids(tokens, eod_id)}, mask


def validate_data_config(data_cfg: Any, seq_len: int, batch_size: int, process_count: int = 1,
                         vocab_size: int | None = None) -> None:
  """Raises ConfigError (one line naming the field) before anything is compiled.

  `vocab_size` (the model's) is optional: byte sources need >= 256; for `bin` the largest
  token id in a strided ~4M-token sample of each split (all of it below 8M) must be below it;
  for arrayrecord it must equal meta.json's vocab_size.
  """
  source, path = corpus.source_and_path(data_cfg)
  if batch_size <= 0 or batch_size % process_count:
    raise ConfigError(f'train.batch_size={batch_size} must be a positive multiple of '
                      f'process_count={process_count}')
  if seq_len <= 0:
    raise ConfigError(f'train.seq_len={seq_len} must be positive')
  num_workers = corpus.get_field(data_cfg, 'num_workers')
  if num_workers is not None and num_workers < 0:
    raise ConfigError(f'data.num_workers={num_workers} must be >= 0')
  eval_tokens = corpus.get_field(data_cfg, 'eval_tokens')
  if eval_tokens is not None and eval_tokens < 0:
    raise ConfigError(f'data.eval_tokens={eval_tokens} must be >= 0 (0: the whole validation '
                      f'split)')
  _check_segment_mask(data_cfg, source)
  mix = mixture_of(data_cfg, 0)
  for p in [s.path for s in mix.sources] if mix else [path] if source == 'arrayrecord' else []:
    try:
      _validate_arrayrecord(p, seq_len, process_count, vocab_size)
    except ConfigError as e:
      raise ConfigError(f'data.mixture source {p!r}: {e}' if mix else str(e)) from None
  corpus.data_spec(data_cfg)   # data.tokenizer must agree with the data
  if source == 'hf':
    _validate_hf(data_cfg, seq_len, vocab_size)
  if source in DOCUMENT_SOURCES:
    return
  if source == 'bin':
    corpus.bin_dtype(data_cfg)
  for name, tokens in zip(('train', 'validation'), corpus.load_splits(data_cfg)):
    if seq_len + 1 > len(tokens):
      raise ConfigError(f'train.seq_len={seq_len} is too long: seq_len + 1 exceeds the '
                        f'{len(tokens)} {name} tokens of data.source={source!r} '
                        f'data.path={path!r}; use train.seq_len <= {len(tokens) - 1}')
    if vocab_size is not None:
      top = corpus.max_token(tokens) if source == 'bin' else corpus.BYTE_VOCAB - 1
      if top >= vocab_size:
        raise ConfigError(f'vocab_size={vocab_size} is too small: {name} tokens of '
                          f'data.source={source!r} reach id {top}; need vocab_size > {top}')


def _validate_arrayrecord(path: str, seq_len: int, process_count: int,
                          vocab_size: int | None) -> None:
  """meta.json's vocab equals the model's; every process has documents; validation fits a window."""
  meta = arrayrecord.meta(path)
  if vocab_size is not None and vocab_size != meta['vocab_size']:
    raise ConfigError(f'model.vocab_size={vocab_size} does not match vocab_size='
                      f'{meta["vocab_size"]} of data.path={path!r} (meta.json); set '
                      f'--config.model.vocab_size={meta["vocab_size"]}')
  train, val = meta['splits']['train'], meta['splits']['validation']
  if train['documents'] < process_count:
    raise ConfigError(f'data.path={path!r} has {train["documents"]} train documents, fewer than '
                      f'the {process_count} processes that each read a slice of them')
  if seq_len + 1 > val['tokens']:
    raise ConfigError(f'train.seq_len={seq_len} is too long: seq_len + 1 exceeds the '
                      f'{val["tokens"]} validation tokens of data.path={path!r}; use '
                      f'train.seq_len <= {val["tokens"] - 1}')


def _validate_hf(data_cfg: Any, seq_len: int, vocab_size: int | None) -> None:
  """No worker processes; the tokenizer's vocab is the model's; validation fits a window."""
  workers = corpus.get_field(data_cfg, 'num_workers')
  if workers:
    raise ConfigError(f'data.num_workers={workers} with data.source=hf; valid: 0 (the stream '
                      f'is read and tokenized in process)')
  tok = corpus.for_data(data_cfg)
  if vocab_size is not None and vocab_size != tok.vocab_size:
    raise ConfigError(f'model.vocab_size={vocab_size} does not match data.tokenizer='
                      f'{tok.spec!r} (vocab_size={tok.vocab_size}, end-of-document id '
                      f'included); set --config.model.vocab_size={tok.vocab_size}')
  val = _val_tokens(data_cfg)
  if seq_len + 1 > len(val):
    raise ConfigError(f'train.seq_len={seq_len} is too long: seq_len + 1 exceeds the '
                      f'{len(val)} validation tokens of data.path={corpus.get_field(data_cfg, "path")!r}'
                      f' (data.source=hf); use train.seq_len <= {len(val) - 1}')
