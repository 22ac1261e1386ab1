"""The normalization study (sharenet/studies/norm_study.py): variants, table, shared --out."""
import json
import os
import subprocess
import sys

import pytest

from configs import norm_study as norm_study_config
from sharenet.errors import ConfigError
from sharenet.studies import common, norm_study

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {'model.d_model': 32, 'model.num_layers': 2, 'model.num_heads': 2, 'model.mlp_dim': 64,
        'model.remat': 'none', 'train.steps': 3, 'train.batch_size': 4, 'train.seq_len': 32,
        'train.warmup_steps': 1, 'train.eval_batch_size': 256}


@pytest.mark.slow
def test_norm_study_runs_variants_and_writes_the_table(tmp_path):
  out = str(tmp_path / 'study')
  config = common.with_overrides(
      norm_study_config.get_config(),
      {**TINY, 'study.schemes': 'cycle', 'study.variants': 'dyt,agc', 'study.seeds': '0'})
  assert norm_study.main(config, out) == 0
  rows = json.load(open(os.path.join(out, 'norm_study.json')))
  assert [(r['variant'], r['seed'], r['status']) for r in rows] == [('dyt', 0, 'ok'),
                                                                    ('agc', 0, 'ok')]
  table = open(os.path.join(out, 'norm_study.md')).read()
  assert '| dyt | activation norm |' in table and '| agc | update |' in table
  # a second seed: its own workdir and row (train.seed = 1: another init and data order); the
  # finished seed-0 cell is not rerun
  assert norm_study.main(common.with_overrides(config, {'study.variants': 'dyt',
                                                        'study.seeds': '0,1'}), out) == 0
  rows = json.load(open(os.path.join(out, 'norm_study.json')))
  dyt = {r['seed']: r for r in rows if r['variant'] == 'dyt'}
  assert sorted(dyt) == [0, 1] and dyt[0]['eval_loss'] != dyt[1]['eval_loss']
  assert sorted(os.listdir(os.path.join(out, 'cycle'))) == ['agc', 'dyt', 'dyt-seed1']
  assert os.path.exists(os.path.join(out, 'norm_study.png'))
  with pytest.raises(ConfigError, match="study.variants: 'batchnorm' is unknown; valid: rmsnorm"):
    norm_study.main(common.with_overrides(config, {'study.variants': 'batchnorm'}), out)


