"""benchmarks/peer_compare.py: the side-by-side timing runs and reports; the PyTorch reference has
sharenet's FLOPs per token (checked where torch is importable: torch is not a dependency)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, make_subprocess_env

TINY = ['--config.widths=64', '--config.layers=2', '--config.seq_len=16', '--config.batch=2',
        '--config.rounds=2', '--config.steps=1', '--config.remats=dots',
        '--config.dense_grads=auto,xla']


def test_peer_compare_runs_and_writes_its_rows(tmp_path):
  out = tmp_path / 'peer.json'
  proc = subprocess.run([sys.executable, '-m', 'benchmarks.peer_compare', *TINY,
                         f'--config.out={out}'], cwd=ROOT, env=make_subprocess_env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())['rows']
  assert row['d_model'] == 64 and row['sharenet_variant'] in ('auto/dots', 'xla/dots')
  assert set(row['sharenet_tokens_per_sec_by_variant']) == {'auto/dots', 'xla/dots'}
  assert len(row['step_ms']['auto/dots']) == 2 and row['sharenet_tokens_per_sec'] > 0
  assert 0 < row['sharenet_fraction_of_matmul'] < 1.5
  if importlib.util.find_spec('torch') is None:
    assert 'torch is not importable here' in proc.stderr and 'ratio' not in row
  else:   # the reference ran interleaved: a paired ratio per round
    assert len(row['step_ms']['torch']) == 2 and row['ratio'] > 0


def test_peer_compare_rejects_a_python_without_torch(tmp_path):
  proc = subprocess.run([sys.executable, '-m', 'benchmarks.peer_compare', *TINY,
                         '--config.torch_python=/bin/false'], cwd=ROOT,
                        env=make_subprocess_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "config.torch_python='/bin/false' cannot import torch" in proc.stderr


def test_torch_reference_counts_sharenets_flops_per_token():
  torch = pytest.importorskip('torch')
  del torch
  sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
  try:
    import torch_reference
  finally:
    sys.path.pop(0)
  from sharenet.models import ModelConfig, accounting
  for d, layers, seq in ((64, 2, 32), (256, 8, 256)):
    ref = torch_reference.GPT(256, d, layers, max(1, d // 64), 3 * d, seq)
    cfg = ModelConfig(d_model=d, num_layers=layers, num_heads=max(1, d // 64), mlp_dim=3 * d)
    assert ref.flops_per_token(seq) == accounting.flops_per_token(cfg, seq)
