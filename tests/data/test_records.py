"""prepare from records (sharenet/data/records.py): parquet, Arrow, JSON lines and a local
Hugging Face dataset give the same shards for the same documents; a killed prepare resumes to
byte-identical shards; bad input is one line and leaves nothing in --out; a model trains on
the shards."""
import gzip
import json
import os

import numpy as np
import pytest

from sharenet.data import prepare as prep
from sharenet.data import records
from sharenet.errors import ConfigError

pa = pytest.importorskip('pyarrow')
pq = pytest.importorskip('pyarrow.parquet')

TEXTS = [f'document {i}: ' + ' '.join(f'w{(i * 7 + j) % 23}' for j in range(5 + i % 9))
         for i in range(60)] + ['caf\u00e9 \u2014 unicode text']


def _shards(out):
  """{file name: bytes} of the shards and meta.json's splits."""
  with open(os.path.join(out, 'meta.json')) as f:
    meta = json.load(f)
  files = {n: open(os.path.join(out, n), 'rb').read()
           for s in meta['splits'].values() for n in s['shards']}
  return files, meta['splits']


def _write_jsonl(path, rows, compress=False):
  opener = gzip.open if compress else open
  with opener(path, 'wt', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)


@pytest.fixture(scope='module')
def containers(tmp_path_factory):
  """The same documents (with an extra column) as parquet, Arrow IPC stream, JSON lines (plain
  and gzip) and a local dataset directory (a parquet file `datasets` reads)."""
  d = tmp_path_factory.mktemp('records')
  rows = [{'id': i, 'text': t} for i, t in enumerate(TEXTS)]
  table = pa.Table.from_pylist(rows)
  pq.write_table(table, d / 'docs.parquet', row_group_size=16)
  with pa.OSFile(str(d / 'docs.arrow'), 'wb') as sink:
    with pa.ipc.new_stream(sink, table.schema) as writer:
      writer.write_table(table, max_chunksize=16)
  _write_jsonl(d / 'docs.jsonl', rows)
  _write_jsonl(d / 'docs.jsonl.gz', rows, compress=True)
  (d / 'dataset').mkdir()
  pq.write_table(table, d / 'dataset' / 'train.parquet')
  return d


def test_every_container_gives_the_same_shards(containers, tmp_path):
  """Each container's prepare writes the same bytes: the split goes by the text's hash, the
  order by row, and every document is in exactly one split once."""
  inputs = [str(containers / n) for n in ('docs.parquet', 'docs.arrow', 'docs.jsonl',
                                          'docs.jsonl.gz')]
  inputs.append('hf:' + str(containers / 'dataset'))
  pytest.importorskip('datasets')
  results = []
  for i, spec in enumerate(inputs):
    out = str(tmp_path / f'out{i}')
    prep.prepare(spec, 'bytes', out, shards=2, val_fraction=0.2)
    results.append(_shards(out))
  files, splits = results[0]
  for spec, (other_files, other_splits) in zip(inputs[1:], results[1:]):
    assert other_files == files, spec
    assert other_splits == splits, spec
  assert splits['train']['documents'] + splits['validation']['documents'] == len(TEXTS)
  assert splits['validation']['documents'] > 0
  assert splits['train']['bytes'] + splits['validation']['bytes'] == sum(
      len(t.encode()) for t in TEXTS)
  assert len(splits['train']['shards']) == 1   # one file: one unit, one shard per split


def test_records_decode_to_their_documents_in_row_order(containers, tmp_path):
  from array_record.python.array_record_data_source import ArrayRecordDataSource
  out = str(tmp_path / 'out')
  meta = prep.prepare(str(containers / 'docs.jsonl'), 'bytes', out, val_fraction=0.2)
  decoded = []
  for split in ('train', 'validation'):
    for name in meta['splits'][split]['shards']:
      source = ArrayRecordDataSource(os.path.join(out, name))
      for i in range(len(source)):
        ids = np.frombuffer(source[i], '<u4')
        assert ids[-1] == meta['eod_id']
        decoded.append((split, bytes(ids[:-1].astype(np.uint8)).decode()))
  assert sorted(t for _, t in decoded) == sorted(TEXTS)
  train = [t for s, t in decoded if s == 'train']
  assert train == [t for t in TEXTS if t in set(train)]   # row order


def test_a_killed_prepare_resumes_to_the_same_shards(containers, tmp_path):
  """Three JSON-lines files, three train shards: interrupted after the first shard, rerun
  with the same flags, the result is byte-identical to an uninterrupted run."""
  src = tmp_path / 'src'
  src.mkdir()
  for k in range(3):
    _write_jsonl(src / f'part{k}.jsonl', [{'text': t} for t in TEXTS[k::3]])
  spec = str(src / '*.jsonl')
  whole = str(tmp_path / 'whole')
  prep.prepare(spec, 'bytes', whole, shards=3, val_fraction=0.2)

  class Killed(Exception):
    pass

  def kill(name):
    raise Killed(name)

  part = str(tmp_path / 'part')
  with pytest.raises(Killed):
    prep.prepare(spec, 'bytes', part, shards=3, val_fraction=0.2, on_shard_done=kill)
  assert not [n for n in os.listdir(part) if n.endswith('.tmp')]
  meta = prep.prepare(spec, 'bytes', part, shards=3, val_fraction=0.2)
  assert len(meta['written']) == 3   # the two train shards left and validation
  assert _shards(part) == _shards(whole)
  assert len(_shards(whole)[1]['train']['shards']) == 3


