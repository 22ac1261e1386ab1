"""data.mixture: weighted draws from several prepared directories (sharenet/data/mixture.py).

Two sources of byte documents that tell themselves apart (lowercase vs uppercase letters), so
which source fed a row is read off the row itself, not from the pipeline's bookkeeping.
"""
import math
import subprocess

import jax
import numpy as np
import pytest
from conftest import kill_after_checkpoint

from sharenet import data
from sharenet.data import arrayrecord, mixture
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.train import evaluation

EOD = 0
SEQ = 16


def _docs(n, letters, seed):
  rng = np.random.default_rng(seed)
  return [''.join(rng.choice(list(letters), rng.integers(5, 40))) + '\n' for _ in range(n)]


def _write(path, letters, n_train=48, n_val=6, vocab=256, eod=EOD, seed=0):
  enc = lambda texts: [list(t.encode()) for t in texts]
  train_texts, val_texts = _docs(n_train, letters, seed), _docs(n_val, letters, seed + 1)
  train = arrayrecord.write_split(str(path), 'train', enc(train_texts), eod, 2)
  val = arrayrecord.write_split(str(path), 'validation', enc(val_texts), eod, 1)
  train['bytes'] = sum(map(len, train_texts))
  val['bytes'] = sum(map(len, val_texts))
  arrayrecord.write_meta(str(path), {'train': train, 'validation': val}, vocab, eod, 'bytes')
  return str(path)


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp('mix')
  return (_write(root / 'lower', 'abcdefgh', seed=0), _write(root / 'upper', 'ABCDEFGH', seed=5))


def _cfg(dirs, weights=(0.8, 0.2), **kw):
  spec = ','.join(f'{d}:{w}' for d, w in zip(dirs, weights))
  return {'source': 'arrayrecord', 'mixture': spec, **kw}


def _row_source(row):
  """0 (lowercase source) or 1 (uppercase), read from the row's letters."""
  text = bytes(np.asarray(row, np.uint8)[np.asarray(row) != EOD]).decode()
  lower, upper = any(c.islower() for c in text), any(c.isupper() for c in text)
  assert lower != upper, text
  return int(upper)


def _batches(it, n):
  return [next(it) for _ in range(n)]


@pytest.mark.slow
def test_token_shares_follow_the_weights_within_two_percent_over_200_steps(dirs):
  cfg = _cfg(dirs)
  batch = 8
  it = data.make_train_iterator(cfg, SEQ, batch, seed=3)
  rows = np.array([[_row_source(r) for r in b] for b in _batches(it, 200)])
  share_upper = rows.mean()
  assert abs(share_upper - 0.2) <= 0.02 * 0.2 + 1e-9, share_upper   # within 2 % of the weight
  mix = data.mixture_of(cfg, 3)
  # the rows are the ones row_sources names, and the logged shares count exactly those
  np.testing.assert_array_equal(rows.ravel(), mix.row_sources(np.arange(200 * batch), batch))
  shares = data.SeenRows(mix, batch).shares(200)
  assert shares == {'data_share/lower': 1 - share_upper, 'data_share/upper': share_upper}
  # another seed draws other rows at the same shares
  other = data.mixture_of({**cfg, 'seed': 11}, 3).row_sources(np.arange(1600), batch)
  assert (other != rows.ravel()).any() and abs(other.mean() - 0.2) < 0.004


def test_shares_of_random_draws_would_miss_the_bound_the_weyl_sequence_keeps():
  """Why not draw each row at random: over 200 steps x 8 rows the binomial spread of a 0.2
  share is 0.01 (5 % of the weight); the sequence stays within a couple of rows at every prefix."""
  mix = mixture.Mixture((mixture.Source('a', '', 0.8), mixture.Source('b', '', 0.2)),
                        ((0, (0.8, 0.2)),), 0)
  counts = np.cumsum(mix.row_sources(np.arange(100_000), 8) == 1)
  n = np.arange(1, 100_001)
  assert np.abs(counts - 0.2 * n).max() < 4


