"""Fine-tuning pairs with a loss mask: prepare --response_field, batches with 'loss_mask', the
loss and the evaluation over response tokens only (sharenet/data/arrayrecord.py, "Loss mask")."""
import json
import math

import jax
import numpy as np
import pytest

from sharenet import data
from sharenet.data import arrayrecord
from sharenet.data import prepare as prep
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.train import evaluation, trainer

EOD = 256
SEQ = 16


def _pairs(n, seed=0):
  rng = np.random.default_rng(seed)
  words = ['alpha', 'beta', 'gamma', 'delta']
  return [{'prompt': f'Q{i}: ' + ' '.join(rng.choice(words, rng.integers(1, 5))) + '?',
           'response': ' ' + ' '.join(rng.choice(words, rng.integers(1, 6))), 'id': i}
          for i in range(n)]


@pytest.fixture(scope='module')
def sft(tmp_path_factory):
  root = tmp_path_factory.mktemp('sft')
  rows = _pairs(120)
  path = root / 'pairs.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  out = str(root / 'shards')
  prep.prepare(str(path), 'bytes', out, shards=2, val_fraction=0.2, workers=1,
               text_field='prompt', response_field='response')
  return out, {r['prompt']: r['response'] for r in rows}


def _cfg(path, **kw):
  return {'source': 'arrayrecord', 'path': path, **kw}


def test_records_mark_the_response_and_its_end(sft):
  out, by_prompt = sft
  meta = arrayrecord.meta(out)
  assert meta['loss_mask'] is True
  src = arrayrecord.source(out, 'validation')
  loss_tokens = text_bytes = 0
  for i in range(len(src)):
    ids, loss = arrayrecord.split_loss_bit(arrayrecord.decode(src[i]))
    text = bytes(ids[:-1].astype(np.uint8)).decode()
    n = int(loss.sum())
    prompt, response = text[:len(text) - (n - 1)], text[len(text) - (n - 1):]
    assert by_prompt[prompt] == response and ids[-1] == EOD
    assert (loss == np.r_[np.zeros(len(prompt)), np.ones(n)]).all()
    loss_tokens, text_bytes = loss_tokens + n, text_bytes + len(response.encode())
  info = meta['splits']['validation']
  assert info['loss_tokens'] == loss_tokens and info['bytes'] == text_bytes
  assert arrayrecord.bytes_per_token(out) == text_bytes / loss_tokens


def test_batches_carry_the_mask_of_their_tokens(sft):
  out, by_prompt = sft
  it = data.make_train_iterator(_cfg(out, segment_mask=True), SEQ, 4, seed=0)
  b = next(it)
  assert set(b) == {'tokens', 'loss_mask', 'segment_ids'}
  assert b['tokens'].max() <= EOD and set(np.unique(b['loss_mask'])) <= {0, 1}
  np.testing.assert_array_equal(b['segment_ids'], arrayrecord.segment_ids(b['tokens'], EOD))
  # within a row, every masked run is a response followed by its document's end
  row, mask = b['tokens'][0], b['loss_mask'][0]
  assert mask[row == EOD].all()


@pytest.mark.slow
def test_the_loss_is_the_mean_over_response_tokens_only(sft, tiny_config):
  out, _ = sft
  model = DecoderLM(ModelConfig.from_config(tiny_config(**{'model.vocab_size': 257}).model))
  params = init_variables(model, jax.random.key(0), seq_len=SEQ)
  b = jax.tree.map(np.asarray, next(data.make_train_iterator(_cfg(out), SEQ, 8, seed=1)))
  loss, _ = trainer.loss_fn(params, {}, b, model=model)
  nll, _ = evaluation.token_nll(model, params, b['tokens'])
  w = b['loss_mask'][:, 1:]
  assert 0 < w.sum() < w.size
  want = float((np.asarray(nll, np.float64) * w).sum() / w.sum())
  assert float(loss) == pytest.approx(want, rel=1e-6)
  assert float(loss) != pytest.approx(float(np.mean(nll)), rel=1e-3)
  # evaluation: the same rule over the validation split
  got = evaluation.evaluate(model, params, _cfg(out), SEQ, 4)
  val = arrayrecord.split_tokens(out, 'validation')
  _, loss_bits = arrayrecord.split_loss_bit(val)
  total = count = 0.0
  for batch, mask in data.eval_batches(_cfg(out), SEQ, 4):
    n, _ = evaluation.token_nll(model, params, batch)
    total += float((np.asarray(n, np.float64) * mask).sum())
    count += float(mask.sum())
  assert count == int(loss_bits[1:].sum())
  assert got['eval_loss'] == pytest.approx(total / count, rel=1e-6)   # float32 sums there


