"""Documents stored as records: one row of a table is one document (prepare's --input).

Containers: parquet (`.parquet`), Arrow (`.arrow`, the IPC stream format `datasets` writes, or
the IPC file format), JSON lines (`.jsonl`, `.jsonl.gz`, `.json.gz`: one JSON object per line),
and a Hugging Face dataset (`hf:NAME[:CONFIG]` with a split, read through the `datasets`
library in streaming mode; NAME is a hub name or a local dataset directory). The text is the
column `text_field` (default `text`).

Fine-tuning records (prepare --response_field): each row is a prompt (the column `text_field`)
and a response; prepare writes both and marks the response's tokens as the ones the loss counts
(sharenet/data/arrayrecord.py, "Loss mask"). Chat records (prepare --messages_field): each row
is a list of {role, content} messages, rendered with a chat template; the assistant messages are
the ones the loss counts.

A *unit* is the smallest piece read on its own: one file, or one source shard of a streamed
dataset (`IterableDataset.shard`). prepare writes each output shard from whole units, so a
shard reads only its own units and a killed run resumes shard by shard.

Splits: a record belongs to validation iff `corpus.text_fraction(text) < val_fraction` (a salted
sha1 of its text, as a text glob's file goes by its path): the split does not depend on the
container or the row's place, so the same documents in parquet, JSON lines or a dataset give
the same shards, and an exact duplicate never sits in both splits.

Bad input is one ConfigError line naming the unit and the row: no such column (with the
columns there are), a value that is not a string, a unit without rows, an unreadable file.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
from typing import Any, Iterator

from sharenet.errors import ConfigError

SUFFIXES = ('.parquet', '.arrow', '.jsonl', '.jsonl.gz', '.json.gz')
HF_PREFIX = 'hf:'


def is_records(input_spec: str) -> bool:
  """Whether prepare's --input names records (a hf: dataset or a glob of record files)."""
  return input_spec.startswith(HF_PREFIX) or input_spec.endswith(SUFFIXES)


class Unit:
  """One file, or one source shard of a streamed dataset: its name and its rows' texts."""

  def __init__(self, name: str, size: int, read):
    self.name, self.size, self._read = name, size, read

  def texts(self, text_field: str) -> Iterator[str]:
    """The unit's texts in row order; one ConfigError line on bad input."""
    n = 0
    for n, row in enumerate(self._read(), 1):
      yield _text(row, text_field, self.name, n - 1)
    if n == 0:
      raise ConfigError(f'{self.name}: no rows; valid: a file with at least one record')


  def pairs(self, prompt_field: str, response_field: str) -> Iterator[tuple[str, str]]:
    """The unit's (prompt, response) pairs in row order (prepare --response_field: fine-tuning
    data whose loss counts the response only); one ConfigError line on bad input, also for an
    empty response."""
    n = 0
    for n, row in enumerate(self._read(), 1):
      prompt = _text(row, prompt_field, self.name, n - 1)
      response = _text(row, response_field, self.name, n - 1)
      if not response:
        raise ConfigError(f'{self.name} row {n - 1}: --response_field={response_field!r} is '
                          f'empty; valid: a response of at least one character (its tokens '
                          f'are the ones the loss counts)')
      yield prompt, response
    if n == 0:
      raise ConfigError(f'{self.name}: no rows; valid: a file with at least one record')


  def messages(self, field: str) -> Iterator[tuple[tuple[str, str], ...]]:
    """The unit's chat conversations ((role, content), ...) in row order (prepare
    --messages_field); one ConfigError line for a row that is not a list of {role, content}
    messages with a known role, or that holds no assistant message (nothing to learn)."""
    n = 0
    for n, row in enumerate(self._read(), 1):
      where = f'{self.name} row {n - 1}'
      if field not in row:
        raise ConfigError(f'{where}: no column {field!r} (it has: {", ".join(map(str, row))}); '
                          f'valid: --messages_field=one of them')
      value = row[field]
      ok = isinstance(value, list) and all(
          isinstance(m, dict) and m.get('role') in ROLES and isinstance(m.get('content'), str)
          for m in value)
      if not ok:
        raise ConfigError(f'{where}: --messages_field={field!r} is not a list of {{role, '
                          f'content}} messages; valid roles: {", ".join(ROLES)}')
      if not any(m['role'] == 'assistant' and m['content'] for m in value):
        raise ConfigError(f'{where}: no assistant message; valid: a conversation with at '
                          f'least one non-empty assistant message (the tokens the loss counts)')
      yield tuple((m['role'], m['content']) for m in value)
    if n == 0:
      raise ConfigError(f'{self.name}: no rows; valid: a file with at least one record')


ROLES = ('system', 'user', 'assistant')


