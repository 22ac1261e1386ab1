"""Tokenizers for `data.tokenizer` and `python -m sharenet.data.prepare`: text <-> uint32 ids.

Specs (`load(spec)`):
  bytes                 ids 0-255 are the UTF-8 bytes of the text and 256 is the end-of-document
                        id (EOD), so vocab_size = 257. The in-memory byte corpora of
                        sharenet/data/corpus.py use vocab 256 with no EOD; the byte *tokenizer*
                        adds the EOD id for the documents of prepared shards. `byte_ids` is the
                        one byte -> id mapping (the corpora, this tokenizer, generate.encode).
  sentencepiece:PATH    a local SentencePiece model file (Kudo & Richardson 2018, "SentencePiece:
                        A simple and language independent subword tokenizer", arXiv:1808.06226),
                        loaded with `sentencepiece.SentencePieceProcessor(model_file=PATH)`;
                        EOD = its eos_id() (a model without one is an error).
  hf:PATH               a local Hugging Face `tokenizer.json` (`tokenizers.Tokenizer.from_file`),
                        e.g. from `python -m sharenet.data.train_tokenizer`; EOD = the id of the
                        first of `HF_EOD_TOKENS` in its vocabulary.
Nothing is downloaded. A bad spec is a one-line ConfigError naming the problem and these forms.

Every tokenizer has `spec`, `vocab_size` (all ids, special ones included), `eod_id`,
`encode(text) -> uint32 array` (no BOS/EOS added: callers append `eod_id` per document),
`encode_batch(texts)` and `decode(ids) -> str`. decode never raises: ids outside
[0, vocab_size) become U+FFFD and EOD is written as `eod_token`; bytes that are not valid UTF-8
become U+FFFD, except under `bytes`, which writes them as \\xNN (a byte model's output shown
exactly, as eval.py --prompt prints it).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Iterable, Sequence

import numpy as np

from sharenet.errors import ConfigError

VALID_FORMS = ('bytes, sentencepiece:PATH (a SentencePiece .model file), '
               'hf:PATH (a Hugging Face tokenizer.json)')
# End-of-document tokens of common tokenizer.json files, most specific first: GPT-2 / GPT-NeoX /
# Qwen, Llama 3, Llama 2 / Mistral / T5, Gemma.
HF_EOD_TOKENS = ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>', '<|eos|>')
REPLACEMENT = '\ufffd'


def _bad(spec: str, problem: str, name: str) -> ConfigError:
  return ConfigError(f'{name}={spec!r}: {problem}; valid forms: {VALID_FORMS}')


def _first_line(error: Exception) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return lines[0] if lines else type(error).__name__


class Tokenizer:
  """Shared interface; subclasses implement `_encode`, `_decode_run` and set the attributes."""

  spec: str
  vocab_size: int
  eod_id: int
  eod_token: str

  def _encode(self, text: str) -> Sequence[int]:
    raise NotImplementedError

  def _decode_run(self, ids: list[int]) -> str:
    """Decodes in-range, non-EOD ids; must not raise."""
    raise NotImplementedError

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text` (uint32, 1-D), without BOS or EOD."""
    return np.asarray(self._encode(text), np.uint32)

  def encode_batch(self, texts: Iterable[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Any) -> str:
    """Text of `ids`: EOD -> `eod_token`, out-of-range ids -> U+FFFD; never raises."""
    parts, run = [], []
    for i in np.asarray(ids, np.int64).reshape(-1).tolist():
      if 0 <= i < self.vocab_size and i != self.eod_id:
        run.append(i)
        continue
      if run:
        parts.append(self._decode_run(run))
        run = []
      parts.append(self.eod_token if i == self.eod_id else REPLACEMENT)
    if run:
      parts.append(self._decode_run(run))
    return ''.join(parts)

  def __repr__(self) -> str:
    return (f'{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size}, '
            f'eod_id={self.eod_id})')


def byte_ids(data: bytes) -> np.ndarray:
  """Byte-level token ids of raw bytes: each byte is its id (uint8, a read-only view)."""
  return np.frombuffer(data, np.uint8)


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as ids 0-255; EOD = 256; invalid UTF-8 decodes as \\xNN."""

  def __init__(self, spec: str = 'bytes'):
    self.spec, self.vocab_size, self.eod_id, self.eod_token = spec, 257, 256, '<|endoftext|>'

  def encode(self, text: str) -> np.ndarray:
    return byte_ids(text.encode('utf-8')).astype(np.uint32)

  def _decode_run(self, ids: list[int]) -> str:
    return bytes(ids).decode('utf-8', errors='backslashreplace')


class HFTokenizer(Tokenizer):
  """A `tokenizers.Tokenizer` from a tokenizer.json, encoded without its post-processor's
  special tokens (add_special_tokens=False)."""

  def __init__(self, spec: str, path: str, name: str = 'data.tokenizer'):
    try:
      import tokenizers
    except ImportError as e:
      raise _bad(spec, f'the tokenizers package is not installed ({e})', name) from None
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the Rust loader raises a plain Exception
      problem = f'{path} does not load as a tokenizer.json ({_first_line(e)})'
      raise _bad(spec, problem, name) from None
    vocab = self._tok.get_vocab(with_added_tokens=True)
    found = [t for t in HF_EOD_TOKENS if t in vocab]
    if not found:
      raise _bad(spec, f'{path} has no end-of-document token; tried '
                 f'{", ".join(HF_EOD_TOKENS)}', name)
    self.spec, self.eod_token, self.eod_id = spec, found[0], vocab[found[0]]
    self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                          max(vocab.values()) + 1)

  def _encode(self, text: str) -> Sequence[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Iterable[str]) -> list[np.ndarray]:
    encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, np.uint32) for e in encodings]

  def _decode_run(self, ids: list[int]) -> str:
    return self._tok.decode(ids, skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
  """A `sentencepiece.SentencePieceProcessor`; EOD = eos_id()."""

  def __init__(self, spec: str, path: str, name: str = 'data.tokenizer'):
    try:
      import sentencepiece
    except ImportError as e:
      raise _bad(spec, f'the sentencepiece package is not installed ({e})', name) from None
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except Exception as e:  # noqa: BLE001 - RuntimeError / OSError from the C++ loader
      problem = f'{path} does not load as a SentencePiece model ({_first_line(e)})'
      raise _bad(spec, problem, name) from None
    self.spec, self.vocab_size, self.eod_id = spec, self._sp.get_piece_size(), self._sp.eos_id()
    if self.eod_id < 0:
      raise _bad(spec, f'{path} has no end-of-sentence piece (eos_id() = -1); train it with '
                 f'eos_id >= 0', name)
    self.eod_token = self._sp.id_to_piece(self.eod_id)

  def _encode(self, text: str) -> Sequence[int]:
    return self._sp.encode(text, out_type=int)

  def encode_batch(self, texts: Iterable[str]) -> list[np.ndarray]:
    return [np.asarray(ids, np.uint32) for ids in self._sp.encode(list(texts), out_type=int)]

  def _decode_run(self, ids: list[int]) -> str:
    return self._sp.decode(ids)


def _resolve(spec: str, name: str, base_dir: str | None) -> tuple[str, str]:
  """(kind, existing file path) of a sentencepiece:PATH or hf:PATH spec; ConfigError else."""
  kind, sep, path = spec.partition(':')
  if not sep or kind not in ('sentencepiece', 'hf'):
    raise _bad(spec, f'unknown kind {kind!r}', name)
  if not path:
    raise _bad(spec, f'{kind}: needs a file path', name)
  path = os.path.expanduser(path)
  if base_dir is not None and not os.path.isabs(path):
    path = os.path.join(base_dir, path)
  if not os.path.isfile(path):
    raise _bad(spec, f'no such file {path}', name)
  return kind, path


def load(spec: str, name: str = 'data.tokenizer', base_dir: str | None = None) -> Tokenizer:
  """The tokenizer for `data.tokenizer` = bytes | sentencepiece:PATH | hf:PATH; errors name the
  setting as `name` (e.g. '--tokenizer' on a command line). A relative PATH is relative to
  `base_dir` when given (a shard directory's meta.json names its own copy)."""
  if not isinstance(spec, str) or not spec:
    raise _bad(str(spec), 'empty or not a string', name)
  if spec == 'bytes':
    return ByteTokenizer(spec)
  kind, path = _resolve(spec, name, base_dir)
  return (HFTokenizer if kind == 'hf' else SentencePieceTokenizer)(spec, path, name)


def file_sha256(path: str) -> str:
  """Hex sha256 of a file's bytes."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      h.update(chunk)
  return h.hexdigest()


def identity(spec: str, name: str = 'data.tokenizer', base_dir: str | None = None) -> str:
  """What a tokenizer is, by contents not path: 'bytes', or its kind and its file's sha256 (two
  paths to copies of one tokenizer.json agree). Paths resolve as in `load`."""
  if spec == 'bytes':
    return spec
  kind, path = _resolve(spec, name, base_dir)
  return f'{kind}:sha256={file_sha256(path)}'
