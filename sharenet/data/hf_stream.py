"""`data.source=hf`: train straight from a streamed Hugging Face dataset, no prepare step.

`data.path` is NAME[:CONFIG], a hub name or a local dataset directory (parquet, JSON lines or
Arrow files, read by `datasets.load_dataset(..., streaming=True)`), of which the `train` split is
read; `data.text_field` names the text column; `data.tokenizer` tokenizes on the fly (`auto`:
bytes; `hf:PATH` or `sentencepiece:PATH` as for prepare). Each document is its tokens followed by
the tokenizer's end-of-document id, as prepare writes it; `model.vocab_size` must equal the
tokenizer's.

Splits: a document is validation iff `corpus.text_fraction(text) < VAL_FRACTION`, prepare's rule
at its default --val_fraction, so this source and `prepare --input hf:NAME` put the same
documents in validation. Training skips them. Evaluation reads the stream from its start and
keeps validation documents until it holds `data.eval_tokens` + 1 tokens (required > 0: the
whole split of a hub dataset is a pass over all of it); their UTF-8 bytes / tokens is the bytes
per token of bits per byte.

Training stream: each process reads its part of the dataset (`split_dataset_by_node`: whole
source shards when they divide evenly among the processes, else every P-th document). Its
`local_batch` rows each pack their own documents into `seq_len + 1`-token windows without
overlap (as arrayrecord's rows): row by row, a row whose document ran out takes the stream's next
one, so a batch holds B different documents. Epochs follow each other in the dataset's order.
`data.shuffle_windows=K` shuffles blocks of K batches' windows (K windows of memory per row, as
for arrayrecord), across rows as well.

Resume: the iterator's state is the dataset's `state_dict()` (its position in the stream, which
`datasets` restores exactly), the epoch, and each row's unread rest of its current document
(base64 uint32), so a checkpointed run continues the exact token stream.
"""
from __future__ import annotations

import base64
import functools
from typing import Any

import grain
import numpy as np

from sharenet.data import arrayrecord, corpus, records, tokenizer
from sharenet.errors import ConfigError

VAL_FRACTION = corpus.TEXT_VAL_FRACTION   # prepare's default --val_fraction
SPLIT = 'train'


def tokenizer_spec(data_cfg: Any) -> str:
  """data.tokenizer of an hf source (`auto` is bytes; corpus.data_spec)."""
  return corpus.data_spec(data_cfg)[0]


def _open(path: str, process_index: int, process_count: int) -> Any:
  ds = records.load_stream(path, SPLIT, f'data.path={path!r} (data.source=hf)')
  if process_count > 1:
    from datasets.distributed import split_dataset_by_node
    ds = split_dataset_by_node(ds, rank=process_index, world_size=process_count)
  return ds


class _Documents:
  """The process's training documents as token arrays (EOD appended), epoch after epoch."""

  def __init__(self, path: str, field: str, tok: tokenizer.Tokenizer, process_index: int,
               process_count: int):
    self._path, self._field, self._tok = path, field, tok
    self._node = (process_index, process_count)
    self.epoch, self._ds, self._it, self._read, self._kept = 0, None, None, 0, 0

  def _start(self, hf_state: dict[str, Any] | None = None) -> None:
    # A fresh dataset object per epoch and per restore: one that loaded a state restarts there.
    self._ds = _open(self._path, *self._node)
    self._ds.set_epoch(self.epoch)
    if hf_state is not None:
      self._ds.load_state_dict(hf_state)
    self._it, self._read, self._kept = iter(self._ds), 0, 0

  def next(self) -> np.ndarray:
    while True:
      if self._it is None:
        self._start()
      try:
        row = next(self._it)
      except StopIteration:
        if self._kept == 0:   # a whole epoch without a train document: none will come
          raise ConfigError(f'data.path={self._path!r} (data.source=hf): process '
                            f'{self._node[0]} of {self._node[1]} reads no train documents '
                            f'({self._read} read, all validation); valid: a dataset with '
                            f'train documents for every process') from None
        self.epoch, self._it = self.epoch + 1, None
        continue
      text = records.text_of(row, self._field, f'data.path={self._path!r}', self._read)
      self._read += 1
      if corpus.text_fraction(text) >= VAL_FRACTION:
        self._kept += 1
        return np.append(self._tok.encode(text), np.uint32(self._tok.eod_id))

  def get_state(self) -> dict[str, Any]:
    return {'epoch': self.epoch, 'read': self._read, 'kept': self._kept,
            'hf': None if self._it is None else self._ds.state_dict()}

  def set_state(self, state: dict[str, Any]) -> None:
    self.epoch, self._it = int(state['epoch']), None
    if state['hf'] is not None:
      self._start(state['hf'])
      self._read, self._kept = int(state['read']), int(state['kept'])


