"""Where a train step's time goes, by op category: sharenet (XLA:CPU) against the PyTorch reference.

Command (from the repository root; torch only in the interpreter you point to):

    python -m benchmarks.step_profile --config.torch_python=/path/to/python-with-torch \
        [--config.d_models=256,512] [--config.steps=3] \
        [--config.out=benchmarks/results/step_profile.json]

~4 min on the 2-core CPU. The model is peer_compare.py's (8 layers, seq 256, batch 8, byte
vocabulary, float32, sharenet's CPU defaults). sharenet: `jax.profiler` traces `steps` steps of
the compiled train step and every XLA:CPU op's time is put in a category by its HLO name (the
profile names ops by their HLO instruction): matmuls (XNNPACK `ynn` fusions and XLA dots),
scan buffers (zero-filled `broadcast`s and the `dynamic-slice` / `dynamic-update-slice` of
the scan's stacked residuals), copies and transposes, and the other fusions (elementwise and
reductions: SwiGLU, norms, RoPE, masks, softmax, optimizer). PyTorch: `torch.profiler` self
CPU time per aten op, in torch_reference.TORCH_CATEGORIES. Both are seconds per step summed
over ops; XLA:CPU runs independent ops on its two threads at once, so its sum can exceed the
step's wall time (reported beside it).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax
import ml_collections

from benchmarks import steps
from benchmarks.torch_worker import TorchWorker, torch_python
from sharenet.config import cli

MATMUL, SCAN, COPY, OTHER = ('matmul', 'scan buffers', 'copies and transposes',
                             'elementwise and reductions')


def category(name: str, opcode: str) -> str:
  """An XLA:CPU op's category from its HLO instruction name and opcode."""
  if name.startswith('ynn') or opcode in ('dot', 'convolution') or name.startswith('dot'):
    return MATMUL
  if 'dynamic' in name or name.startswith('wrapped_broadcast') or opcode == 'broadcast':
    return SCAN
  if 'copy' in name or 'transpose' in name or opcode in ('copy', 'transpose'):
    return COPY
  return OTHER


def profile_sharenet(d_model: int, n_steps: int) -> dict:
  v = steps.build(d_model, 'untied', 'dots', 'nested', 256, 8, 'float32')
  for _ in range(3):
    steps.run_step(v)
  with tempfile.TemporaryDirectory() as out:
    with jax.profiler.trace(out):
      wall = sum(steps.run_step(v) for _ in range(n_steps)) / n_steps
    trace = glob.glob(os.path.join(out, '**', '*.trace.json.gz'), recursive=True)[0]
    events = json.load(gzip.open(trace))['traceEvents']
  hlo = v['step'].as_text()
  opcodes = dict(re.findall(r'%([\w.\-]+) = [^ ]+ ([a-z\-]+)\(', hlo))
  cats: dict[str, float] = collections.Counter()
  for e in events:
    name = e.get('name', '')
    if e.get('ph') != 'X' or name not in opcodes and not name.startswith('ynn'):
      continue     # executor, thread-pool and host events: not ops of the program
    cats[category(name, opcodes.get(name, ''))] += e['dur'] / 1e6 / n_steps
  return {'wall_s': wall, 'categories_s': dict(cats)}


def options() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.torch_python = ''        # interpreter with torch; '' -> this one if it has torch
  o.d_models = '256,512'
  o.steps = 3                # profiled steps per library and width
  o.out = ''                 # JSON file for the results
  return o


_OPTIONS = cli.define_config_dict('config', options(), 'Benchmark options.')


def main(argv):
  del argv
  args = _OPTIONS.value
  python = torch_python(args.torch_python)
  rows = {}
  for d in (int(x) for x in args.d_models.split(',')):
    row = {'sharenet': profile_sharenet(d, args.steps)}
    if python:
      worker = TorchWorker(python, d, 8, 256, 8, 0)
      try:
        worker.ask('steps 2')                              # warm-up
        row['torch'] = worker.ask(f'profile {args.steps}')['profile']
      finally:
        worker.close()
    rows[d] = row
    print(json.dumps({'d_model': d, **{lib: {'wall_s': round(r['wall_s'], 3), **{
        k: round(s, 3) for k, s in sorted(r['categories_s'].items())}} for lib, r in row.items()}}))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'args': {k: v for k, v in args.items() if k != 'torch_python'}, 'rows': rows},
                f, indent=1)


if __name__ == '__main__':
  cli.run(main)
