"""Token corpora: the embedded stdlib corpus, user text files and nanoGPT `.bin` files.

Sources (`data.source`):
  stdlib: every `.py` file under `sysconfig.get_paths()['stdlib']` (site-packages excluded),
    sorted by relative path, bytes concatenated (vocab 256). A file is validation iff
    `int(sha1(relpath).hexdigest()[:8], 16) % 50 == 0` (sizes on the development machine's
    CPython in docs/performance.md). Reading is fast enough that there is no on-disk cache.
    Other Python builds ship other files (e.g. Debian's python3.11 lacks test/), so numbers
    are only comparable on one build.
  text: `data.path` is a recursive glob of plain-text files, sorted by path relative to the
    files' common directory, bytes concatenated; a file is validation by `is_val_path` at
    `TEXT_VAL_FRACTION` (`text_splits`: the rule `python -m sharenet.data.prepare --input GLOB`
    uses, so the two put the same files in validation at its default --val_fraction). If that
    leaves either split empty (always so for one file), the last 1 % of the concatenated bytes
    is validation instead (prepare, whose unit is the document, refuses such a split).
  bin: `data.path` is a flat token file (nanoGPT `train.bin`), memory-mapped, of
    `data.bin_dtype` ids: uint16 (nanoGPT's) or uint32 (vocabularies over 65536); the file does
    not say which, so the key does. Validation is the same file name with `train` -> `val` if
    that file exists, else the last 1 %. Token ids are not bytes, so `bytes_per_token` is None
    and bits-per-token is reported.
  arrayrecord: `data.path` is a directory of tokenized documents in ArrayRecord shards with a
    meta.json (sharenet/data/arrayrecord.py); training streams it (never whole in memory), so
    `load_splits` does not serve it. Its meta.json gives the vocab size and the validation
    bytes per token, so bits per byte is real bits per byte. With `data.mixture` (no
    data.path) it draws from several such directories by weight (sharenet/data/mixture.py);
    what asks for one directory here (tokenizer, vocabulary) reads the first, which the others
    match.
  hf: `data.path` is a Hugging Face dataset (a hub name or a local directory) streamed and
    tokenized on the fly with data.tokenizer (sharenet/data/hf_stream.py); its bytes per token
    come from its validation stream (`pipeline.bytes_per_token`).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import os
import sysconfig
from typing import Any, Callable

import numpy as np

from sharenet.config import defaults, sections
from sharenet.data import arrayrecord, mixture, tokenizer
from sharenet.errors import ConfigError

SOURCES = ('stdlib', 'text', 'bin', 'arrayrecord', 'hf')
SPLITS = ('train', 'validation')
BIN_DTYPES = ('uint16', 'uint32')
BYTE_VOCAB = 256
_VAL_MODULUS = 50  # 1 in 50 files; 1 in 100 left too few validation bytes.
TEXT_VAL_FRACTION = 1 / _VAL_MODULUS   # a text glob's expected validation fraction, as stdlib's
# The text-glob rule's salt: prepare's since its v1 format (a new salt would re-split every
# prepared directory, whose fingerprint lists each document's split).
SPLIT_SALT = 'sharenet-prepare-v1:'


def with_fields(cfg: Any, **fields: Any) -> Any:
  """A copy of the data section (or dict / ConfigDict) `cfg` with `fields` replaced."""
  if isinstance(cfg, sections.Section):
    return dataclasses.replace(cfg, **fields)
  return {**(cfg.to_dict() if hasattr(cfg, 'to_dict') else dict(cfg)), **fields}


def get_field(cfg: Any, name: str) -> Any:
  """`data.<name>` of the typed data section, or of a dict (a key it lacks takes
  sharenet/config/defaults.py's value)."""
  if isinstance(cfg, sections.Section):
    return cfg[name]
  return defaults.fill('data', cfg)[name]


def source_and_path(data_cfg: Any) -> tuple[str, str]:
  """Returns (`data.source`, `data.path`), raising ConfigError for an unknown source."""
  source, path = get_field(data_cfg, 'source'), get_field(data_cfg, 'path') or ''
  if source not in SOURCES:
    raise ConfigError(f'data.source={source!r} is unknown; valid choices: {", ".join(SOURCES)}')
  spec = get_field(data_cfg, 'mixture')
  if spec:   # the first source stands for the rest (mixture.parse: one tokenizer for all)
    if source != 'arrayrecord' or path:
      raise ConfigError(f'data.mixture={spec!r} with data.source={source!r} data.path={path!r}; '
                        f'valid: data.source=arrayrecord and no data.path (the mixture names '
                        f'the directories)')
    return source, mixture.source_paths(spec)[0]
  if get_field(data_cfg, 'mixture_schedule'):
    raise ConfigError('data.mixture_schedule is set without data.mixture; valid: a schedule of '
                      'the weights of data.mixture\'s sources')
  if source != 'stdlib' and not path:
    what = {'arrayrecord': 'a directory', 'hf': 'a dataset NAME[:CONFIG] or a local dataset '
            'directory'}.get(source, 'a file glob')
    raise ConfigError(f'data.path is empty but data.source={source!r} needs {what}')
  return source, path


def bin_dtype(data_cfg: Any) -> str:
  """`data.bin_dtype` (uint16 | uint32), raising ConfigError for another."""
  name = get_field(data_cfg, 'bin_dtype')
  if name not in BIN_DTYPES:
    raise ConfigError(f'data.bin_dtype={name!r} is unknown; valid choices: '
                      f'{", ".join(BIN_DTYPES)}')
  return name


def is_val_file(relpath: str) -> bool:
  """Whether a stdlib file belongs to the validation split (stable hash of its relative path)."""
  digest = hashlib.sha1(relpath.replace(os.sep, '/').encode()).hexdigest()
  return int(digest[:8], 16) % _VAL_MODULUS == 0


def path_fraction(relpath: str) -> float:
  """A relative path's place in [0, 1) under the text-glob rule (a salted sha1)."""
  digest = hashlib.sha1((SPLIT_SALT + relpath.replace(os.sep, '/')).encode()).hexdigest()
  return int(digest[:16], 16) / 2**64


def text_fraction(text: str) -> float:
  """A record's place in [0, 1) (sharenet/data/records.py): a salted sha1 of its text, so its
  split does not depend on the container or the row it sits in."""
  digest = hashlib.sha1((SPLIT_SALT + 'record:' + text).encode('utf-8', 'replace')).hexdigest()
  return int(digest[:16], 16) / 2**64


def is_val_path(relpath: str, val_fraction: float = TEXT_VAL_FRACTION) -> bool:
  """Whether a file of a text glob belongs to the validation split: the one rule of
  data.source=text and prepare (a file keeps its split when others are added)."""
  return path_fraction(relpath) < val_fraction


def _by_split(relpaths: list[str], is_val: Callable[[str], bool]) -> dict[str, list[str]]:
  docs = {split: [] for split in SPLITS}
  for rel in relpaths:
    docs['validation' if is_val(rel) else 'train'].append(rel)
  return docs


def stdlib_files() -> tuple[str, list[str]]:
  """Returns the stdlib root and its `.py` files as sorted relative paths."""
  root = sysconfig.get_paths()['stdlib']
  files = []
  for d, dirs, names in os.walk(root):
    dirs[:] = [x for x in dirs if x != 'site-packages']
    files += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith('.py')]
  return root, sorted(files)


