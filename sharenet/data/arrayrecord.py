"""`data.source=arrayrecord`: tokenized documents in ArrayRecord shards, packed by grain.

Format (`sharenet-arrayrecord-v1`, written by `python -m sharenet.data.prepare`): `data.path` is a
directory holding `meta.json`

  {"format": "sharenet-arrayrecord-v1", "tokenizer": SPEC, "vocab_size": V, "eod_id": E,
   "dtype": "uint32", "splits": {"train": {"shards": [names], "documents": N, "tokens": T,
   "bytes": U}, "validation": {...}}}

and shards `{split}-{i:05d}-of-{n:05d}.array_record`. One record is one document: its token ids
followed by the end-of-document id E, little-endian uint32. `tokens` counts E; `bytes` counts the
UTF-8 bytes of the documents' text, so validation bytes / validation tokens is the bytes per
token that turns bits per token into bits per byte.

Training stream (`train_dataset`): the train records (all shards, in shard order, as one index
space) are sliced record-wise, process p of P taking records p, p + P, p + 2P, ...: the slices are
disjoint and together cover every record. Each of the process's B batch rows is its own packed
stream over the documents r, r + B, r + 2B, ... of that slice: the row shuffles its documents with
the data seed (reshuffled every epoch by grain's `repeat`), concatenates them (each already ends
in E) and cuts the token stream into windows of `seq_len + 1` tokens with no overlap. Every token
of a row's epoch is in exactly one of its windows, epochs run into each other without a gap or a
padded window, and a batch holds B different documents (one stream cut into consecutive
windows would fill a batch with consecutive windows of one long document: correlated rows and a
much worse model at equal steps). Packing documents into fixed-length rows this way is the standard
recipe (Raffel et al., "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", arXiv:1910.10683, section 3.1.2; Brown et al., "Language Models are Few-Shot
Learners", arXiv:2005.14165, section 2.3).

Loss mask (`meta.json` "loss_mask": true, written by `prepare --response_field`): fine-tuning
records are a prompt's ids, then a response's ids and the end-of-document id, these with the top
bit (`LOSS_BIT`) set: ids stay below 2^31, so the mask travels with its token through packing,
shuffling and resume unchanged. A batch is then {'tokens', 'loss_mask'} (the bit split off):
training and evaluation count a target only where its loss_mask is 1 (the mean over response
tokens), and the split's "bytes" and "loss_tokens" are the responses', so bits per byte is per
byte of what is predicted.

With `data.segment_mask=True` a window also carries segment ids, the index of the document each
token belongs to within the window (0, 1, ...; an end-of-document token belongs to the document
it ends), and attention does not cross them (sharenet/models/attention.py). Positions stay the
window's 0..T-1 (not document-relative).

The packing iterator's state is its parent's state before the current document plus the offset
into it, so `get_state` / `set_state` resume the exact token stream (and stay small).

Window shuffle (`data.shuffle_windows` = K > 0): a row's packed stream cuts long documents
into consecutive windows, so its next windows are mostly the same document and a short run
sees few documents. With K, each row reads K windows at a time and emits them in a permutation
drawn from (its seed, the block number): consecutive steps then see windows from anywhere in
K * (seq_len + 1) tokens of the row's stream (K at least the row's share of the corpus, in
windows, shuffles a whole epoch). It costs K windows of memory per row and a read of K windows
at a block's start; its state is the packing state at the block's start, the block number and
the position, so a resume reads the block again and continues exactly.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Sequence

import grain
import numpy as np

from sharenet.errors import ConfigError

FORMAT = 'sharenet-arrayrecord-v1'
SPLITS = ('train', 'validation')
DTYPE = np.dtype('<u4')
LOSS_BIT = np.uint32(1 << 31)   # loss-masked shards: set on the ids the loss counts
ID_MASK = np.uint32((1 << 31) - 1)


@functools.lru_cache(maxsize=8)
def _read_meta(path: str) -> dict[str, Any]:
  meta_path = os.path.join(path, 'meta.json')
  if not os.path.isfile(meta_path):
    raise ConfigError(f'data.path={path!r} has no meta.json; data.source=arrayrecord needs a '
                      f'directory written by `python -m sharenet.data.prepare`')
  with open(meta_path) as f:
    meta = json.load(f)
  if meta.get('format') != FORMAT:
    raise ConfigError(f'{meta_path} has format {meta.get("format")!r}; valid: {FORMAT!r}')
  if meta.get('dtype') != 'uint32':
    raise ConfigError(f'{meta_path} has dtype {meta.get("dtype")!r}; valid: \'uint32\'')
  for split in SPLITS:
    info = meta.get('splits', {}).get(split)
    if not info or not info.get('shards') or not info.get('documents'):
      raise ConfigError(f'{meta_path} lists no {split} documents; valid: a prepared directory '
                        f'with both splits ({", ".join(SPLITS)})')
    for name in info['shards']:
      if not os.path.isfile(os.path.join(path, name)):
        raise ConfigError(f'{meta_path} lists shard {name!r}, which is missing')
  return meta


def meta(path: str) -> dict[str, Any]:
  """The directory's meta.json (validated: format, dtype, both splits, shards present)."""
  return _read_meta(os.path.abspath(os.path.expanduser(path)))


