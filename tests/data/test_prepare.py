"""python -m sharenet.data.prepare: the on-disk format (meta.json and one ArrayRecord record per
document), counts checked against the source files, determinism, restarts, one-line errors."""
import glob
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader

from sharenet.data import corpus
from sharenet.data import prepare
from sharenet.data import train_tokenizer
from sharenet.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INVALID_UTF8 = b'caf\xe9 latin-1\n'   # 0xE9 alone is not UTF-8 -> U+FFFD (3 bytes)


@pytest.fixture
def docs_dir(tmp_path):
  """12 small text files in nested folders (non-ASCII, an empty one, one invalid UTF-8)."""
  root = tmp_path / 'docs'
  contents = {f'a/doc{i:02d}.txt': (f'document {i}: ' + 'héllo ✓ ' * i + '\n').encode()
              for i in range(9)}
  contents['b/c/deep.txt'] = 'deep 日本語\n\tend'.encode()
  contents['b/empty.txt'] = b''
  contents['b/latin1.txt'] = INVALID_UTF8
  for rel, data in contents.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)
  return root, contents


def _records(path):
  reader = ArrayRecordReader(str(path))
  out = [np.frombuffer(r, '<u4') for r in reader.read_all()]
  reader.close()
  return out


def _files(directory):
  return {os.path.relpath(p, directory): open(p, 'rb').read()
          for p in glob.glob(os.path.join(directory, '*'))}


def _utf8_size(data):
  return len(data.decode('utf-8', errors='replace').encode())


def test_meta_counts_and_every_document_once(docs_dir, tmp_path):
  root, contents = docs_dir
  out = tmp_path / 'out'
  meta = prepare.prepare(f'{root}/**/*.txt', 'bytes', str(out), shards=3, val_shards=2,
                         val_fraction=0.3)
  on_disk = json.loads((out / 'meta.json').read_text())
  assert on_disk == {k: v for k, v in meta.items() if k != 'written'}
  assert set(on_disk) == {'format', 'tokenizer', 'tokenizer_source', 'vocab_size', 'eod_id',
                          'dtype', 'splits'}
  assert (on_disk['format'], on_disk['tokenizer'], on_disk['vocab_size'], on_disk['eod_id'],
          on_disk['dtype']) == ('sharenet-arrayrecord-v1', 'bytes', 257, 256, 'uint32')
  seen = {}
  for split, info in on_disk['splits'].items():
    assert set(info) == {'shards', 'documents', 'tokens', 'bytes'}
    n = len(info['shards'])
    assert info['shards'] == [f'{split}-{i:05d}-of-{n:05d}.array_record' for i in range(n)]
    records = [r for name in info['shards'] for r in _records(out / name)]
    assert all(len(_records(out / name)) for name in info['shards'])  # no shard is empty
    assert info['documents'] == len(records)
    assert info['tokens'] == sum(len(r) for r in records)
    for r in records:
      assert r[-1] == 256 and 256 not in r[:-1].tolist()
      text = r[:-1].astype(np.uint8).tobytes()
      seen.setdefault(text, []).append(split)
    want = [rel for rel in contents if corpus.is_val_path(rel, 0.3) == (split == 'validation')]
    assert info['documents'] == len(want) > 0
    assert info['bytes'] == sum(_utf8_size(contents[rel]) for rel in want)
  # Byte ids are the documents' UTF-8: each file's text appears in exactly one record.
  expected = [d.decode('utf-8', errors='replace').encode() for d in contents.values()]
  assert sorted(seen) == sorted(expected)
  assert all(len(v) == 1 for v in seen.values())
  total_bytes = sum(s['bytes'] for s in on_disk['splits'].values())
  assert total_bytes == sum(len(d) for d in contents.values()) + 2   # U+FFFD is 3 bytes, not 1