@pytest.mark.slow
def test_norm_study_cli_takes_config_overrides_and_fails_in_one_line(tmp_path):
  res = subprocess.run(
      [sys.executable, '-m', 'sharenet.studies.norm_study', '--config',
       os.path.join(ROOT, 'configs', 'norm_study.py'), '--out', str(tmp_path),
       '--config.train.steps=5', '--config.study.variants=batchnorm'],
      cwd=ROOT, capture_output=True, text=True, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert res.returncode == 2 and res.stderr.strip().splitlines() == [
      f"error: study.variants: 'batchnorm' is unknown; valid: {', '.join(norm_study.VARIANTS)}"]


def test_norm_study_workers_sharing_one_out_keep_every_row(tmp_path):
  """Two study processes writing one --out (one per core) re-read under a lock: no row lost,
  and a re-run of a cell replaces its row."""
  path = str(tmp_path / 'norm_study.json')
  row = lambda s, v, bpb: {'scheme': s, 'variant': v, 'status': 'ok', 'eval_bits_per_byte': bpb}
  json.dump([row('untied', 'rmsnorm', 2.2)], open(path, 'w'))   # written by the other worker
  key = lambda r: norm_study._key(r, 0)
  common.append_row(path, row('cycle', 'dyt', 2.3), key)
  rows = common.append_row(path, row('untied', 'rmsnorm', 2.1), key)
  assert sorted((r['scheme'], r['variant'], r['eval_bits_per_byte']) for r in rows) == [
      ('cycle', 'dyt', 2.3), ('untied', 'rmsnorm', 2.1)]
  assert json.load(open(path)) == rows
  rows.append({**row('cycle', 'none', 82.8), 'status': 'unstable'})
  table = norm_study.to_markdown(rows)
  assert '| none | activation norm |  | unstable (82.8) |' in table
  # VARIANTS order
  assert table.index('| rmsnorm |') < table.index('| dyt |') < table.index('| none |')


def test_norm_study_table_reports_mean_spread_and_paired_differences():
  """Mean +- sample sd per cell; variant - baseline paired by seed, resolved by a two-sided 95 %
  paired t-test (2 degrees of freedom: t > 4.303)."""
  def row(v, seed, bpb, status='ok'):
    return {'scheme': 'untied', 'variant': v, 'seed': seed, 'status': status,
            'eval_bits_per_byte': bpb}
  base = [2.20, 2.22, 2.21]                 # mean 2.21, sd 0.01
  steady = [2.18, 2.20, 2.19]               # differences -0.02, -0.02, -0.02: sd 0 -> resolved
  noisy = [2.17, 2.25, 2.18]                # sd 0.044; differences -0.03, +0.03, -0.03: mean -0.01, sd 0.0346
  rows = ([row('rmsnorm', s, x) for s, x in enumerate(base)] +
          [row('weight_std', s, x) for s, x in enumerate(steady)] +
          [row('weight_norm', s, x) for s, x in enumerate(noisy)] +
          [row('fixnorm', 0, 2.30)] + [row('none', s, 80.0, 'unstable') for s in range(3)])
  table = norm_study.to_markdown(rows)
  lines = {line.split(' | ')[0][2:]: line for line in table.splitlines()[2:]}
  assert lines['rmsnorm'] == '| rmsnorm | activation norm | 2.210 +- 0.010 (3) |  |'
  assert lines['weight_std'].endswith('| 2.190 +- 0.010 (3) | -0.020 +- 0.000 (3), resolved |')
  # t = 0.01 / (0.03464 / sqrt 3) = 0.5 < 4.303
  assert lines['weight_norm'].endswith('| 2.200 +- 0.044 (3) | -0.010 +- 0.035 (3), unresolved |')
  assert lines['fixnorm'].endswith('| 2.300 | +0.100 (1 seed) |')   # vs seed 0's 2.20
  assert lines['none'].endswith('| unstable (80) |  |')
  # a difference of +-0.01 around a mean of 0.1 over 3 seeds: t = 0.1 / (0.01 / sqrt 3) = 17.3
  assert norm_study.paired_difference({0: 1.11, 1: 1.10, 2: 1.09}, {0: 1.0, 1: 1.0, 2: 1.0})[3]
  assert not norm_study.paired_difference({0: 1.1}, {0: 1.0})[3]      # one seed: never resolved


def test_crms_isotropic_init_makes_the_implied_coordinate_one_of_many():
  """iid writer rows: the implied coordinate -sum z has sqrt(n) times a stored coordinate's std;
  after the isotropic init it has the same std as every stored one (covariance I - 11^T/(n+1))."""
  import jax
  import numpy as np
  from sharenet.models.params import ParamInfo
  from sharenet.studies import crms_init
  n, rows = 64, 20000
  w = jax.random.normal(jax.random.key(0), (rows, n))
  infos = {('params', 'embed', 'embedding'): ParamInfo(('params', 'embed', 'embedding'),
                                                     ('vocab', 'embed'), (rows, n), 'embedding')}
  v = {'params': {'embed': {'embedding': w}}}
  assert abs(crms_init.ratios(v, infos)['embed/embedding'][0] / n ** 0.5 - 1) < 0.05
  iso = np.asarray(crms_init.isotropic(v, infos)['params']['embed']['embedding'])
  assert abs(crms_init.ratios({'params': {'embed': {'embedding': iso}}},
                              infos)['embed/embedding'][0] - 1) < 0.05
  full = np.concatenate([iso, -iso.sum(-1, keepdims=True)], -1)      # the (n+1)-vectors
  cov = np.cov(full, rowvar=False)
  target = np.eye(n + 1) - 1 / (n + 1)
  assert np.abs(np.diag(cov) - np.diag(target)).max() < 0.05          # every coordinate alike
  assert np.abs(cov - target).max() < 0.05


def test_a_run_stopped_by_sigterm_ends_the_study_without_a_row(tmp_path, monkeypatch, capsys):
  """train_and_evaluate returns without eval results after a SIGTERM (checkpoint saved): the study
  exits with one line and records nothing, so a rerun resumes the cell instead of skipping it."""
  from sharenet.train import loop
  monkeypatch.setattr(loop, 'train_and_evaluate', lambda config, workdir: {'loss': 1.5})
  out = str(tmp_path / 'study')
  config = common.with_overrides(
      norm_study_config.get_config(),
      {**TINY, 'study.schemes': 'cycle', 'study.variants': 'dyt', 'study.seeds': '0'})
  with pytest.raises(SystemExit) as stop:
    norm_study.main(config, out)
  assert stop.value.code == 143
  assert 'stopped before its final evaluation (SIGTERM)' in capsys.readouterr().err
  assert not os.path.exists(os.path.join(out, 'norm_study.json'))