def shard_paths(path: str, split: str) -> list[str]:
  """Absolute paths of `split`'s shards in meta.json's order."""
  root = os.path.abspath(os.path.expanduser(path))
  return [os.path.join(root, name) for name in meta(path)['splits'][split]['shards']]


def bytes_per_token(path: str) -> float:
  """Validation UTF-8 bytes / validation tokens (end-of-document ids included); of loss-masked
  shards, the responses' bytes / the tokens the loss counts."""
  info = meta(path)['splits']['validation']
  return info['bytes'] / info['loss_tokens' if has_loss_mask(path) else 'tokens']


def has_loss_mask(path: str) -> bool:
  """Whether the shards mark the tokens the loss counts (prepare --response_field)."""
  return bool(meta(path).get('loss_mask'))


def split_loss_bit(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, 1 where the loss counts the token) of loss-masked ids."""
  ids = np.asarray(ids, DTYPE)
  return ids & ID_MASK, (ids >> np.uint32(31)).astype(np.int32)


def decode(record: bytes) -> np.ndarray:
  """One record -> its uint32 token ids (the document's, then the end-of-document id)."""
  return np.frombuffer(record, DTYPE)


def source(path: str, split: str) -> grain.sources.ArrayRecordDataSource:
  """Random access to `split`'s records over all its shards (one index space, shard order)."""
  return grain.sources.ArrayRecordDataSource(shard_paths(path, split))


@functools.lru_cache(maxsize=4)
def _split_tokens(root: str, split: str) -> np.ndarray:
  src = source(root, split)
  parts = [decode(src[i]) for i in range(len(src))]
  return np.concatenate(parts) if parts else np.zeros((0,), DTYPE)


def split_tokens(path: str, split: str) -> np.ndarray:
  """All of `split`'s documents concatenated in record order (uint32; for validation-sized
  splits: it is read into memory)."""
  return _split_tokens(os.path.abspath(os.path.expanduser(path)), split)


def segment_ids(windows_BW: np.ndarray, eod_id: int) -> np.ndarray:
  """int32 document index of every token within its window: the number of end-of-document ids
  strictly before it (an end-of-document id belongs to the document it ends)."""
  eod_BW = (np.asarray(windows_BW) == eod_id).astype(np.int32)
  return np.cumsum(eod_BW, axis=-1, dtype=np.int32) - eod_BW


class _PackIterator(grain.DatasetIterator):
  """Concatenates the parent's documents and yields windows of `window` tokens (no overlap)."""

  def __init__(self, parent: grain.DatasetIterator, window: int):
    super().__init__(parent)
    self._window = window
    self._doc_state = parent.get_state()   # the parent's state before `_doc` was read
    self._doc, self._offset, self._has_doc = np.zeros((0,), DTYPE), 0, False

  def __next__(self) -> np.ndarray:
    out_W = np.empty((self._window,), DTYPE)
    filled = 0
    while filled < self._window:
      if self._offset == len(self._doc):
        self._doc_state = self._parent.get_state()
        self._doc, self._offset, self._has_doc = next(self._parent), 0, True
      n = min(self._window - filled, len(self._doc) - self._offset)
      out_W[filled:filled + n] = self._doc[self._offset:self._offset + n]
      filled += n
      self._offset += n
    return out_W

  def get_state(self) -> dict[str, Any]:
    return {'doc_state': self._doc_state, 'offset': self._offset, 'has_doc': self._has_doc}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state['doc_state'])
    self._doc_state, self._offset = state['doc_state'], int(state['offset'])
    self._has_doc = bool(state['has_doc'])
    self._doc = next(self._parent) if self._has_doc else np.zeros((0,), DTYPE)