def test_shards_are_round_robin_in_path_order(docs_dir, tmp_path):
  root, contents = docs_dir
  prepare.prepare(f'{root}/**/*.txt', 'bytes', str(tmp_path / 'out'), shards=4, val_fraction=0.3)
  meta = json.loads((tmp_path / 'out' / 'meta.json').read_text())
  order = sorted(rel for rel in contents if not corpus.is_val_path(rel, 0.3))
  assert meta['splits']['train']['documents'] == len(order) > 4
  for i, name in enumerate(meta['splits']['train']['shards']):
    got = [r[:-1].astype(np.uint8).tobytes() for r in _records(tmp_path / 'out' / name)]
    assert got == [contents[rel].decode('utf-8', 'replace').encode() for rel in order[i::4]]


def test_hf_tokenized_records_decode_to_the_documents(docs_dir, tmp_path):
  root, contents = docs_dir
  spec = train_tokenizer.train_to_dir([d.decode('utf-8', 'replace') for d in contents.values()],
                                      300, str(tmp_path / 'tok'))
  from sharenet.data import tokenizer as tokenizer_lib
  tok = tokenizer_lib.load(spec)
  meta = prepare.prepare(f'{root}/**/*.txt', spec, str(tmp_path / 'out'), shards=2,
                         val_fraction=0.3)
  assert (meta['tokenizer'], meta['tokenizer_source'], meta['vocab_size'], meta['eod_id']) == (
      'hf:tokenizer.json', spec, 300, tok.eod_id)
  # The shard directory carries its own copy of the tokenizer, named relative to it.
  own = tokenizer_lib.load(meta['tokenizer'], base_dir=str(tmp_path / 'out'))
  assert own.encode("def f(x):\n  return x").tolist() == tok.encode('def f(x):\n  return x').tolist()
  texts = []
  for info in meta['splits'].values():
    for name in info['shards']:
      for r in _records(tmp_path / 'out' / name):
        assert r[-1] == tok.eod_id
        texts.append(tok.decode(r[:-1]))
  assert sorted(texts) == sorted(d.decode('utf-8', 'replace') for d in contents.values())


def test_reruns_are_byte_identical_and_skip_finished_shards(docs_dir, tmp_path):
  root, _ = docs_dir
  args = dict(input_glob=f'{root}/**/*.txt', spec='bytes', shards=3, val_fraction=0.3)
  full = prepare.prepare(out=str(tmp_path / 'full'), **args)
  assert len(full['written']) == 4
  again = prepare.prepare(out=str(tmp_path / 'full'), **args)
  assert again['written'] == []

  class Interrupt(Exception):
    pass

  def stop(name):
    raise Interrupt(name)

  part = tmp_path / 'part'
  with pytest.raises(Interrupt):
    prepare.prepare(out=str(part), on_shard_done=stop, **args)
  first = full['splits']['train']['shards'][0]
  assert json.loads((part / 'progress.json').read_text())['done'].keys() == {first}
  assert not (part / 'meta.json').exists()
  # A half-written shard of a killed run is redone, not trusted.
  (part / (full['splits']['train']['shards'][1] + '.tmp')).write_bytes(b'partial')
  stat = os.stat(part / first)
  resumed = prepare.prepare(out=str(part), **args)
  assert resumed['written'] == full['written'][1:]
  assert (os.stat(part / first).st_mtime_ns, os.stat(part / first).st_ino) == (
      stat.st_mtime_ns, stat.st_ino)
  assert _files(part) == _files(tmp_path / 'full')   # no .tmp left; progress.json equal too