@pytest.mark.slow
def test_training_on_pairs_runs(sft, tmp_path, tiny_config):
  from sharenet.train import loop
  out, _ = sft
  final = loop.train_and_evaluate(tiny_config(**{
      'data.source': 'arrayrecord', 'data.path': out, 'model.vocab_size': 257,
      'train.seq_len': SEQ, 'train.steps': 3, 'train.grad_accum': 2}), str(tmp_path / 'run'))
  assert math.isfinite(final['eval_loss'])


@pytest.mark.parametrize('rows, kw, match', [
    ([{'prompt': 'a', 'answer': 'b'}], {}, r"no column 'response' \(it has: prompt, answer\)"),
    ([{'prompt': 'a', 'response': ''}], {}, "--response_field='response' is empty"),
    ([{'prompt': 'a', 'response': 3}], {}, 'holds int, not text'),
])
def test_bad_pairs_are_one_line_and_write_nothing(tmp_path, rows, kw, match):
  path = tmp_path / 'bad.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  out = tmp_path / 'out'
  with pytest.raises(ConfigError, match=match) as e:
    prep.prepare(str(path), 'bytes', str(out), text_field='prompt', response_field='response',
                 **kw)
  assert '\n' not in str(e.value) and not out.exists()
  glob = tmp_path / 'doc.txt'
  glob.write_text('text')
  with pytest.raises(ConfigError, match='apply to records'):
    prep.prepare(str(glob), 'bytes', str(out), response_field='response')


def _chats(n):
  return [{'messages': [{'role': 'system', 'content': 'Be brief.'},
                        {'role': 'user', 'content': f'Sum {i} and 1?'},
                        {'role': 'assistant', 'content': f'{i + 1}'},
                        {'role': 'user', 'content': 'Twice that?'},
                        {'role': 'assistant', 'content': f'{2 * (i + 1)}'}]} for i in range(n)]


def test_chat_conversations_count_the_assistant_messages_only(tmp_path):
  path = tmp_path / 'chat.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in _chats(60)))
  out = str(tmp_path / 'shards')
  prep.prepare(str(path), 'bytes', out, shards=1, val_fraction=0.2, workers=1,
               messages_field='messages')
  src = arrayrecord.source(out, 'train')
  for k in range(3):
    ids, loss = arrayrecord.split_loss_bit(arrayrecord.decode(src[k]))
    text = bytes(ids[:-1].astype(np.uint8)).decode()
    counted = bytes(ids[:-1][loss[:-1] > 0].astype(np.uint8)).decode()
    i = int(text.split('Sum ')[1].split(' ')[0])
    assert text == (f'<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSum {i} and '
                    f'1?<|im_end|>\n<|im_start|>assistant\n{i + 1}<|im_end|>\n<|im_start|>user\n'
                    f'Twice that?<|im_end|>\n<|im_start|>assistant\n{2 * (i + 1)}<|im_end|>\n')
    assert counted == f'{i + 1}<|im_end|>\n{2 * (i + 1)}<|im_end|>\n'
    assert loss[-1] == 1 and ids[-1] == EOD


@pytest.mark.parametrize('messages, match', [
    ([{'role': 'user', 'content': 'hi'}], 'no assistant message'),
    ([{'role': 'bot', 'content': 'hi'}], 'valid roles: system, user, assistant'),
    ('hi', 'not a list of'),
])
def test_bad_conversations_are_one_line(tmp_path, messages, match):
  path = tmp_path / 'chat.jsonl'
  path.write_text(json.dumps({'messages': messages}) + '\n')
  with pytest.raises(ConfigError, match=match) as e:
    prep.prepare(str(path), 'bytes', str(tmp_path / 'out'), messages_field='messages')
  assert '\n' not in str(e.value) and not (tmp_path / 'out').exists()