class PackDataset(grain.IterDataset):
  """`parent` (an IterDataset of 1-D uint32 documents) packed into windows of `window` tokens."""

  def __init__(self, parent: grain.IterDataset, window: int):
    super().__init__(parent)
    self._window = window

  def __iter__(self) -> _PackIterator:
    return _PackIterator(self._parent.__iter__(), self._window)


class _ShuffleIterator(grain.DatasetIterator):
  """The parent's windows in blocks of `block`: each block is read whole and emitted in a
  permutation drawn from (seed, block number)."""

  def __init__(self, parent: grain.DatasetIterator, block: int, seed: int):
    super().__init__(parent)
    self._block, self._seed = block, seed
    self._start = parent.get_state()   # the parent's state before the current block
    self._number, self._pos, self._windows, self._order = -1, block, [], None

  def _read_block(self) -> None:
    self._windows = [next(self._parent) for _ in range(self._block)]
    self._order = np.random.default_rng((self._seed, self._number)).permutation(self._block)

  def __next__(self) -> np.ndarray:
    if self._pos == self._block:
      self._start, self._number, self._pos = self._parent.get_state(), self._number + 1, 0
      self._read_block()
    self._pos += 1
    return self._windows[self._order[self._pos - 1]]

  def get_state(self) -> dict[str, Any]:
    done = self._pos == self._block   # then the next block starts where the parent stands
    return {'start': self._parent.get_state() if done else self._start,
            'number': self._number, 'pos': self._pos}

  def set_state(self, state: dict[str, Any]) -> None:
    self._start, self._number, self._pos = state['start'], int(state['number']), int(state['pos'])
    self._parent.set_state(self._start)
    if self._pos < self._block:   # the current block, read again
      self._read_block()


class ShuffleWindows(grain.IterDataset):
  """`parent`'s windows shuffled in blocks of `block` (data.shuffle_windows)."""

  def __init__(self, parent: grain.IterDataset, block: int, seed: int):
    super().__init__(parent)
    self._block, self._seed = block, seed

  def __iter__(self) -> _ShuffleIterator:
    return _ShuffleIterator(self._parent.__iter__(), self._block, self._seed)


class _ToBatch(grain.transforms.Map):
  """uint32 (B, W) windows -> int32 tokens, or a dict of 'tokens' with 'segment_ids' (the
  segment mask) and / or 'loss_mask' (loss-masked shards)."""

  def __init__(self, eod_id: int | None, loss_mask: bool = False):
    self._eod_id, self._loss_mask = eod_id, loss_mask

  def map(self, windows_BW: np.ndarray) -> Any:
    out = {}
    if self._loss_mask:
      windows_BW, out['loss_mask'] = split_loss_bit(windows_BW)
    tokens_BW = np.asarray(windows_BW, np.int32)
    if self._eod_id is not None:
      out['segment_ids'] = segment_ids(windows_BW, self._eod_id)
    return {'tokens': tokens_BW, **out} if out else tokens_BW


def _stack(rows: tuple[np.ndarray, ...]) -> np.ndarray:
  return np.stack(rows)


