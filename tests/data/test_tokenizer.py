"""Tokenizers (sharenet/data/tokenizer.py) and BPE training (sharenet/data/train_tokenizer.py):
round trips, EOD ids read independently from the files, bad specs as one-line ConfigErrors."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sharenet.data import corpus
from sharenet.data import tokenizer as tokenizer_lib
from sharenet.data import train_tokenizer
from sharenet.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_TEXT = ('def f(x):\n    return x + 1  # héllo wörld ✓ 日本語\n\n\tclass A:\n        pass\n'
              'print("spam and eggs", 3.14)\n') * 20
TEXTS = ['plain ascii text, with  two spaces\n', 'non-ASCII: héllo wörld ✓ 日本語 € 😀\n\tend',
         '', ' leading space', 'zebra quartz \x00 control']


@pytest.fixture(scope='module')
def hf_path(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('hf'))
  spec = train_tokenizer.train_to_dir([TRAIN_TEXT], 300, out)
  assert spec == f'hf:{out}/tokenizer.json'
  return os.path.join(out, 'tokenizer.json')


def _train_sentencepiece(path, **options):
  import sentencepiece
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(TRAIN_TEXT.splitlines()), model_writer=model, vocab_size=320,
      model_type='bpe', byte_fallback=True, normalization_rule_name='identity',
      remove_extra_whitespaces=False, character_coverage=1.0, minloglevel=2, **options)
  with open(path, 'wb') as f:
    f.write(model.getvalue())
  return path


@pytest.fixture(scope='module')
def sp_path(tmp_path_factory):
  return _train_sentencepiece(str(tmp_path_factory.mktemp('sp') / 'sp.model'))


@pytest.fixture(scope='module')
def specs(hf_path, sp_path):
  return {'bytes': 'bytes', 'hf': f'hf:{hf_path}', 'sentencepiece': f'sentencepiece:{sp_path}'}


@pytest.mark.parametrize('kind', ['bytes', 'hf', 'sentencepiece'])
@pytest.mark.parametrize('text', TEXTS)
def test_encode_decode_round_trip(specs, kind, text):
  tok = tokenizer_lib.load(specs[kind])
  ids = tok.encode(text)
  assert ids.dtype == np.uint32 and ids.ndim == 1
  assert ids.size == 0 or int(ids.max()) < tok.vocab_size
  assert tok.eod_id not in ids.tolist()
  assert tok.decode(ids) == text


@pytest.mark.parametrize('kind', ['bytes', 'hf', 'sentencepiece'])
def test_encode_batch_matches_encode_and_eod_decodes_to_its_token(specs, kind):
  tok = tokenizer_lib.load(specs[kind])
  batch = tok.encode_batch(TEXTS)
  assert [b.dtype for b in batch] == [np.uint32] * len(TEXTS)
  assert [b.tolist() for b in batch] == [tok.encode(t).tolist() for t in TEXTS]
  joined = np.concatenate([batch[0], [tok.eod_id], batch[1]])
  assert tok.decode(joined) == TEXTS[0] + tok.eod_token + TEXTS[1]


def test_bytes_ids_are_utf8_bytes_and_eod_is_256():
  tok = tokenizer_lib.load('bytes')
  assert (tok.vocab_size, tok.eod_id, tok.spec) == (257, 256, 'bytes')
  assert tok.encode('é✓a').tolist() == [0xC3, 0xA9, 0xE2, 0x9C, 0x93, ord('a')]


def test_decode_never_raises():
  tok = tokenizer_lib.load('bytes')
  # A truncated 3-byte sequence, a lone continuation byte, EOD, out-of-range and negative ids.
  assert tok.decode([ord('a'), 0xE2, 0x9C, ord('x'), 0x80, 256, 999, -3, ord('b')]) == (
      'a\\xe2\\x9cx\\x80<|endoftext|>\ufffd\ufffdb')


def test_one_byte_mapping_for_the_corpus_the_tokenizer_and_generate(tmp_path):
  from sharenet.inference import generate
  from sharenet.data import corpus
  text = TEXTS[1] * 30
  (tmp_path / 'a.txt').write_text(text, encoding='utf-8')
  train, val = corpus.load_splits({'source': 'text', 'path': str(tmp_path / 'a.txt')})
  ids = tokenizer_lib.load('bytes').encode(text).tolist()
  assert np.concatenate([train, val]).tolist() == ids == generate.encode(text)
  assert generate.decode(ids + [0xE2]) == tokenizer_lib.load('bytes').decode(ids + [0xE2]) == (
      text + '\\xe2')


def test_decode_never_raises_hf_and_sentencepiece(specs):
  for kind in ('hf', 'sentencepiece'):
    tok = tokenizer_lib.load(specs[kind])
    text = tok.decode([tok.vocab_size, -1, tok.vocab_size + 10**6])
    assert text == '\ufffd' * 3
    # Every single id decodes (partial UTF-8 byte tokens included).
    assert all(isinstance(tok.decode([i]), str) for i in range(tok.vocab_size))


def test_trained_bpe_file_has_the_requested_vocab_and_eod(hf_path):
  with open(hf_path) as f:
    saved = json.load(f)
  eod = [t for t in saved['added_tokens'] if t['content'] == '<|endoftext|>']
  assert len(eod) == 1 and eod[0]['special']
  assert len(saved['model']['vocab']) == 300
  assert saved['pre_tokenizer']['type'] == 'ByteLevel'
  assert saved['decoder']['type'] == 'ByteLevel'
  tok = tokenizer_lib.load(f'hf:{hf_path}')
  assert (tok.vocab_size, tok.eod_id, tok.eod_token) == (300, eod[0]['id'], '<|endoftext|>')
  # 43 merges learned from TRAIN_TEXT shorten it well below its UTF-8 byte count (0.56x).
  assert len(tok.encode(TRAIN_TEXT)) < 0.75 * len(TRAIN_TEXT.encode())


def test_bpe_training_is_deterministic(tmp_path):
  # Each training builds fresh Rust hash maps with new random keys, so hash order differs.
  paths = [train_tokenizer.train_to_dir([TRAIN_TEXT, 'x = [1, 2]\n'], 320, str(tmp_path / d))
           for d in ('a', 'b')]
  contents = [open(p.removeprefix('hf:'), 'rb').read() for p in paths]
  assert contents[0] == contents[1]


def test_bpe_training_uses_only_the_stdlib_train_split(monkeypatch, tmp_path):
  (tmp_path / 'pkg').mkdir()
  names = [f'pkg/m{i}.py' for i in range(200)]
  for name in names:
    (tmp_path / name).write_text(f'# {name}\n')
  from sharenet.data import corpus
  monkeypatch.setattr(corpus, 'stdlib_files', lambda: (str(tmp_path), sorted(names)))
  texts = train_tokenizer.stdlib_train_texts()
  want = [f'# {n}\n' for n in sorted(names) if not corpus.is_val_file(n)]
  assert texts == want and len(want) < len(names)   # at least one file is validation


def _one_line_error(spec, match):
  with pytest.raises(ConfigError) as e:
    tokenizer_lib.load(spec)
  message = str(e.value)
  assert '\n' not in message
  assert 'valid forms: bytes, sentencepiece:PATH' in message and 'hf:PATH' in message
  assert match in message, message


@pytest.mark.parametrize('spec,match', [
    ('', 'empty'), ('byte', "unknown kind 'byte'"), ('gpt2:/x', "unknown kind 'gpt2'"),
    ('hf:', 'needs a file path'), ('hf:/nonexistent/tokenizer.json', 'no such file'),
    ('sentencepiece:/nonexistent.model', 'no such file')])
def test_bad_spec_is_one_line(spec, match):
  _one_line_error(spec, match)


def test_a_file_that_does_not_load_is_one_line(tmp_path):
  bad = tmp_path / 'garbage.json'
  bad.write_text('{"not": "a tokenizer"}\n  second line')
  _one_line_error(f'hf:{bad}', 'does not load as a tokenizer.json')
  _one_line_error(f'sentencepiece:{bad}', 'does not load as a SentencePiece model')


def test_hf_without_an_eod_token_names_the_tokens_tried(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator([TRAIN_TEXT], trainers.BpeTrainer(vocab_size=280, show_progress=False))
  tok.save(str(tmp_path / 'tokenizer.json'))
  _one_line_error(f'hf:{tmp_path}/tokenizer.json',
                  'no end-of-document token; tried <|endoftext|>, <|end_of_text|>, </s>, <eos>')


def test_sentencepiece_without_eos_is_one_line(tmp_path):
  path = _train_sentencepiece(str(tmp_path / 'no_eos.model'), eos_id=-1)
  _one_line_error(f'sentencepiece:{path}', 'eos_id() = -1')


@pytest.mark.slow
def test_train_tokenizer_cli_rejects_a_vocab_without_merges(tmp_path):
  proc = subprocess.run([sys.executable, '-m', 'sharenet.data.train_tokenizer', '--vocab_size',
                         '257', '--out', str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 2
  assert proc.stderr.strip() == ('error: --vocab_size=257 must be > 257 (256 bytes, '
                                 '<|endoftext|> and at least one merge)')


def test_the_data_names_its_tokenizer(hf_path, tmp_path):
  """data.tokenizer=auto follows the data; an explicit value must agree with it."""
  import ml_collections
  from sharenet.data import prepare, tokenizer as tokenizer_lib
  from sharenet.errors import ConfigError
  docs = tmp_path / 'docs'
  docs.mkdir()
  for i in range(4):
    (docs / f'{i}.txt').write_text(f'document {i}: ' + TRAIN_TEXT[:200])
  out = tmp_path / 'shards'
  prepare.prepare(f'{docs}/*.txt', f'hf:{hf_path}', str(out), shards=2, val_fraction=0.3)

  def data(source, path='', spec='auto'):
    return ml_collections.ConfigDict({'source': source, 'path': path, 'tokenizer': spec})

  shards = corpus.for_data(data('arrayrecord', str(out)))
  assert shards.spec == 'hf:tokenizer.json'   # the shard directory's own copy
  assert shards.encode(TRAIN_TEXT[:80]).tolist() == \
      tokenizer_lib.load(f'hf:{hf_path}').encode(TRAIN_TEXT[:80]).tolist()
  assert corpus.for_data(data('arrayrecord', str(out), 'hf:tokenizer.json')).vocab_size \
      == shards.vocab_size
  # The file the shards were prepared with, or a copy elsewhere: the same contents, accepted.
  copy = tmp_path / 'elsewhere' / 'tok.json'
  copy.parent.mkdir()
  copy.write_bytes(open(hf_path, 'rb').read())
  for same in (f'hf:{hf_path}', f'hf:{copy}'):
    assert corpus.data_spec(data('arrayrecord', str(out), same)) == (
        'hf:tokenizer.json', str(out))
  other = train_tokenizer.train_to_dir([TRAIN_TEXT], 290, str(tmp_path / 'other'))
  assert isinstance(corpus.for_data(data('stdlib')), tokenizer_lib.ByteTokenizer)
  assert corpus.for_data(data('bin', 'x.bin')) is None
  assert corpus.for_data(data('bin', 'x.bin', f'hf:{hf_path}')).vocab_size == \
      shards.vocab_size
  for bad, match in ((data('arrayrecord', str(out), 'bytes'), 'contradicts the shards'),
                     (data('arrayrecord', str(out), other), 'the files differ'),
                     (data('arrayrecord', str(out), 'hf:/no/such.json'), 'no such file'),
                     (data('stdlib', spec=f'hf:{hf_path}'), 'is read as UTF-8 bytes')):
    with pytest.raises(ConfigError, match=match) as e:
      corpus.data_spec(bad)
    assert '\n' not in str(e.value)