def _encode_rest(tokens: np.ndarray) -> str:
  return base64.b64encode(np.asarray(tokens, arrayrecord.DTYPE).tobytes()).decode('ascii')


def _decode_rest(text: str) -> np.ndarray:
  return np.frombuffer(base64.b64decode(text), arrayrecord.DTYPE).copy()


class _WindowIterator(grain.DatasetIterator):
  """Windows of `local_batch` packed rows, emitted row after row (row 0 of step 0, row 1, ...)."""

  def __init__(self, docs: _Documents, local_batch: int, window: int):
    super().__init__()
    self._docs, self._window = docs, window
    self._rest = [np.zeros((0,), arrayrecord.DTYPE) for _ in range(local_batch)]
    self._row = 0

  def __next__(self) -> np.ndarray:
    out_W = np.empty((self._window,), arrayrecord.DTYPE)
    filled, rest = 0, self._rest[self._row]
    while filled < self._window:
      if not len(rest):
        rest = self._docs.next()
      n = min(self._window - filled, len(rest))
      out_W[filled:filled + n], rest = rest[:n], rest[n:]
      filled += n
    self._rest[self._row] = rest
    self._row = (self._row + 1) % len(self._rest)
    return out_W

  def get_state(self) -> dict[str, Any]:
    return {'docs': self._docs.get_state(), 'row': self._row,
            'rest': [_encode_rest(r) for r in self._rest]}

  def set_state(self, state: dict[str, Any]) -> None:
    self._docs.set_state(state['docs'])
    self._row = int(state['row'])
    self._rest = [_decode_rest(r) for r in state['rest']]


class _Windows(grain.IterDataset):
  def __init__(self, args: tuple[Any, ...], local_batch: int, window: int):
    super().__init__()
    self._args, self._local, self._window = args, local_batch, window

  def __iter__(self) -> _WindowIterator:
    return _WindowIterator(_Documents(*self._args), self._local, self._window)


def train_dataset(data_cfg: Any, seq_len: int, local_batch: int, seed: int,
                  process_index: int = 0, process_count: int = 1, segment_mask: bool = False,
                  shuffle_windows: int = 0) -> grain.IterDataset:
  """Endless batches (local_batch, seq_len + 1) of the process's rows (module doc)."""
  tok = tokenizer.load(tokenizer_spec(data_cfg), 'data.tokenizer')
  path = corpus.get_field(data_cfg, 'path')
  args = (path, corpus.get_field(data_cfg, 'text_field'), tok, process_index, process_count)
  windows = _Windows(args, local_batch, seq_len + 1)
  if shuffle_windows:
    windows = arrayrecord.ShuffleWindows(windows, shuffle_windows * local_batch, seed)
  batches = windows.batch(local_batch, drop_remainder=True)
  return arrayrecord.to_batches(batches, tok.eod_id if segment_mask else None)


@functools.lru_cache(maxsize=4)
def _validation(path: str, field: str, spec: str, limit: int) -> tuple[np.ndarray, int]:
  tok = tokenizer.load(spec, 'data.tokenizer')
  parts, tokens, num_bytes = [], 0, 0
  for i, row in enumerate(_open(path, 0, 1)):
    text = records.text_of(row, field, f'data.path={path!r}', i)
    if corpus.text_fraction(text) < VAL_FRACTION:
      parts.append(np.append(tok.encode(text), np.uint32(tok.eod_id)))
      tokens += len(parts[-1])
      num_bytes += len(text.encode('utf-8'))
      if tokens > limit:
        break
  if not parts:
    raise ConfigError(f'data.path={path!r} (data.source=hf) has no validation documents (a '
                      f'{VAL_FRACTION} hash fraction of them); valid: a dataset with more '
                      f'documents')
  return np.concatenate(parts), num_bytes


def validation(data_cfg: Any) -> tuple[np.ndarray, int]:
  """(the first validation documents' tokens, at least data.eval_tokens + 1 of them unless the
  split is smaller; their UTF-8 bytes)."""
  limit = corpus.get_field(data_cfg, 'eval_tokens') or 0
  if limit <= 0:
    raise ConfigError('data.source=hf evaluates the first data.eval_tokens validation tokens of '
                      'the stream; valid: data.eval_tokens > 0 (e.g. 1000000)')
  return _validation(corpus.get_field(data_cfg, 'path'),
                     corpus.get_field(data_cfg, 'text_field'), tokenizer_spec(data_cfg), limit)


def bytes_per_token(data_cfg: Any) -> float:
  """The evaluated validation documents' UTF-8 bytes / tokens (end-of-document ids included)."""
  tokens, num_bytes = validation(data_cfg)
  return num_bytes / len(tokens)