def test_resume_continues_the_exact_stream(dirs):
  cfg = _cfg(dirs, shuffle_windows=3)
  it = data.make_train_iterator(cfg, SEQ, 6, seed=1)
  _batches(it, 37)
  state = it.get_state()
  want = _batches(it, 20)
  again = data.make_train_iterator(cfg, SEQ, 6, seed=1)
  again.set_state(state)
  np.testing.assert_array_equal(np.stack(_batches(again, 20)), np.stack(want))


def test_schedule_changes_the_weights_at_its_steps(dirs):
  cfg = _cfg(dirs, (1, 1), mixture_schedule='10:1/0,20:0/1')
  it = data.make_train_iterator(cfg, SEQ, 4, seed=0)
  rows = np.array([[_row_source(r) for r in b] for b in _batches(it, 30)])
  assert 0 < rows[:10].mean() < 1
  assert (rows[10:20] == 0).all() and (rows[20:] == 1).all()


def test_two_processes_hold_their_rows_of_the_global_batch(dirs):
  cfg = _cfg(dirs)
  mix = data.mixture_of(cfg, 2)
  parts = [np.stack(_batches(data.make_train_iterator(cfg, SEQ, 8, 2, p, 2), 10))
           for p in range(2)]
  rows = np.concatenate(parts, axis=1)   # (steps, 8): the global batches
  got = np.array([[_row_source(r) for r in b] for b in rows])
  np.testing.assert_array_equal(got.ravel(), mix.row_sources(np.arange(80), 8))


def test_segment_mask_batches_carry_segment_ids(dirs):
  b = next(data.make_train_iterator(_cfg(dirs, segment_mask=True), SEQ, 4, seed=0))
  np.testing.assert_array_equal(b['segment_ids'], arrayrecord.segment_ids(b['tokens'], EOD))


def test_eval_reports_each_source_and_their_weighted_average(dirs, tiny_config):
  cfg = _cfg(dirs)
  c = tiny_config()
  model = DecoderLM(ModelConfig.from_config(c.model))
  params = init_variables(model, jax.random.key(0), seq_len=SEQ)
  out = evaluation.evaluate(model, params, cfg, SEQ, 4)
  alone = [evaluation.evaluate(model, params, {'source': 'arrayrecord', 'path': d}, SEQ, 4)
           for d in dirs]
  for name, one in zip(('lower', 'upper'), alone):
    assert out[f'eval_loss/{name}'] == one['eval_loss']
    assert out[f'eval_bits_per_byte/{name}'] == one['eval_bits_per_byte']
  assert alone[0]['eval_loss'] != alone[1]['eval_loss']
  assert math.isclose(out['eval_loss'], 0.8 * alone[0]['eval_loss'] + 0.2 * alone[1]['eval_loss'])
  assert math.isclose(out['eval_bits_per_byte'], 0.8 * alone[0]['eval_bits_per_byte']
                      + 0.2 * alone[1]['eval_bits_per_byte'])


@pytest.mark.parametrize('change, match', [
    (lambda a, b: {'mixture': f'{a}:0.8,{b}:0'}, r"weight of .*upper.*='0'; valid: a number > 0"),
    (lambda a, b: {'mixture': f'{a}:0.8,{b}:-1'}, r"='-1'; valid: a number > 0"),
    (lambda a, b: {'mixture': f'{a}:0.8,{b}:lots'}, r"='lots'; valid: a number > 0"),
    (lambda a, b: {'mixture': f'{a}:0.8,{b}'}, 'has no weight'),
    (lambda a, b: {'mixture': f'{a}:0.8,{b}-missing:0.2'}, 'not a prepared directory'),
    (lambda a, b: {'mixture': f'{a}:0.8,lower={b}:0.2'}, "two sources 'lower'"),
    (lambda a, b: {'mixture': ','}, 'names no source'),
    (lambda a, b: {'mixture': f'{a}:1,{b}:1', 'mixture_schedule': '5:1'}, 'one per source'),
    (lambda a, b: {'mixture': f'{a}:1,{b}:1', 'mixture_schedule': '5:0/0'}, 'not all 0'),
    (lambda a, b: {'mixture': f'{a}:1,{b}:1', 'mixture_schedule': '5:1/1,5:1/2'}, 'increasing'),
    (lambda a, b: {'mixture': f'{a}:1,{b}:1', 'path': a}, 'no data.path'),
    (lambda a, b: {'mixture': f'{a}:1,{b}:1', 'source': 'text'}, 'data.source=arrayrecord'),
    (lambda a, b: {'mixture': '', 'path': a, 'mixture_schedule': '5:1/1'}, 'without data.mix'),
])
def test_bad_mixtures_are_one_line_each(dirs, change, match):
  cfg = {'source': 'arrayrecord', **change(*dirs)}
  with pytest.raises(ConfigError, match=match) as e:
    data.validate_data_config(cfg, SEQ, 4, 1, vocab_size=256)
  assert '\n' not in str(e.value)