def test_other_arguments_into_the_same_dir_is_one_line(docs_dir, tmp_path):
  root, _ = docs_dir
  prepare.prepare(f'{root}/**/*.txt', 'bytes', str(tmp_path / 'out'), shards=2,
                  val_fraction=0.3)
  with pytest.raises(ConfigError, match=r'prepared with other arguments \(differ: shards\)'):
    prepare.prepare(f'{root}/**/*.txt', 'bytes', str(tmp_path / 'out'), shards=3,
                    val_fraction=0.3)
  (root / 'a' / 'doc00.txt').write_text('changed length')
  with pytest.raises(ConfigError, match=r'differ: documents_sha256'):
    prepare.prepare(f'{root}/**/*.txt', 'bytes', str(tmp_path / 'out'), shards=2,
                    val_fraction=0.3)
  (tmp_path / 'other').mkdir()
  (tmp_path / 'other' / 'x').write_text('')
  with pytest.raises(ConfigError, match='non-empty directory without progress.json'):
    prepare.prepare(f'{root}/**/*.txt', 'bytes', str(tmp_path / 'other'), val_fraction=0.3)


def test_max_documents_takes_the_first_train_documents_and_all_validation(docs_dir, tmp_path):
  """--max_documents N: the first N train documents in path order, the validation split whole;
  the same directory with another N (or none) is the one line naming max_documents."""
  root, _ = docs_dir
  full = prepare.prepare(f'{root}/**/*.txt', 'bytes', str(tmp_path / 'full'), val_fraction=0.3)
  _, docs = prepare.list_documents(f'{root}/**/*.txt', 0.3)
  assert len(docs['train']) > 3
  assert prepare.list_documents(f'{root}/**/*.txt', 0.3, 3)[1] == {**docs,
                                                                  'train': docs['train'][:3]}
  out = str(tmp_path / 'three')
  part = prepare.prepare(f'{root}/**/*.txt', 'bytes', out, val_fraction=0.3, max_documents=3)
  assert part['splits']['train']['documents'] == 3
  assert part['splits']['validation'] == full['splits']['validation']
  for other in (2, 0):
    with pytest.raises(ConfigError, match=r'other arguments \(differ: documents_sha256, '
                                          r'max_documents\)'):
      prepare.prepare(f'{root}/**/*.txt', 'bytes', out, val_fraction=0.3, max_documents=other)


@pytest.mark.parametrize('kwargs,match', [
    (dict(input_glob='{root}/*.nothing'), 'matches no files'),
    (dict(max_documents=-1), r'--max_documents=-1 must be >= 0'),
    (dict(shards=0), '--shards=0'),
    (dict(val_fraction=1.0), r'--val_fraction=1.0 must be in \(0, 1\)'),
    (dict(val_fraction=-0.1), r'--val_fraction=-0.1 must be in \(0, 1\)'),
    (dict(val_fraction=0.0), r'--val_fraction=0.0 must be in \(0, 1\)'),
    (dict(val_fraction=0.999999), r'--val_fraction=0.999999 leaves the train split without a '
                                  r'document \(of 12\); valid: --val_fraction <= 0\.'),
    (dict(spec='hf:/nonexistent.json'), "--tokenizer='hf:/nonexistent.json': no such file"),
])
def test_bad_input_is_a_one_line_config_error(docs_dir, tmp_path, kwargs, match):
  root, _ = docs_dir
  args = dict(input_glob=f'{root}/**/*.txt', spec='bytes', out=str(tmp_path / 'out'))
  args.update({k: v.format(root=root) if isinstance(v, str) else v for k, v in kwargs.items()})
  with pytest.raises(ConfigError, match=match) as e:
    prepare.prepare(**args)
  assert '\n' not in str(e.value)


def _names(n, val, prefix=''):
  """The first n names 'd{i}.txt' whose relpath prefix + name is (val) / is not validation."""
  names = (f'd{i}.txt' for i in itertools.count())
  return list(itertools.islice((x for x in names if corpus.is_val_path(prefix + x) == val), n))