def row_streams(path: str, seq_len: int, local_batch: int, seed: int, process_index: int = 0,
                process_count: int = 1, shuffle_windows: int = 0) -> list[grain.IterDataset]:
  """The process's `local_batch` packed window streams (module doc): row r packs documents
  r, r + B, ... of the process's slice, its windows shuffled in blocks of `shuffle_windows`
  (0: in stream order)."""
  slice_ = grain.MapDataset.source(source(path, 'train'))[process_index::process_count]
  if len(slice_) < local_batch:
    raise ConfigError(f'data.path={path!r}: process {process_index} has {len(slice_)} train '
                      f'documents, fewer than its {local_batch} batch rows (one packed stream '
                      f'per row); valid: a smaller train.batch_size or more documents')
  rows = []
  for r in range(local_batch):
    docs = slice_[r::local_batch].shuffle(seed=seed + 7919 * r).repeat().map(decode)
    # One record read per document; reading threads only add GIL churn at these sizes.
    it_ds = docs.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    packed = PackDataset(it_ds, seq_len + 1)
    rows.append(ShuffleWindows(packed, shuffle_windows, seed + 7919 * r + 1)
                if shuffle_windows else packed)
  return rows


def to_batches(windows: grain.IterDataset, eod_id: int | None,
               loss_mask: bool = False) -> grain.IterDataset:
  """(B, W) uint32 windows -> int32 tokens, or a dict with 'segment_ids' (an `eod_id`) and / or
  'loss_mask' (`_ToBatch`)."""
  return windows.map(_ToBatch(eod_id, loss_mask))


def train_dataset(path: str, seq_len: int, local_batch: int, seed: int, process_index: int = 0,
                  process_count: int = 1, segment_mask: bool = False,
                  shuffle_windows: int = 0) -> grain.IterDataset:
  """Endless batches (local_batch, seq_len + 1): one packed stream per row (`row_streams`)."""
  rows = row_streams(path, seq_len, local_batch, seed, process_index, process_count,
                     shuffle_windows)
  eod_id = meta(path)['eod_id'] if segment_mask else None
  return to_batches(grain.experimental.ZipIterDataset(parents=rows).map(_stack), eod_id,
                    has_loss_mask(path))


def write_split(path: str, split: str, documents: Sequence[Sequence[int]], eod_id: int,
                num_shards: int = 1) -> dict[str, Any]:
  """Writes `documents` (token-id lists, without the end-of-document id) as `split`'s shards
  under `path`, in contiguous runs: shard s of n holds documents [s*N/n, (s+1)*N/n). Returns the
  split's meta.json entry without `bytes` (the caller knows the text). For fixtures and
  benchmarks; real corpora use `python -m sharenet.data.prepare`."""
  from array_record.python.array_record_module import ArrayRecordWriter
  os.makedirs(path, exist_ok=True)
  names, tokens = [], 0
  bounds = np.linspace(0, len(documents), num_shards + 1).astype(int)
  for s in range(num_shards):
    name = f'{split}-{s:05d}-of-{num_shards:05d}.array_record'
    writer = ArrayRecordWriter(os.path.join(path, name), 'group_size:1')
    for doc in documents[bounds[s]:bounds[s + 1]]:
      record = np.asarray(list(doc) + [eod_id], DTYPE)
      tokens += len(record)
      writer.write(record.tobytes())
    writer.close()
    names.append(name)
  return {'shards': names, 'documents': len(documents), 'tokens': tokens}


def write_meta(path: str, splits: dict[str, dict[str, Any]], vocab_size: int, eod_id: int,
               tokenizer: Any = 'test') -> None:
  """Writes meta.json for `splits` ({split: write_split's entry plus 'bytes'})."""
  doc = {'format': FORMAT, 'tokenizer': tokenizer, 'vocab_size': vocab_size, 'eod_id': eod_id,
         'dtype': 'uint32', 'splits': splits}
  with open(os.path.join(path, 'meta.json'), 'w') as f:
    json.dump(doc, f, indent=2)
  _read_meta.cache_clear()   # a rewritten directory is read anew
  _split_tokens.cache_clear()
