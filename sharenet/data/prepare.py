"""Tokenizes a text corpus into ArrayRecord shards, one record per document.

  python -m sharenet.data.prepare --input 'GLOB' --tokenizer SPEC --out DIR \
      [--shards N] [--val_shards M] [--val_fraction F] [--workers W]
  python -m sharenet.data.prepare --input stdlib --tokenizer SPEC --out DIR
  python -m sharenet.data.prepare --input 'DIR/*.parquet' [--text_field text] ...
  python -m sharenet.data.prepare --input hf:NAME[:CONFIG] [--split train] ...

Documents: one file matched by `--input` (a recursive glob; files only, sorted) is one
document, decoded as UTF-8 (an invalid byte becomes U+FFFD, counted in the summary).
`--input stdlib` is the embedded corpus (sharenet/data/corpus.py): the stdlib `.py` files.
Records (sharenet/data/records.py): a glob of parquet, Arrow or JSON-lines files, or a Hugging
Face dataset `hf:NAME[:CONFIG]` (`--split`, streamed through `datasets`; NAME may be a local
dataset directory), one row per document, its text the column `--text_field`.

Splits: the rule of `data.source=text` (`corpus.text_splits`): a document is validation iff
`int(sha1(corpus.SPLIT_SALT + relpath)[:16], 16) / 2**64 < val_fraction`, relpath relative to the
matched files' common directory ('/'-separated), so a file keeps its split when others are
added; the default --val_fraction is data.source=text's (`corpus.TEXT_VAL_FRACTION`, 0.02), so
both put the same files in validation. A split left without a document is a ConfigError
naming --val_fraction and the values that would fill it (train.py needs both splits). For
stdlib the split is `corpus.is_val_file` (the split the byte-level runs use) and
--val_fraction does not apply.

Shards: within a split, documents in sorted relpath order go round-robin to
`min(N, documents)` shards (M for validation; no shard is empty, an empty split has none):
document k -> shard k mod n, in order. Records shard by unit (a file, or a dataset's source
shard): the units holding documents of a split go round-robin to `min(N, those units)` shards,
each shard their documents in unit and row order, so one file gives one shard per split. A
record's split is by a hash of its text (records.py), so the same documents give the same shards
from any container; a listing pass reads every unit once to count them. Tokenization runs in `--workers` spawned processes
(order preserved), so the output does not depend on W.

On-disk format ("sharenet-arrayrecord-v1", read by sharenet/data/pipeline.py):
  DIR/{split}-{i:05d}-of-{n:05d}.array_record   ArrayRecord files (options `group_size:1`, so
      each record is read on its own), one record per document:
      np.asarray(ids + [eod_id], '<u4').tobytes()
  DIR/meta.json  {"format": "sharenet-arrayrecord-v1", "tokenizer": SPEC as given,
      "vocab_size": int, "eod_id": int, "dtype": "uint32",
      "splits": {"train" | "validation": {"shards": [file names relative to DIR],
                 "documents": int, "tokens": int (EOD included), "bytes": int (UTF-8 bytes of
                 the documents' text)}}}
  DIR/progress.json  the arguments and the finished shards with their counts.

Bad input (a missing column, a value that is not text, a unit without rows, an input that
leaves a split empty) is one error line, and a first run that fails leaves nothing in --out.

Restartable: a shard is written to a `.tmp` name, renamed when complete, then listed in
progress.json; a re-run with the same arguments skips listed shards and writes the rest, and
the result is byte-identical to an uninterrupted run. A re-run with other arguments (input
files and sizes, tokenizer and its file's contents, shard counts, val_fraction) into the same
DIR is a one-line error; --workers may change.

Cost on the shared 2-core development CPU, `--input stdlib --shards 4` (1790 files, 31.5 MB):
bytes tokenizer 6 s with 2 workers (14 MB of shards, zstd); the 4096-id BPE of train_tokenizer
34 s with 1 worker and 18 s with 2 (9.4 M tokens, 3.36 bytes per token; 8.5 MB), identical files.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
from typing import Any, Callable

import numpy as np

from sharenet.config import cli
from sharenet.data import arrayrecord, corpus, records, tokenizer as tokenizer_lib
from sharenet.errors import ConfigError

FORMAT = 'sharenet-arrayrecord-v1'
SPLITS = corpus.SPLITS
WRITER_OPTIONS = 'group_size:1'
_BATCH_DOCS = 16   # documents per worker task


def shard_name(split: str, i: int, n: int) -> str:
  return f'{split}-{i:05d}-of-{n:05d}.array_record'


def list_documents(input_glob: str, val_fraction: float, max_documents: int = 0
                   ) -> tuple[str, dict[str, list[str]]]:
  """(root, {'train': relpaths, 'validation': relpaths}), each sorted and neither empty; with
  `max_documents` > 0 the train split is its first that many (validation stays whole, so an
  evaluation on it is the full run's)."""
  if input_glob == 'stdlib':
    root, docs = corpus.stdlib_splits()
  else:
    root, docs = corpus.text_splits(input_glob, '--input', val_fraction)
  mixed = [rel for d in docs.values() for rel in d if rel.endswith(records.SUFFIXES)]
  if mixed:
    raise ConfigError(f'--input={input_glob!r} matches {mixed[0]}, a record file, beside text '
                      f'files; valid: one kind per --input (a glob ending in '
                      f'{", ".join(records.SUFFIXES)}, or text files)')
  if max_documents:
    docs = {**docs, 'train': docs['train'][:max_documents]}
  for split in SPLITS:
    if not docs[split]:
      raise ConfigError(f'--input={input_glob!r}: --val_fraction={val_fraction} leaves the '
                        f'{split} split without a document (of {sum(map(len, docs.values()))});'
                        f' valid: {_filling_fractions(docs, split)}')
  return root, docs


def _filling_fractions(docs: dict[str, list[str]], empty: str) -> str:
  """The --val_fraction values that give the `empty` split a document (4 decimals, inside)."""
  places = [corpus.path_fraction(rel) for d in docs.values() for rel in d]
  if empty == 'validation':   # validation iff place < val_fraction
    return f'--val_fraction >= {math.floor(min(places) * 1e4 + 1) / 1e4:.4f}, or more documents'
  return f'--val_fraction <= {math.floor(max(places) * 1e4) / 1e4:.4f}'


def _fingerprint(input_glob: str, spec: str, root: str, docs: dict[str, list[str]],
                 shards: int, val_shards: int, val_fraction: float,
                 max_documents: int = 0) -> dict[str, Any]:
  """Everything the output depends on (not --workers); a re-run must match it."""
  listing = hashlib.sha256()
  for split in SPLITS:
    for rel in docs[split]:
      size = os.path.getsize(os.path.join(root, rel))
      listing.update(f'{split}\0{rel}\0{size}\n'.encode())
  return {'input': input_glob, 'tokenizer': spec,
          'tokenizer_file_sha256': _tokenizer_sha256(spec),
          'documents_sha256': listing.hexdigest(), 'shards': shards, 'val_shards': val_shards,
          'val_fraction': val_fraction if input_glob != 'stdlib' else None,
          **({'max_documents': max_documents} if max_documents else {})}


def _tokenizer_sha256(spec: str) -> str:
  """The tokenizer file's sha256 ('' for bytes): a re-run must use the same file."""
  _, _, path = spec.partition(':')
  return tokenizer_lib.file_sha256(os.path.expanduser(path)) if path else ''


def _copy_tokenizer(spec: str, out: str) -> str:
  """The shards' tokenizer spec, relative to `out`: a file tokenizer is copied into it, so the
  directory stands alone wherever it is mounted (tokenizer.load resolves it against `out`)."""
  kind, _, path = spec.partition(':')
  if spec == 'bytes':
    return spec
  name = 'tokenizer.json' if kind == 'hf' else 'tokenizer.model'
  shutil.copyfile(os.path.expanduser(path), os.path.join(out, name))
  return f'{kind}:{name}'


# Worker side: each process loads the tokenizer once (spawned, so nothing forked from a parent
# that may hold JAX or tokenizers threads).
_WORKER_TOKENIZER: tokenizer_lib.Tokenizer | None = None


def _init_worker(spec: str) -> None:
  global _WORKER_TOKENIZER
  _WORKER_TOKENIZER = tokenizer_lib.load(spec)


def _read_text(path: str) -> tuple[str, bool]:
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except OSError as e:
    raise ConfigError(f'cannot read document {path}: {e.strerror or e}') from None
  text = raw.decode('utf-8', errors='replace')
  return text, len(text.encode('utf-8')) != len(raw)


def _encode_files(paths: list[str]) -> list[tuple[bytes, int, int, bool]]:
  """(record bytes, tokens incl. EOD, UTF-8 bytes, had invalid UTF-8) per path."""
  texts, invalid = zip(*(_read_text(p) for p in paths))
  return _encode(texts, invalid)


def _encode_texts(texts: list[str]) -> list[tuple[bytes, int, int, bool]]:
  """`_encode_files` of texts already read (records)."""
  return _encode(texts, [False] * len(texts))


def _encode(texts, invalid) -> list[tuple[bytes, int, int, bool, int]]:
  tok = _WORKER_TOKENIZER
  out = []
  for text, ids, bad in zip(texts, tok.encode_batch(texts), invalid):
    record = np.append(ids.astype('<u4'), np.asarray([tok.eod_id], '<u4'))
    out.append((record.tobytes(), len(record), len(text.encode('utf-8')), bad, len(record)))
  return out


# Chat templates of prepare --chat_template: per role, the text before and after a message's
# content. chatml (OpenAI's ChatML, used by Qwen and others): <|im_start|>role\n...<|im_end|>\n;
# the loss counts an assistant message's content and its closing <|im_end|>\n.
CHAT_TEMPLATES = {'chatml': lambda role: (f'<|im_start|>{role}\n', '<|im_end|>\n')}


def _segments(item: Any, template: str = 'chatml') -> list[tuple[str, bool]]:
  """A fine-tuning item as (text, counted by the loss) segments: a (prompt, response) pair, or
  a chat conversation rendered with `template`."""
  if isinstance(item[0], str):   # (prompt, response)
    return [(item[0], False), (item[1], True)]
  out = []
  for role, content in item:
    head, tail = CHAT_TEMPLATES[template](role)
    out += [(head, False), (content + tail, role == 'assistant')]
  return out


def _encode_segments(items: list[Any], template: str = 'chatml'
                     ) -> list[tuple[bytes, int, int, bool, int]]:
  """Fine-tuning records: each segment's ids in order, those the loss counts (and the final
  end-of-document id) with arrayrecord.LOSS_BIT set; the bytes and loss tokens counted are the
  counted segments' (bits per byte of what is predicted)."""
  tok = _WORKER_TOKENIZER
  out = []
  for item in items:
    segs = _segments(item, template)
    ids = tok.encode_batch([t for t, _ in segs])
    parts = [i.astype('<u4') | (arrayrecord.LOSS_BIT if counted else np.uint32(0))
             for i, (_, counted) in zip(ids, segs)]
    parts.append(np.asarray([tok.eod_id], '<u4') | arrayrecord.LOSS_BIT)
    record = np.concatenate(parts).astype('<u4')
    n_loss = int((record >> np.uint32(31)).sum())
    n_bytes = sum(len(t.encode('utf-8')) for t, counted in segs if counted)
    out.append((record.tobytes(), len(record), n_bytes, False, n_loss))
  return out


def _write_json(path: str, obj: Any) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.write(json.dumps(obj, indent=2, sort_keys=True) + '\n')
  os.replace(tmp, path)


def _load_progress(out: str, fingerprint: dict[str, Any]) -> dict[str, Any]:
  path = os.path.join(out, 'progress.json')
  if not os.path.exists(path):
    if os.path.isdir(out) and os.listdir(out):
      raise ConfigError(f'--out={out} is a non-empty directory without progress.json; give a new '
                        f'or empty directory')
    return {'args': fingerprint, 'done': {}}
  with open(path) as f:
    progress = json.load(f)
  if progress.get('args') != fingerprint:
    old = progress.get('args', {})
    diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
    raise ConfigError(f'--out={out} was prepared with other arguments (differ: {", ".join(diff)});'
                      f' re-run with the same ones to finish it, or use a new --out')
  return progress


def prepare(input_glob: str, spec: str, out: str, shards: int = 8, val_shards: int = 1,
            val_fraction: float = corpus.TEXT_VAL_FRACTION, workers: int = 1,
            progress_bar: bool = False,
            on_shard_done: Callable[[str], None] | None = None,
            max_documents: int = 0, text_field: str = 'text',
            split: str = 'train', response_field: str = '',
            messages_field: str = '', chat_template: str = 'chatml') -> dict[str, Any]:
  """Writes the shards and meta.json of `input_glob` into `out`; returns the meta dict.

  `text_field` and `split` apply to records (a record glob, or hf:NAME[:CONFIG] and its split);
  with `response_field` each record is a prompt (`text_field`) and a response, and only the
  response's tokens carry loss (meta.json `loss_mask`; sharenet/data/arrayrecord.py); with
  `messages_field` each record is a chat conversation rendered with `chat_template`, its
  assistant messages carrying loss.
  `on_shard_done(name)` runs after each shard this call writes (tests use it to interrupt).
  Returns meta plus, under key 'written' (not in meta.json), the shards this call wrote.
  A first run into a new or empty `out` that fails on bad input leaves `out` as it found it.
  """
  if shards < 1 or val_shards < 1:
    raise ConfigError(f'--shards={shards} and --val_shards={val_shards} must be >= 1')
  if not 0 < val_fraction < 1:
    raise ConfigError(f'--val_fraction={val_fraction} must be in (0, 1)')
  if workers < 1:
    raise ConfigError(f'--workers={workers} must be >= 1')
  if max_documents < 0:
    raise ConfigError(f'--max_documents={max_documents} must be >= 0 (0: all)')
  is_records = records.is_records(input_glob)
  if is_records and max_documents:
    raise ConfigError('--max_documents applies to text globs and stdlib; valid: a records '
                      'input without it (give fewer files)')
  if response_field and messages_field:
    raise ConfigError('--response_field (prompt / response pairs) and --messages_field (chat '
                      'conversations) exclude each other; valid: one of them')
  if chat_template not in CHAT_TEMPLATES:
    raise ConfigError(f'--chat_template={chat_template!r} is unknown; valid: '
                      f'{", ".join(CHAT_TEMPLATES)}')
  if not is_records and (text_field != 'text' or split != 'train' or response_field or
                         messages_field):
    raise ConfigError(f'--text_field / --split / --response_field / --messages_field apply to '
                      f'records (parquet, Arrow, JSON lines, hf:NAME); --input={input_glob!r} is '
                      f'text files')
  tok = tokenizer_lib.load(spec, '--tokenizer')
  created = not os.path.exists(out)
  owned = created or (os.path.isdir(out) and not os.listdir(out))
  try:
    if is_records:
      plan, fingerprint, encode = _record_plan(input_glob, spec, shards, val_shards,
                                               val_fraction, text_field, split, response_field,
                                               messages_field, chat_template)
    else:
      plan, fingerprint, encode = _text_plan(input_glob, spec, shards, val_shards, val_fraction,
                                             max_documents)
    progress = _load_progress(out, fingerprint)
    os.makedirs(out, exist_ok=True)
    written, invalid_utf8 = _write_shards(out, plan, progress, spec, encode, workers,
                                          progress_bar, on_shard_done)
  except ConfigError:   # a run that finished no shard leaves `out` as it found it
    if owned and os.path.isdir(out) and not os.path.exists(os.path.join(out, 'progress.json')):
      if created:
        shutil.rmtree(out)
      else:
        for n in os.listdir(out):
          os.remove(os.path.join(out, n))
    raise

  meta = {'format': FORMAT, 'tokenizer': _copy_tokenizer(spec, out),
          'tokenizer_source': spec, 'vocab_size': tok.vocab_size,
          'eod_id': tok.eod_id, 'dtype': 'uint32', 'splits': {}}
  for s in SPLITS:
    names = [name for split_, name, _ in plan if split_ == s]
    counts = [progress['done'][name] for name in names]
    meta['splits'][s] = {'shards': names,
                         **{k: sum(c[k] for c in counts) for k in ('documents', 'tokens', 'bytes')}}
    if response_field or messages_field:   # bytes are the counted text's: bits per byte of
      meta['splits'][s]['loss_tokens'] = sum(c['loss_tokens'] for c in counts)   # the predicted
  if response_field or messages_field:
    meta['loss_mask'] = True
  _write_json(os.path.join(out, 'meta.json'), meta)
  if invalid_utf8:
    print(f'note: {invalid_utf8} document(s) had invalid UTF-8 bytes (read as U+FFFD)',
          file=sys.stderr)
  return {**meta, 'written': written}


def _text_plan(input_glob, spec, shards, val_shards, val_fraction, max_documents):
  """Text files: (plan [(split, shard name, items: a callable giving its document paths)],
  fingerprint, the worker's encode function)."""
  root, docs = list_documents(input_glob, val_fraction, max_documents)
  fingerprint = _fingerprint(input_glob, spec, root, docs, shards, val_shards, val_fraction,
                             max_documents)
  plan = []
  for split, requested in zip(SPLITS, (shards, val_shards)):
    n = min(requested, len(docs[split]))
    for i in range(n):
      paths = [os.path.join(root, rel) for rel in docs[split][i::n]]
      plan.append((split, shard_name(split, i, n), lambda paths=paths: iter(paths)))
  return plan, fingerprint, _encode_files


def _record_split(item: Any, val_fraction: float) -> str:
  text = item if isinstance(item, str) else '\0'.join(   # a pair or a conversation: all of it
      x if isinstance(x, str) else '\0'.join(x) for x in item)
  return 'validation' if corpus.text_fraction(text) < val_fraction else 'train'


def _record_plan(input_spec, spec, shards, val_shards, val_fraction, text_field, split,
                 response_field='', messages_field='', chat_template='chatml'):
  """Records (sharenet/data/records.py): the plan of `_text_plan` by unit, after a listing pass
  that counts each unit's documents per split (and meets any bad record first)."""
  units = records.units(input_spec, split)
  if messages_field:
    read = lambda u: u.messages(messages_field)
  elif response_field:
    read = lambda u: u.pairs(text_field, response_field)
  else:
    read = lambda u: u.texts(text_field)
  counts = []
  for u in units:
    c = dict.fromkeys(SPLITS, 0)
    for item in read(u):
      c[_record_split(item, val_fraction)] += 1
    counts.append(c)
  for s in SPLITS:
    if not sum(c[s] for c in counts):
      raise ConfigError(f'--input={input_spec!r}: --val_fraction={val_fraction} leaves the {s} '
                        f'split without a document (of {sum(sum(c.values()) for c in counts)}); '
                        f'valid: more documents, or a val_fraction '
                        f'{"above" if s == "validation" else "below"} this one')
  listing = hashlib.sha256()
  for u, c in zip(units, counts):
    listing.update(f'{u.name}\0{u.size}\0{c["train"]}\0{c["validation"]}\n'.encode())
  fingerprint = {'input': input_spec, 'tokenizer': spec,
                 'tokenizer_file_sha256': _tokenizer_sha256(spec),
                 'documents_sha256': listing.hexdigest(), 'shards': shards,
                 'val_shards': val_shards, 'val_fraction': val_fraction,
                 'text_field': text_field, 'split': split}
  if response_field:
    fingerprint['response_field'] = response_field
  if messages_field:
    fingerprint.update(messages_field=messages_field, chat_template=chat_template)

  def texts(held, s):
    for u in held:
      yield from (t for t in read(u) if _record_split(t, val_fraction) == s)

  plan = []
  for s, requested in zip(SPLITS, (shards, val_shards)):
    holding = [u for u, c in zip(units, counts) if c[s]]
    n = min(requested, len(holding))
    for i in range(n):
      plan.append((s, shard_name(s, i, n), lambda held=holding[i::n], s=s: texts(held, s)))
  if messages_field or response_field:
    return plan, fingerprint, functools.partial(_encode_segments, template=chat_template)
  return plan, fingerprint, _encode_texts


def _write_shards(out, plan, progress, spec, encode, workers, progress_bar, on_shard_done):
  """Writes the plan's shards progress.json does not list; (shards written, invalid UTF-8)."""
  todo = [(s, name, items) for s, name, items in plan
          if name not in progress['done'] or not os.path.exists(os.path.join(out, name))]
  written, invalid_utf8 = [], 0
  if not todo:
    return written, invalid_utf8
  from tqdm import tqdm
  bar = tqdm(unit='doc', disable=not progress_bar,
             desc=f'prepare {os.path.basename(os.path.normpath(out))}', file=sys.stderr)
  pool = (multiprocessing.get_context('spawn').Pool(workers, _init_worker, (spec,))
          if workers > 1 else None)
  if pool is None:
    _init_worker(spec)
  try:
    for split, name, items in todo:
      invalid_utf8 += _write_shard(out, name, items(), encode, pool, bar, progress, split)
      written.append(name)
      if on_shard_done is not None:
        on_shard_done(name)
  finally:
    bar.close()
    if pool is not None:
      pool.terminate()
      pool.join()
  return written, invalid_utf8


def _batches(items, size: int = _BATCH_DOCS):
  batch = []
  for item in items:
    batch.append(item)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def _write_shard(out: str, name: str, items, encode, pool: Any, bar: Any,
                 progress: dict[str, Any], split: str) -> int:
  """Writes one shard (temp name, then rename) and records it in progress.json; `items`
  (document paths, or texts) go to the workers' `encode` in batches."""
  from array_record.python.array_record_module import ArrayRecordWriter
  batches = _batches(items)
  results = pool.imap(encode, batches) if pool is not None else map(encode, batches)
  tmp = os.path.join(out, name + '.tmp')
  writer = ArrayRecordWriter(tmp, WRITER_OPTIONS)
  counts = {'documents': 0, 'tokens': 0, 'bytes': 0, 'loss_tokens': 0}
  invalid = 0
  try:
    for batch in results:
      for record, n_tokens, n_bytes, bad, n_loss in batch:
        writer.write(record)
        counts['documents'] += 1
        counts['tokens'] += n_tokens
        counts['bytes'] += n_bytes
        counts['loss_tokens'] += n_loss
        invalid += bad
      bar.update(len(batch))
  except BaseException:
    writer.close()
    os.remove(tmp)   # nothing half-written stays
    raise
  writer.close()
  os.replace(tmp, os.path.join(out, name))
  progress['done'][name] = {'split': split, **counts}
  _write_json(os.path.join(out, 'progress.json'), progress)
  return invalid


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {" ".join(argv[1:3])}...; quote the --input glob '
                      f"so the shell does not expand it: --input 'DIR/**/*.txt'")
  if _INPUT.value == 'stdlib' and flags.FLAGS['val_fraction'].present:
    raise ConfigError('--val_fraction does not apply to --input stdlib (its split is '
                      'corpus.is_val_file)')
  meta = prepare(_INPUT.value, _TOKENIZER.value, _OUT.value, _SHARDS.value, _VAL_SHARDS.value,
                 _VAL_FRACTION.value, _WORKERS.value, progress_bar=True,
                 max_documents=_MAX_DOCUMENTS.value, text_field=_TEXT_FIELD.value,
                 split=_SPLIT.value, response_field=_RESPONSE_FIELD.value,
                 messages_field=_MESSAGES_FIELD.value, chat_template=_CHAT_TEMPLATE.value)
  for split, s in meta['splits'].items():
    print(f'{split}: {s["documents"]} documents, {s["tokens"]} tokens, {s["bytes"]} bytes, '
          f'{len(s["shards"])} shards')
  print(f'wrote {len(meta["written"])} shards; {os.path.join(_OUT.value, "meta.json")}')


