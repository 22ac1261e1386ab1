"""Downstream tasks through lm-evaluation-harness (sharenet/tasks/).

The fixture tasks (tests/fixtures/tasks: multiple choice, rolling log-likelihood, generation,
the harness's own YAML format over JSON-lines files) run on small models; every number the
harness reports is recomputed here from `model.apply` logits or `generate.generate` tokens.
"""
import functools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.data import tokenizer
from sharenet.errors import ConfigError
from sharenet.inference import generate
from sharenet.main import eval_workdir
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.tasks import task_eval

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK_DIR = os.path.join(ROOT, 'tests', 'fixtures', 'tasks')
WORKDIRS = os.path.join(ROOT, 'tests', 'fixtures', 'workdirs_v2')
MAX_LEN = 64


def _jsonl(name):
  with open(os.path.join(TASK_DIR, 'data', f'{name}.jsonl')) as f:
    return [json.loads(line) for line in f]


class _Req:
  def __init__(self, *args):
    self.args = args


@pytest.fixture(scope='module')
def lm_parts(tiny_config, randomized_per_layer):
  """A tiny byte model with randomized weights (its choices differ), and the bytes tokenizer."""
  model = DecoderLM(ModelConfig.from_config(tiny_config().model))
  variables = init_variables(model, jax.random.key(0), seq_len=MAX_LEN)
  variables = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(3), x.shape,
                                                                  x.dtype) * (jnp.std(x) + 0.05),
                           variables)
  return model, variables, tokenizer.load('bytes')


def _harness(lm_parts, **kw):
  model, variables, tok = lm_parts
  return task_eval.as_harness_model(model, variables, tok, max_length=MAX_LEN, **kw)


@functools.lru_cache(maxsize=4)
def _apply(model):
  return jax.jit(model.apply)


def _direct_logprob(model, variables, ids, n_cont):
  """Sum of log p of the last n_cont ids given the ones before, from one unpadded forward."""
  ids = np.asarray(ids[-(MAX_LEN + 1):], np.int32)
  logits = _apply(model)(variables, jnp.asarray(ids[None, :-1]))[0]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = np.asarray(logp)[np.arange(len(ids) - 1), ids[1:]]
  return float(picked[-n_cont:].astype(np.float64).sum()), \
      bool((np.asarray(jnp.argmax(logp, -1))[-n_cont:] == ids[1:][-n_cont:]).all())


@pytest.mark.slow
def test_loglikelihood_of_each_choice_equals_the_direct_computation(lm_parts):
  model, variables, tok = lm_parts
  items = _jsonl('mc_test')[:10]
  reqs = [_Req(f'Question: {it["question"]}\nAnswer:', f' {c}') for it in items
          for c in it['choices']]
  got = _harness(lm_parts).loglikelihood(reqs)
  for r, (lp, greedy) in zip(reqs, got):
    ctx, cont = r.args
    want_lp, want_greedy = _direct_logprob(model, variables, list((ctx + cont).encode()),
                                           len(cont.encode()))
    assert abs(lp - want_lp) <= 1e-5 * max(1.0, abs(want_lp)), (r.args, lp, want_lp)
    assert greedy == want_greedy


def test_scores_do_not_depend_on_batch_or_bucket(lm_parts):
  items = _jsonl('mc_test')
  reqs = [_Req(f'Question: {it["question"]}\nAnswer:', f' {c}') for it in items
          for c in it['choices']]
  reqs += [_Req('x' * n, ' tail') for n in (3, 20, 40, 70)]   # other buckets, one truncated
  wide = _harness(lm_parts).loglikelihood(reqs)
  narrow = _harness(lm_parts, max_batch_tokens=64).loglikelihood(reqs)   # 4 rows of 16, 1 of 64
  reordered = _harness(lm_parts).loglikelihood(reqs[::-1])[::-1]
  for a, b, c in zip(wide, narrow, reordered):
    assert abs(a[0] - b[0]) <= 1e-5 and abs(a[0] - c[0]) <= 1e-5 and a[1] == b[1] == c[1]


def test_accuracy_equals_a_hand_count(lm_parts):
  model, variables, _ = lm_parts
  items = _jsonl('mc_test')
  correct = correct_norm = 0
  for it in items:
    ctx = f'Question: {it["question"]}\nAnswer:'
    # the harness puts its target delimiter, a space, between question and choice
    lps = [_direct_logprob(model, variables, list(f'{ctx} {c}'.encode()), len(c) + 1)[0]
           for c in it['choices']]
    correct += int(np.argmax(lps) == it['label'])
    norm = [lp / len(c) for lp, c in zip(lps, it['choices'])]   # acc_norm: per character
    correct_norm += int(np.argmax(norm) == it['label'])
  out = task_eval.run_tasks(_harness(lm_parts), ['sharenet_mc'], TASK_DIR, num_fewshot=0)
  assert out['sharenet_mc']['acc'] == correct / len(items)
  assert out['sharenet_mc']['acc_norm'] == correct_norm / len(items)