def test_a_split_without_a_document_fails_at_prepare_time(tmp_path):
  """40 files none of which the default fraction sends to validation: refused here, naming
  --val_fraction (train.py would refuse the shards), and the value it suggests works."""
  (tmp_path / 'docs').mkdir()
  for name in _names(40, val=False):
    (tmp_path / 'docs' / name).write_text(name)
  glob_ = f'{tmp_path}/docs/*.txt'
  with pytest.raises(ConfigError, match=r'--val_fraction=0.02 leaves the validation split '
                     r'without a document \(of 40\); valid: --val_fraction >= ') as e:
    prepare.prepare(glob_, 'bytes', str(tmp_path / 'out'))
  assert '\n' not in str(e.value) and not (tmp_path / 'out').exists()
  fraction = float(str(e.value).split('>= ')[1].split(',')[0])
  meta = prepare.prepare(glob_, 'bytes', str(tmp_path / 'out'), val_fraction=fraction)
  assert meta['splits']['validation']['documents'] >= 1


def test_text_source_and_prepare_split_a_glob_alike(tmp_path):
  """data.source=text and prepare (default --val_fraction) put the same files in validation:
  each split's bytes (files in path order) equal its shard's records (EOD dropped)."""
  (tmp_path / 'docs' / 'sub').mkdir(parents=True)
  (tmp_path / 'docs' / 'top.txt').write_text('top\n')   # relpaths 'top.txt', 'sub/NAME'
  for name in _names(2, True, 'sub/') + _names(20, False, 'sub/'):
    (tmp_path / 'docs' / 'sub' / name).write_text(f'{name}\n' * 3)
  glob_ = f'{tmp_path}/docs/**/*.txt'
  meta = prepare.prepare(glob_, 'bytes', str(tmp_path / 'out'), shards=1)
  text = corpus.load_splits({'source': 'text', 'path': glob_})
  for split, tokens in zip(('train', 'validation'), text):
    [shard] = meta['splits'][split]['shards']
    records = _records(tmp_path / 'out' / shard)
    assert len(records) >= 2
    assert b''.join(r[:-1].astype(np.uint8).tobytes() for r in records) == tokens.tobytes()


def test_an_unreadable_document_is_one_line(tmp_path):
  with pytest.raises(ConfigError, match=f'cannot read document {tmp_path}/gone.txt: No such file'):
    prepare._read_text(str(tmp_path / 'gone.txt'))


def test_stdlib_input_uses_the_corpus_split():
  root, docs = prepare.list_documents('stdlib', 0.5)
  assert root == corpus.stdlib_files()[0]
  assert docs['validation'] == [r for r in corpus.stdlib_files()[1] if corpus.is_val_file(r)]
  assert docs['train'] == [r for r in corpus.stdlib_files()[1] if not corpus.is_val_file(r)]


@pytest.mark.slow
def test_cli_with_worker_processes_matches_in_process_output(docs_dir, tmp_path):
  root, _ = docs_dir
  prepare.prepare(f'{root}/**/*.txt', 'bytes', str(tmp_path / 'inproc'), shards=2,
                  val_fraction=0.3, workers=1)
  cmd = [sys.executable, '-m', 'sharenet.data.prepare', f'--input={root}/**/*.txt',
         '--tokenizer=bytes', f'--out={tmp_path / "cli"}', '--shards=2', '--val_fraction=0.3',
         '--workers=2']
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  assert 'wrote 3 shards' in proc.stdout
  assert _files(tmp_path / 'cli') == _files(tmp_path / 'inproc')
  bad = subprocess.run(cmd[:4] + [f'--out={tmp_path / "x"}', '--shards=0'], cwd=ROOT,
                       capture_output=True, text=True)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines() == ['error: --shards=0 and --val_shards=1 must be >= 1']


@pytest.mark.slow
def test_cli_an_unquoted_glob_is_one_line(docs_dir, tmp_path):
  root, contents = docs_dir
  files = sorted(str(root / rel) for rel in contents if rel.startswith('a/'))
  proc = subprocess.run([sys.executable, '-m', 'sharenet.data.prepare', '--input', *files,
                         f'--out={tmp_path / "out"}'], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 2
  assert len(proc.stderr.strip().splitlines()) == 1
  assert 'unexpected arguments' in proc.stderr and 'quote the --input glob' in proc.stderr
  assert not (tmp_path / 'out').exists()