if __name__ == '__main__':
  from absl import flags

  _INPUT = flags.DEFINE_string('input', None, "Quoted glob of text files (one file = one "
                               "document), of parquet / .arrow / .jsonl[.gz] / .json.gz files "
                               "(one row = one document), hf:NAME[:CONFIG] (a Hugging Face "
                               "dataset, streamed), or 'stdlib' for the embedded corpus.",
                               required=True)
  _TEXT_FIELD = flags.DEFINE_string('text_field', 'text', 'Records: the column of the text.')
  _RESPONSE_FIELD = flags.DEFINE_string('response_field', '', 'Records: fine-tuning pairs, the '
                                        'prompt in --text_field and the response here; only '
                                        'the response\'s tokens carry loss.')
  _MESSAGES_FIELD = flags.DEFINE_string('messages_field', '', 'Records: chat conversations '
                                        '(lists of {role, content}) in this column; only the '
                                        'assistant messages carry loss.')
  _CHAT_TEMPLATE = flags.DEFINE_string('chat_template', 'chatml', 'The template that renders '
                                       '--messages_field conversations: chatml.')
  _SPLIT = flags.DEFINE_string('split', 'train', 'hf:NAME: the dataset split to read (its '
                               'documents are then split into train / validation by hash).')
  _TOKENIZER = flags.DEFINE_string('tokenizer', 'bytes', 'bytes | sentencepiece:PATH | hf:PATH.')
  _OUT = flags.DEFINE_string('out', None, 'Output directory.', required=True)
  _SHARDS = flags.DEFINE_integer('shards', 8, 'Train shards (fewer if fewer documents).')
  _VAL_SHARDS = flags.DEFINE_integer('val_shards', 1, 'Validation shards.')
  _VAL_FRACTION = flags.DEFINE_float('val_fraction', corpus.TEXT_VAL_FRACTION,
                                     'Expected fraction of documents in validation (by a hash '
                                     'of the path, as data.source=text); not for stdlib.')
  _MAX_DOCUMENTS = flags.DEFINE_integer('max_documents', 0, 'Only the first N train documents '
                                        '(a quick trial; validation stays whole); 0: all.')
  _WORKERS = flags.DEFINE_integer('workers', os.cpu_count() or 1,
                                  'Tokenizer processes; 1 tokenizes in this process.')
  cli.run(main)