def _bad(tmp_path):
  d = tmp_path / 'bad'
  d.mkdir()
  _write_jsonl(d / 'no_column.jsonl', [{'body': 'x'}])
  _write_jsonl(d / 'number.jsonl', [{'text': 'fine'}, {'text': 3}])
  (d / 'empty.jsonl').write_text('')
  (d / 'garbage.jsonl').write_text('{"text": "a"}\nnot json\n')
  (d / 'garbage.parquet').write_bytes(b'not a parquet file')
  (d / 'notes.txt').write_text('text')
  (d / 'list.jsonl').write_text('[1, 2]\n')
  return d


@pytest.mark.parametrize('name,kwargs,match', [
    ('no_column.jsonl', {}, r"no_column.jsonl row 0: no column 'text' \(it has: body\); valid"),
    ('no_column.jsonl', {'text_field': 'body', 'val_fraction': 0.5},
     'leaves the (train|validation) split without a document'),
    ('number.jsonl', {}, r"number.jsonl row 1: --text_field='text' holds int, not text"),
    ('empty.jsonl', {}, 'empty.jsonl: no rows'),
    ('garbage.jsonl', {}, 'garbage.jsonl line 2: not JSON'),
    ('list.jsonl', {}, 'list.jsonl line 1: a JSON list, not an object'),
    ('garbage.parquet', {}, 'garbage.parquet: cannot read it as parquet'),
    ('*', {}, 'a record file, beside text files; valid: one kind'),
    ('missing*.parquet', {}, 'matches no files'),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, name, kwargs, match):
  d = _bad(tmp_path)
  out = tmp_path / 'out'
  with pytest.raises(ConfigError, match=match) as e:
    prep.prepare(str(d / name), 'bytes', str(out), **kwargs)
  assert '\n' not in str(e.value)
  assert not out.exists()
  out.mkdir()   # an empty directory given as --out stays empty
  with pytest.raises(ConfigError):
    prep.prepare(str(d / name), 'bytes', str(out), **kwargs)
  assert os.listdir(out) == []


def test_cli_reads_the_text_field(containers, tmp_path, subprocess_env):
  """python -m sharenet.data.prepare --text_field: the column named on the command line."""
  import subprocess
  import sys
  src = tmp_path / 'body.jsonl'
  _write_jsonl(src, [{'body': t, 'text': 'other'} for t in TEXTS])
  out = tmp_path / 'out'
  run = subprocess.run([sys.executable, '-m', 'sharenet.data.prepare', '--input', str(src),
                        '--text_field', 'body', '--out', str(out), '--val_fraction', '0.2',
                        '--workers', '1'], capture_output=True, text=True, env=subprocess_env,
                       timeout=120)
  assert run.returncode == 0, run.stderr
  ref = tmp_path / 'ref'
  _write_jsonl(tmp_path / 'ref.jsonl', [{'text': t} for t in TEXTS])
  prep.prepare(str(tmp_path / 'ref.jsonl'), 'bytes', str(ref), val_fraction=0.2)
  assert _shards(str(out))[0] == _shards(str(ref))[0]


def test_flags_that_do_not_apply_are_one_line(containers, tmp_path):
  with pytest.raises(ConfigError, match='--max_documents applies to text globs'):
    prep.prepare(str(containers / 'docs.jsonl'), 'bytes', str(tmp_path / 'a'), max_documents=3)
  with pytest.raises(ConfigError, match='apply to records'):
    prep.prepare(str(containers / '*.txt'), 'bytes', str(tmp_path / 'b'), text_field='body')
  pytest.importorskip('datasets')
  with pytest.raises(ConfigError, match='cannot load it'):
    prep.prepare('hf:' + str(tmp_path / 'nowhere'), 'bytes', str(tmp_path / 'c'))
  assert records.is_records('hf:x') and records.is_records('a/*.json.gz')
  assert not records.is_records('a/*.txt')


@pytest.mark.slow
def test_a_model_trains_on_prepared_records(containers, tmp_path, tiny_config, losses):
  from sharenet.train import loop
  out = str(tmp_path / 'shards')
  prep.prepare(str(containers / 'docs.parquet'), 'bytes', out, val_fraction=0.2)
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(tiny_config(**{
      'data.source': 'arrayrecord', 'data.path': out, 'model.vocab_size': 257,
      'train.steps': 3, 'train.seq_len': 16, 'train.batch_size': 2,
      'train.eval_batch_size': 2}), workdir)
  assert all(np.isfinite(v) for v in losses(workdir).values())