def stdlib_splits() -> tuple[str, dict[str, list[str]]]:
  """(root, {'train': relpaths, 'validation': relpaths}) of the stdlib corpus (`is_val_file`)."""
  root, relpaths = stdlib_files()
  return root, _by_split(relpaths, is_val_file)


def text_splits(pattern: str, name: str, val_fraction: float = TEXT_VAL_FRACTION
                ) -> tuple[str, dict[str, list[str]]]:
  """(root, {'train': relpaths, 'validation': relpaths}) of the files a recursive glob matches:
  sorted, relative to root (their common directory), split by `is_val_path`. Either split may
  be empty; none matched is a ConfigError naming the setting `name`."""
  files = sorted(os.path.abspath(f) for f in glob.glob(os.path.expanduser(pattern),
                                                       recursive=True) if os.path.isfile(f))
  if not files:
    raise ConfigError(f'{name}={pattern!r} matches no files; valid: a (quoted) glob of text '
                      f'files')
  root = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
  relpaths = [os.path.relpath(f, root) for f in files]
  return root, _by_split(relpaths, lambda rel: is_val_path(rel, val_fraction))


def _match(path: str) -> list[str]:
  files = sorted(f for f in glob.glob(os.path.expanduser(path), recursive=True)
                 if os.path.isfile(f))
  if not files:
    raise ConfigError(f'data.path={path!r} matches no files')
  if all(os.path.getsize(f) == 0 for f in files):
    raise ConfigError(f'data.path={path!r} matches only empty files')
  return files


