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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_gemm_floor_times_every_dense_gemm_of_a_step():
  """The GEMM list is the model's dense matmuls (forward FLOPs equal sharenet's accounting for
  peer_compare's model), each three times (forward, input and weight gradient), timed in jax."""
  from benchmarks import gemm_floor
  from sharenet.models import ModelConfig, accounting
  d, layers, seq, batch = 64, 2, 32, 2
  shapes = gemm_floor.gemms(d, layers=layers, seq_len=seq, batch=batch)
  cfg = ModelConfig(d_model=d, num_layers=layers, num_heads=1, mlp_dim=3 * d)
  dense = layers * accounting.matmul_params_per_layer(cfg) + d * 256
  fwd = [s for s in shapes if s[1] == 0]
  assert sum(2 * M * K * N for _, _, M, K, N in fwd) == 2 * batch * seq * dense
  assert len(shapes) == 3 * len(fwd) == 3 * (7 * layers + 1)
  times = gemm_floor.time_jax(shapes[:6], repeats=1)
  summary = gemm_floor.summarize(shapes[:6], times)
  assert len(times) == 6 and all(t > 0 for t in times)
  assert summary['step_gemm_s'] == pytest.approx(sum(times)) and summary['gflop_per_s'] > 0


def test_step_profile_categories():
  from benchmarks import step_profile as sp
  assert sp.category('ynn_fusion.3', 'fusion') == sp.MATMUL
  assert sp.category('dot.12', 'dot') == sp.MATMUL
  assert sp.category('wrapped_broadcast.3', 'fusion') == sp.SCAN
  assert sp.category('bitcast_dynamic-update-slice_fusion', 'fusion') == sp.SCAN
  assert sp.category('copy_bitcast_fusion.7', 'fusion') == sp.COPY
  assert sp.category('add_divide_fusion', 'fusion') == sp.OTHER