def test_rolling_loglikelihood_predicts_every_token_once(lm_parts):
  """The harness's windows restated: blocks of MAX_LEN tokens, the first after the prefix (the
  newline byte: this byte model has no end-of-document id), each later one after the MAX_LEN
  tokens before it."""
  model, variables, _ = lm_parts
  texts = [it['text'] for it in _jsonl('rolling_test')[:4]]
  assert max(len(t) for t in texts) > 2 * MAX_LEN
  got = _harness(lm_parts).loglikelihood_rolling([_Req(t) for t in texts])
  for text, lp in zip(texts, got):
    ids = [ord('\n')] + list(text.encode())
    want = 0.0
    for start in range(1, len(ids), MAX_LEN):
      end = min(start + MAX_LEN, len(ids))
      want += _direct_logprob(model, variables, ids[max(0, end - MAX_LEN - 1):end],
                              end - start)[0]
    assert abs(lp - want) <= 1e-5 * abs(want), (lp, want)


def test_generation_task_matches_greedy_decoding_and_its_exact_match(lm_parts):
  model, variables, tok = lm_parts
  items = _jsonl('gen_test')[:12]
  out = task_eval.run_tasks(_harness(lm_parts), ['sharenet_gen'], TASK_DIR, num_fewshot=0,
                            limit=12)
  texts = _harness(lm_parts).generate_until(
      [_Req(it['prompt'], {'until': ['\n'], 'max_gen_toks': 8}) for it in items])
  hits = 0
  for it, text in zip(items, texts):
    alone = generate.generate(model, variables, [list(it['prompt'].encode())], 8,
                              temperature=0.0).tokens[0]
    assert text == tok.decode(alone).split('\n')[0]
    hits += int(text == it['answer'])
  assert out['sharenet_gen']['exact_match'] == hits / len(items)


def test_bad_requests_are_one_line_each(lm_parts, tmp_path):
  with pytest.raises(ConfigError, match=r"--num_fewshot=9 exceeds the 8 examples .*'train'"):
    task_eval.load_tasks(['sharenet_mc'], TASK_DIR, 9)
  task_eval.load_tasks(['sharenet_mc'], TASK_DIR, 8)
  with pytest.raises(ConfigError, match='valid: distinct comma-separated task names'):
    task_eval.parse_tasks('a,,a')
  with pytest.raises(ConfigError, match='is not a directory'):
    task_eval.task_manager(['x'], str(tmp_path / 'none'))
  with pytest.raises(ConfigError, match='unnamed tokenizer'):
    eval_workdir.evaluate_workdir_tasks(
        os.path.join(WORKDIRS, 'middle_cycle_lora'), None,
        {'data.source': 'bin', 'data.path': str(tmp_path / 'x.bin')}, 'sharenet_mc',
        task_dir=TASK_DIR)


@pytest.mark.slow
def test_an_unknown_task_names_the_closest_ones():
  with pytest.raises(ConfigError, match=r"task 'hellaswg' is unknown .*closest: hellaswag") as e:
    task_eval.task_manager(['hellaswg'], TASK_DIR)
  assert '\n' not in str(e.value)


def _copy(name, tmp_path):
  import shutil
  out = tmp_path / name
  shutil.copytree(os.path.join(WORKDIRS, name), out)
  return str(out)