def _tail_split(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  n_val = max(1, len(tokens) // 100)
  return tokens[:-n_val], tokens[-n_val:]


def _read(root: str, docs: dict[str, list[str]]) -> tuple[np.ndarray, np.ndarray]:
  """(train, validation) bytes: each split's files concatenated in order."""
  def concat(relpaths: list[str]) -> bytes:
    parts = []
    for rel in relpaths:
      with open(os.path.join(root, rel), 'rb') as f:
        parts.append(f.read())
    return b''.join(parts)
  return tuple(tokenizer.byte_ids(concat(docs[split])) for split in SPLITS)


def _load_text(path: str) -> tuple[np.ndarray, np.ndarray]:
  root, docs = text_splits(path, 'data.path')
  if all(os.path.getsize(os.path.join(root, r)) == 0 for d in docs.values() for r in d):
    raise ConfigError(f'data.path={path!r} matches only empty files')
  train, val = _read(root, docs)
  if len(train) and len(val):
    return train, val
  return _tail_split(np.concatenate([train, val]))


def _memmap(path: str, dtype: str) -> np.ndarray:
  size = np.dtype(dtype).itemsize
  if os.path.getsize(path) % size:
    raise ConfigError(f'data.path={path!r} has {os.path.getsize(path)} bytes, not a multiple of '
                      f'{size}: not flat {dtype} tokens (data.bin_dtype; valid choices: '
                      f'{", ".join(BIN_DTYPES)})')
  return np.memmap(path, dtype=np.dtype(dtype).newbyteorder('<'), mode='r')


def _load_bin(path: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
  files = _match(path)
  if len(files) != 1:
    raise ConfigError(f'data.path={path!r} matches {len(files)} files; data.source=bin needs one')
  head, name = os.path.split(files[0])
  val_path = os.path.join(head, name.replace('train', 'val'))
  if 'train' in name and os.path.isfile(val_path) and os.path.getsize(val_path):
    return _memmap(files[0], dtype), _memmap(val_path, dtype)
  return _tail_split(_memmap(files[0], dtype))


@functools.lru_cache(maxsize=4)
def _load(source: str, path: str, dtype: str = 'uint16') -> tuple[np.ndarray, np.ndarray]:
  if source == 'stdlib':
    return _read(*stdlib_splits())
  return _load_text(path) if source == 'text' else _load_bin(path, dtype)


def _source_key(data_cfg: Any) -> tuple[str, str, str]:
  """(source, path, bin dtype): what identifies an in-memory corpus."""
  source, path = source_and_path(data_cfg)
  if source in ('arrayrecord', 'hf'):
    raise ConfigError(f'data.source={source} streams its train split and is not loaded whole; '
                      f'valid here: stdlib, text, bin')
  return source, path, bin_dtype(data_cfg) if source == 'bin' else 'uint16'


def load_splits(data_cfg: Any) -> tuple[np.ndarray, np.ndarray]:
  """Returns (train_tokens, val_tokens) as read-only 1-D arrays (uint8, or data.bin_dtype for
  bin). Not for arrayrecord (ConfigError): see sharenet/data/arrayrecord.py."""
  return _load(*_source_key(data_cfg))


def bytes_per_token(data_cfg: Any) -> float | None:
  """1.0 for byte sources; meta.json's validation bytes / tokens for arrayrecord; None for
  `bin`, where bits-per-byte is really bits-per-token (hf: pipeline.bytes_per_token)."""
  source, path = source_and_path(data_cfg)
  if source == 'hf':
    raise ConfigError('data.source=hf: its bytes per token come from its validation stream '
                      '(pipeline.bytes_per_token)')
  if source == 'arrayrecord':
    return arrayrecord.bytes_per_token(path)
  return None if source == 'bin' else 1.0


def vocab_size(data_cfg: Any) -> int | None:
  """256 for byte sources; meta.json's for arrayrecord; the tokenizer's for hf; None for `bin`, whose vocab comes from
  the model config."""
  source, path = source_and_path(data_cfg)
  if source == 'arrayrecord':
    return int(arrayrecord.meta(path)['vocab_size'])
  if source == 'hf':
    return for_data(data_cfg).vocab_size
  return None if source == 'bin' else BYTE_VOCAB


def max_token(tokens: np.ndarray, sample: int = 1 << 22) -> int:
  """Largest token id; a strided sample of ~`sample` ids for big arrays (a cheap check)."""
  stride = max(1, len(tokens) // sample)
  return int(tokens[::stride].max()) if len(tokens) else -1


def _counts(tokens: np.ndarray, size: int, chunk: int = 1 << 24) -> np.ndarray:
  # Chunked: bincount casts to intp, 8x the memory of a whole uint8 corpus or big memmap.
  counts = np.zeros(size, np.int64)
  for i in range(0, len(tokens), chunk):
    counts += np.bincount(tokens[i:i + chunk], minlength=len(counts))
  return counts


@functools.lru_cache(maxsize=4)
def _unigram_bits(source: str, path: str, dtype: str) -> float:
  splits = _load(source, path, dtype)
  size = max(BYTE_VOCAB, *(int(t.max()) + 1 for t in splits if len(t)))
  train, val = (_counts(t, size) for t in splits)
  vocab = max(BYTE_VOCAB, int(np.flatnonzero(train + val).max()) + 1)
  log_p = np.log2((train[:vocab] + 1.0) / (train.sum() + vocab))  # add-one smoothing
  return float(-(val[:vocab] * log_p).sum() / val.sum())


def unigram_bits_per_byte(data_cfg: Any) -> float | None:
  """Cross-entropy (bits) of validation under the add-one-smoothed train unigram; None for
  arrayrecord and hf (counting a streamed train split is a full pass over it)."""
  if source_and_path(data_cfg)[0] in ('arrayrecord', 'hf'):
    return None
  return _unigram_bits(*_source_key(data_cfg))


def data_spec(data_cfg: Any) -> tuple[str | None, str | None]:
  """(spec, base_dir) of a run's tokenizer, without loading it; ConfigError on a contradiction.

  `data.tokenizer` = auto (default) takes what the data implies: bytes for the byte sources
  (stdlib, text) and for hf (whose text any tokenizer may read), the shards' own tokenizer for
  arrayrecord (meta.json, a path relative to the
  shard directory), and none for `bin` (token ids of an unknown tokenizer: name it, e.g.
  hf:PATH, to generate from such a model). An explicit value that contradicts the data is a
  ConfigError; against shards it is compared by contents (`identity`), so hf:PATH naming the
  file the shards were prepared with (or any copy of it) is accepted and the shards' own copy is
  used. Training never needs the tokenizer; generation does (`for_data`).
  """
  spec = get_field(data_cfg, 'tokenizer') or 'auto'
  if get_field(data_cfg, 'source') == 'bin':
    # Token ids name no tokenizer of their own, and generation reads no data: an imported
    # model (sharenet/interop/import_hf.py) generates before any data.path is set.
    return (None if spec == 'auto' else spec), None
  source, path = source_and_path(data_cfg)
  if source == 'arrayrecord':
    shards, base = arrayrecord.meta(path)['tokenizer'], os.path.expanduser(path)
    if spec not in ('auto', shards) and (tokenizer.identity(spec) !=
                                         tokenizer.identity(shards, base_dir=base)):
      raise ConfigError(f'data.tokenizer={spec!r} contradicts the shards in data.path={path!r}, '
                        f'which were tokenized with {shards!r} (the files differ); valid: auto, '
                        f'{shards!r} or a copy of that file')
    return shards, base
  if source == 'hf':   # tokenized on the fly (sharenet/data/hf_stream.py)
    return ('bytes' if spec == 'auto' else spec), None
  if spec not in ('auto', 'bytes'):
    raise ConfigError(f'data.tokenizer={spec!r}: data.source={source!r} is read as UTF-8 bytes; '
                      f'valid: auto or bytes (tokenize text with python -m '
                      f'sharenet.data.prepare and train on data.source=arrayrecord)')
  return 'bytes', None


def for_data(data_cfg: Any) -> tokenizer.Tokenizer | None:
  """The loaded tokenizer of a run's data (see `data_spec`), or None for unnamed `bin` ids."""
  spec, base_dir = data_spec(data_cfg)
  return None if spec is None else tokenizer.load(spec, 'data.tokenizer', base_dir=base_dir)
