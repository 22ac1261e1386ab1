"""The normalization study (sharenet/studies/norm_study.py): variants, table, shared --out."""
import json
import os
import subprocess
import sys

import pytest

from configs import norm_study as norm_study_config
from sharenet.errors import ConfigError
from sharenet.studies import common, norm_study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {'model.d_model': 32, 'model.num_layers': 2, 'model.num_heads': 2, 'model.mlp_dim': 64,
        'model.remat': 'none', 'train.steps': 3, 'train.batch_size': 4, 'train.seq_len': 32,
        'train.warmup_steps': 1, 'train.eval_batch_size': 256}


def test_norm_study_runs_variants_and_writes_the_table(tmp_path):
  out = str(tmp_path / 'study')
  config = common.with_overrides(norm_study_config.get_config(),
                                 {**TINY, 'study.schemes': 'cycle', 'study.variants': 'dyt,agc'})
  assert norm_study.main(config, out) == 0
  rows = json.load(open(os.path.join(out, 'norm_study.json')))
  assert [(r['variant'], r['status']) for r in rows] == [('dyt', 'ok'), ('agc', 'ok')]
  table = open(os.path.join(out, 'norm_study.md')).read()
  assert '| dyt | activation norm |' in table and '| agc | update |' in table
  assert os.path.exists(os.path.join(out, 'norm_study.png'))
  with pytest.raises(ConfigError, match="study.variants: 'batchnorm' is unknown; valid: rmsnorm"):
    norm_study.main(common.with_overrides(config, {'study.variants': 'batchnorm'}), out)


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
  norm_study._append_row(path, row('cycle', 'dyt', 2.3))
  rows = norm_study._append_row(path, row('untied', 'rmsnorm', 2.1))
  assert sorted((r['scheme'], r['variant'], r['eval_bits_per_byte']) for r in rows) == [
      ('cycle', 'dyt', 2.3), ('untied', 'rmsnorm', 2.1)]
  assert json.load(open(path)) == rows
  rows.append({**row('cycle', 'none', 82.8), 'status': 'unstable'})
  table = norm_study.to_markdown(rows)
  assert '| none | activation norm |  | unstable (82.8) |' in table
  # VARIANTS order
  assert table.index('| rmsnorm |') < table.index('| dyt |') < table.index('| none |')