@pytest.mark.slow
def test_a_looped_workdir_at_depths_and_a_routed_one(tmp_path, tiny_config):
  from sharenet.train import loop
  looped = str(tmp_path / 'universal')   # one shared layer applied twice, trained 2 steps
  loop.train_and_evaluate(tiny_config(**{'model.sharing.scheme': 'universal',
                                         'model.sharing.num_unique': 1, 'train.steps': 2}),
                          looped)
  rows = eval_workdir.evaluate_workdir_tasks(looped, None, {}, 'sharenet_mc,sharenet_rolling',
                                             task_dir=TASK_DIR, limit=6, depths=[1, 2, 4])
  assert [(r['task'], r['depth']) for r in rows] == [
      (t, d) for d in (1, 2, 4) for t in ('sharenet_mc', 'sharenet_rolling')]
  assert all(0 <= r['acc'] <= 1 for r in rows[::2]) and rows[1]['bits_per_byte'] > 0
  assert len({r['bits_per_byte'] for r in rows[1::2]}) == 3   # each depth another model
  assert os.path.isfile(os.path.join(looped, eval_workdir.TASK_PLOT))
  with open(os.path.join(looped, eval_workdir.TASK_RESULTS)) as f:
    assert [json.loads(line) for line in f] == rows
  # generation with adaptive exits (loop by loop): a rule that never fires decodes as plain
  # greedy generation does; one that always fires (after the first loop) as depth 1 does
  gen = lambda **kw: eval_workdir.evaluate_workdir_tasks(looped, None, {}, 'sharenet_gen',
                                                         task_dir=TASK_DIR, limit=4, **kw)
  assert gen(exit='maxprob:1.0')[0]['exact_match'] == gen()[0]['exact_match']
  loaded = eval_workdir.load_for_generation(looped)
  reqs = [_Req(it['prompt'], {'until': ['\n'], 'max_gen_toks': 8}) for it in _jsonl('gen_test')[:4]]
  harness = lambda **kw: task_eval.as_harness_model(loaded.model, loaded.variables,
                                                    loaded.tokenizer, max_length=32, **kw)
  assert harness(exit='maxprob:1.0').generate_until(reqs) == harness().generate_until(reqs)
  assert harness(exit='maxprob:0.0').generate_until(reqs) == \
      harness(depth=1).generate_until(reqs)
  routed = _copy('mor_token_choice', tmp_path)
  (row,) = eval_workdir.evaluate_workdir_tasks(routed, None, {}, 'sharenet_gen',
                                               task_dir=TASK_DIR, limit=4, num_fewshot=1)
  assert row['task'] == 'sharenet_gen' and 0 <= row['exact_match'] <= 1


@pytest.mark.slow
def test_eval_py_tasks_on_a_trained_and_an_imported_workdir(tmp_path, subprocess_env):
  """eval.py --tasks prints a JSON line per task: a trained workdir (bytes), and an imported
  Hugging Face Llama fixture with its own BPE tokenizer."""
  from sharenet.interop import import_hf
  trained = _copy('middle_cycle_lora', tmp_path)
  imported = import_hf.import_hf(os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama'),
                                 str(tmp_path / 'llama'))['workdir']
  for workdir in (trained, imported):
    out = subprocess.run([sys.executable, os.path.join(ROOT, 'eval.py'), '--workdir', workdir,
                          '--tasks', 'sharenet_mc,sharenet_rolling,sharenet_gen',
                          '--task_dir', TASK_DIR, '--limit', '5', '--num_fewshot', '1'],
                         env=subprocess_env, capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{')]
    assert [r['task'] for r in rows] == ['sharenet_mc', 'sharenet_rolling', 'sharenet_gen']
    assert all(math.isfinite(v) for r in rows for k, v in r.items()
               if isinstance(v, float))
  bad = subprocess.run([sys.executable, os.path.join(ROOT, 'eval.py'), '--workdir', trained,
                        '--tasks', 'sharenet_mc', '--task_dir', TASK_DIR, '--num_fewshot', '50'],
                       env=subprocess_env, capture_output=True, text=True)
  assert bad.returncode == 2 and bad.stderr.count('\n') == 1 and 'exceeds' in bad.stderr
  stray = subprocess.run([sys.executable, os.path.join(ROOT, 'eval.py'), '--workdir', trained,
                          '--limit', '3'], env=subprocess_env, capture_output=True, text=True)
  assert stray.returncode == 2 and 'apply to --tasks' in stray.stderr


@pytest.mark.slow
def test_train_eval_tasks_logs_task_metrics(tmp_path, tiny_config):
  from sharenet.train import loop
  from sharenet.train.metrics import read_metrics
  config = tiny_config(**{'train.steps': 4, 'train.eval_every': 2,
                          'train.eval_tasks': 'sharenet_mc,sharenet_rolling',
                          'train.eval_task_dir': TASK_DIR, 'train.eval_task_limit': 5})
  loop.train_and_evaluate(config, str(tmp_path / 'run'))
  evals = [r for r in read_metrics(str(tmp_path / 'run')) if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [2, 4]
  for r in evals:
    assert 0 <= r['task/sharenet_mc/acc'] <= 1 and r['task/sharenet_rolling/bits_per_byte'] > 0
  assert evals[0]['task/sharenet_rolling/bits_per_byte'] != \
      evals[1]['task/sharenet_rolling/bits_per_byte']   # the parameters of that step
  with pytest.raises(ConfigError, match='apply to train.eval_tasks'):
    loop.train_and_evaluate(tiny_config(**{'train.eval_task_limit': 5}), str(tmp_path / 'x'))
  assert not (tmp_path / 'x').exists()