def _text(row: dict[str, Any], field: str, where: str, i: int) -> str:
  if field not in row:
    raise ConfigError(f'{where} row {i}: no column {field!r} (it has: '
                      f'{", ".join(map(str, row)) or "none"}); valid: --text_field=one of them')
  value = row[field]
  if not isinstance(value, str):
    raise ConfigError(f'{where} row {i}: --text_field={field!r} holds '
                      f'{type(value).__name__}, not text; valid: a column of strings')
  return value


def units(input_spec: str, split: str = 'train') -> list[Unit]:
  """The units of `input_spec` in a fixed order (files sorted; a dataset's source shards)."""
  if input_spec.startswith(HF_PREFIX):
    return _dataset_units(input_spec[len(HF_PREFIX):], split)
  files = sorted(os.path.abspath(f) for f in glob.glob(os.path.expanduser(input_spec),
                                                       recursive=True) if os.path.isfile(f))
  if not files:
    raise ConfigError(f'--input={input_spec!r} matches no files; valid: a (quoted) glob of '
                      f'{", ".join(SUFFIXES)} files, text files, or hf:NAME[:CONFIG]')
  other = [f for f in files if not f.endswith(SUFFIXES)]
  if other:
    raise ConfigError(f'--input={input_spec!r} matches {other[0]}, not a record file; valid: '
                      f'one kind per --input ({", ".join(SUFFIXES)}), or a glob of text files')
  return [Unit(f, os.path.getsize(f), lambda f=f: _file_rows(f)) for f in files]


def _file_rows(path: str) -> Iterator[dict[str, Any]]:
  try:
    if path.endswith('.parquet'):
      import pyarrow.parquet as pq
      for batch in pq.ParquetFile(path).iter_batches():
        yield from batch.to_pylist()
    elif path.endswith('.arrow'):
      yield from _arrow_rows(path)
    else:
      opener = gzip.open if path.endswith('.gz') else open
      with opener(path, 'rt', encoding='utf-8') as f:
        for i, line in enumerate(f):
          if line.strip():
            yield _json_row(line, path, i)
  except ConfigError:
    raise
  except (OSError, ValueError) as e:   # pyarrow's errors are both
    raise ConfigError(f'{path}: cannot read it as {_kind(path)}: '
                      f'{str(e).splitlines()[0] if str(e) else type(e).__name__}') from None


def _json_row(line: str, path: str, i: int) -> dict[str, Any]:
  try:
    row = json.loads(line)
  except json.JSONDecodeError as e:
    raise ConfigError(f'{path} line {i + 1}: not JSON ({e.msg}); valid: one object per '
                      f'line') from None
  if not isinstance(row, dict):
    raise ConfigError(f'{path} line {i + 1}: a JSON {type(row).__name__}, not an object; '
                      f'valid: one object per line')
  return row


def _arrow_rows(path: str) -> Iterator[dict[str, Any]]:
  import pyarrow as pa
  with pa.memory_map(path) as source:
    try:
      reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
      source.seek(0)
      reader = pa.ipc.open_file(source)
      for i in range(reader.num_record_batches):
        yield from reader.get_batch(i).to_pylist()
      return
    for batch in reader:
      yield from batch.to_pylist()


def _kind(path: str) -> str:
  return ('parquet' if path.endswith('.parquet') else 'Arrow IPC' if path.endswith('.arrow')
          else 'JSON lines')


def load_stream(spec: str, split: str, where: str) -> Any:
  """The `datasets.IterableDataset` of `spec` = NAME[:CONFIG] (a hub name or a local dataset
  directory), streamed; one ConfigError line starting with `where` (the setting that named it)
  if it cannot be opened."""
  import datasets
  name, _, config = spec.partition(':')
  if not name:
    raise ConfigError(f'{where}: no dataset name; valid: NAME[:CONFIG]')
  try:
    return datasets.load_dataset(name, config or None, split=split, streaming=True)
  except (FileNotFoundError, ValueError, ConnectionError) as e:
    raise ConfigError(f'{where} (split {split!r}): cannot load it: '
                      f'{str(e).splitlines()[0] if str(e) else type(e).__name__}') from None


def text_of(row: dict[str, Any], field: str, where: str, i: int) -> str:
  """Row `i`'s text (column `field`); one ConfigError line naming `where` and the row."""
  return _text(row, field, where, i)


def _dataset_units(spec: str, split: str) -> list[Unit]:
  """A streamed Hugging Face dataset: one unit per source shard (`IterableDataset.shard`)."""
  ds = load_stream(spec, split, f'--input=hf:{spec}')
  n = ds.num_shards
  return [Unit(f'hf:{spec}[{split}] shard {i} of {n}', 0,
               lambda i=i: iter(ds.shard(num_shards=n, index=i))) for i in range(n)]