def test_sources_of_other_tokenizers_are_refused(dirs, tmp_path):
  other = _write(tmp_path / 'big', 'xyz', vocab=512)
  with pytest.raises(ConfigError, match='prepared with other tokenizers'):
    data.validate_data_config(_cfg((dirs[0], other)), SEQ, 4)
  few = _write(tmp_path / 'few', 'XYZ', n_train=3)
  with pytest.raises(ConfigError, match=r"source .*few.*fewer than"):
    data.validate_data_config(_cfg((dirs[0], few)), SEQ, 4, process_count=4)


@pytest.mark.slow
def test_train_logs_shares_and_per_source_eval_and_resumes_after_kill(dirs, tmp_path, losses,
                                                                       tiny_config, train_cmd,
                                                                       subprocess_env):
  """train.py on a 0.8 / 0.2 mixture: metrics.jsonl logs each source's share and eval loss; a
  run killed (-9) after its step-8 checkpoint resumes to the uninterrupted run's losses."""
  from sharenet.train import loop
  from sharenet.train.metrics import read_metrics
  spec = f'{dirs[0]}:0.8,{dirs[1]}:0.2'
  overrides = {'data.source': 'arrayrecord', 'data.mixture': spec, 'train.steps': 16,
               'train.checkpoint_every': 8, 'train.seq_len': SEQ, 'train.eval_every': 8}
  flags = [f'--config.{k}={v}' for k, v in overrides.items()]
  ref_dir, workdir = str(tmp_path / 'ref'), str(tmp_path / 'killed')
  loop.train_and_evaluate(tiny_config(**overrides), ref_dir)
  rows = read_metrics(ref_dir)
  logged = [r for r in rows if 'loss' in r]
  mix = data.mixture_of(tiny_config(**overrides).data, 0)
  for r in logged:
    want = data.SeenRows(mix, tiny_config().train.batch_size).shares(r['step'])
    assert {k: r[k] for k in want} == want and want
  evals = [r for r in rows if 'eval_loss' in r]
  assert evals and all({'eval_loss/lower', 'eval_loss/upper'} <= set(r) for r in evals)
  kill_after_checkpoint(train_cmd(workdir, *flags), subprocess_env, workdir, 8)
  out = subprocess.run(train_cmd(workdir, *flags), env=subprocess_env, check=True,
                       capture_output=True, text=True)
  assert 'resumed from checkpoint at step 8' in out.stdout
  ref, resumed = losses(ref_dir), losses(workdir)
  assert [resumed[s] for s in range(9, 17)] == [ref[s] for s in range(9, 17)]


def test_a_bad_mixture_stops_train_before_it_writes(dirs, tmp_path, tiny_config):
  from sharenet.train import loop
  workdir = tmp_path / 'run'
  config = tiny_config(**{'data.source': 'arrayrecord', 'data.mixture': f'{dirs[0]}:0.8,{dirs[1]}:0',
                          'train.seq_len': SEQ})
  with pytest.raises(ConfigError, match='valid: a number > 0'):
    loop.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()
