"""Token corpora: the embedded stdlib corpus, user text files and nanoGPT `.bin` files.

Sources (`data.source`):
  stdlib: every `.py` file under `sysconfig.get_paths()['stdlib']` (site-packages excluded),
    sorted by relative path, bytes concatenated (vocab 256). A file is validation iff
    `int(sha1(relpath).hexdigest()[:8], 16) % 50 == 0` (sizes on the development machine's
    CPython in README "Results"). Reading is fast enough that there is no on-disk cache.
    Other Python builds ship other files (e.g. Debian's python3.11 lacks test/), so numbers
    are only comparable on one build.
  text: `data.path` is a glob of plain-text files, same by-file rule with paths relative to
    the files' common directory. If that rule leaves either split empty (always so for one
    file), the last 1 % of the concatenated bytes is validation instead.
  bin: `data.path` is a flat uint16 token file (nanoGPT `train.bin`), memory-mapped. Validation
    is the same file name with `train` -> `val` if that file exists, else the last 1 %.
    Token ids are not bytes, so `bytes_per_token` is None and bits-per-token is reported.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import os
import sysconfig
from typing import Any

import numpy as np

from sharenet.errors import ConfigError

SOURCES = ('stdlib', 'text', 'bin')
BYTE_VOCAB = 256
_VAL_MODULUS = 50  # 1 in 50 files; 1 in 100 left too few validation bytes.


def get_field(cfg: Any, name: str) -> Any:
  """`data.<name>` of a ConfigDict or dict; a key it lacks takes sharenet/defaults.py's value."""
  from sharenet import defaults
  return defaults.fill('data', cfg)[name]


def source_and_path(data_cfg: Any) -> tuple[str, str]:
  """Returns (`data.source`, `data.path`), raising ConfigError for an unknown source."""
  source, path = get_field(data_cfg, 'source'), get_field(data_cfg, 'path') or ''
  if source not in SOURCES:
    raise ConfigError(f'data.source={source!r} is unknown; valid choices: {", ".join(SOURCES)}')
  if source != 'stdlib' and not path:
    raise ConfigError(f'data.path is empty but data.source={source!r} needs a file glob')
  return source, path


def is_val_file(relpath: str) -> bool:
  """Whether a file belongs to the validation split (stable hash of its relative path)."""
  digest = hashlib.sha1(relpath.replace(os.sep, '/').encode()).hexdigest()
  return int(digest[:8], 16) % _VAL_MODULUS == 0


def stdlib_files() -> tuple[str, list[str]]:
  """Returns the stdlib root and its `.py` files as sorted relative paths."""
  root = sysconfig.get_paths()['stdlib']
  files = []
  for d, dirs, names in os.walk(root):
    dirs[:] = [x for x in dirs if x != 'site-packages']
    files += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith('.py')]
  return root, sorted(files)


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


def _read(root: str, relpaths: list[str]) -> tuple[np.ndarray, np.ndarray]:
  parts = {True: [], False: []}
  for rel in relpaths:
    with open(os.path.join(root, rel), 'rb') as f:
      parts[is_val_file(rel)].append(f.read())
  return tuple(np.frombuffer(b''.join(parts[v]), np.uint8) for v in (False, True))


def _load_text(path: str) -> tuple[np.ndarray, np.ndarray]:
  files = [os.path.abspath(f) for f in _match(path)]
  root = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
  train, val = _read(root, [os.path.relpath(f, root) for f in files])
  if len(train) and len(val):
    return train, val
  return _tail_split(np.concatenate([train, val]))


def _memmap(path: str) -> np.ndarray:
  if os.path.getsize(path) % 2:
    raise ConfigError(f'data.path={path!r} has an odd byte count; expected flat uint16 tokens')
  return np.memmap(path, dtype=np.uint16, mode='r')


def _load_bin(path: str) -> tuple[np.ndarray, np.ndarray]:
  files = _match(path)
  if len(files) != 1:
    raise ConfigError(f'data.path={path!r} matches {len(files)} files; data.source=bin needs one')
  head, name = os.path.split(files[0])
  val_path = os.path.join(head, name.replace('train', 'val'))
  if 'train' in name and os.path.isfile(val_path) and os.path.getsize(val_path):
    return _memmap(files[0]), _memmap(val_path)
  return _tail_split(_memmap(files[0]))


@functools.lru_cache(maxsize=4)
def _load(source: str, path: str) -> tuple[np.ndarray, np.ndarray]:
  if source == 'stdlib':
    return _read(*stdlib_files())
  return _load_text(path) if source == 'text' else _load_bin(path)


def load_splits(data_cfg: Any) -> tuple[np.ndarray, np.ndarray]:
  """Returns (train_tokens, val_tokens) as read-only 1-D arrays (uint8, or uint16 for bin)."""
  return _load(*source_and_path(data_cfg))


def bytes_per_token(data_cfg: Any) -> float | None:
  """1.0 for byte sources; None for `bin`, where bits-per-byte is really bits-per-token."""
  return None if source_and_path(data_cfg)[0] == 'bin' else 1.0


def vocab_size(data_cfg: Any) -> int | None:
  """256 for byte sources; None for `bin`, whose vocab comes from the model config."""
  return None if source_and_path(data_cfg)[0] == 'bin' else BYTE_VOCAB


def max_token(tokens: np.ndarray, sample: int = 1 << 22) -> int:
  """Largest token id; a strided sample of ~`sample` ids for big arrays (a cheap check)."""
  stride = max(1, len(tokens) // sample)
  return int(tokens[::stride].max()) if len(tokens) else -1


def _counts(tokens: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
  # Chunked: bincount casts to intp, 8x the memory of a whole uint8 corpus or big memmap.
  counts = np.zeros(np.iinfo(tokens.dtype).max + 1, np.int64)
  for i in range(0, len(tokens), chunk):
    counts += np.bincount(tokens[i:i + chunk], minlength=len(counts))
  return counts


@functools.lru_cache(maxsize=4)
def _unigram_bits(source: str, path: str) -> float:
  train, val = (_counts(t) for t in _load(source, path))
  vocab = max(BYTE_VOCAB, int(np.flatnonzero(train + val).max()) + 1)
  log_p = np.log2((train[:vocab] + 1.0) / (train.sum() + vocab))  # add-one smoothing
  return float(-(val[:vocab] * log_p).sum() / val.sum())


def unigram_bits_per_byte(data_cfg: Any) -> float:
  """Cross-entropy (bits) of validation under the add-one-smoothed train unigram."""
  return _unigram_bits(*source_and_path(data_cfg))
