"""benchmarks/accelerator.py --smoke: every section runs at tiny size on the CPU (interpret mode)."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, make_subprocess_env


@pytest.mark.slow
def test_accelerator_smoke(tmp_path):
  out = tmp_path / 'acc.jsonl'
  proc = subprocess.run([sys.executable, '-m', 'benchmarks.accelerator', '--smoke',
                         f'--out={out}'], cwd=ROOT, env=make_subprocess_env(),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  by_section = {}
  for r in rows:
    assert 'error' not in r, r
    by_section.setdefault(r['section'], []).append(r)
  assert set(by_section) == {'check', 'attention', 'norms', 'step'}
  # Every kernel was checked against its reference, in float32 and bfloat16, and passed.
  checked = {(r['kernel'], r['dtype']) for r in by_section['check'] if r['ok']}
  for kernel in ('attention/pallas', 'add_norm/rmsnorm', 'add_norm/layernorm',
                 'add_norm/crmsnorm'):
    assert {(kernel, 'float32'), (kernel, 'bfloat16')} <= checked
  assert {r['impl'] for r in by_section['attention']} == {'xla', 'pallas'}
  assert all(r['fwd_bwd_ms'] > 0 for r in by_section['attention'])
  assert {(r['kind'], r['impl']) for r in by_section['norms']} == {
      (k, i) for k in ('rmsnorm', 'layernorm', 'crmsnorm') for i in ('pallas', 'xla')}
  assert all(0 < r['bandwidth_fraction'] for r in by_section['norms'])
  plans = {r['plan'] for r in by_section['step']}
  assert plans == {'untied', 'cycle', 'universal'}
  # CPU: no published peak, so the matmul-relative figure, never a hardware 'mfu'.
  assert all('mfu_vs_matmul' in r and 'mfu' not in r for r in by_section['step'])
  md = (tmp_path / 'acc.md').read_text()
  assert '| attention/pallas | bfloat16 |' in md and '| tiny | cycle |' in md
