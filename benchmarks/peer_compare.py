"""sharenet's train step side by side with a PyTorch eager GPT of the same shape and FLOPs.

Command: python -m benchmarks.peer_compare [--config.torch_python=PATH/TO/venv/bin/python]
             [--config.widths=256,512] [--config.out=benchmarks/results/peer_compare.json]
Runtime: ~10 min on the 2-core CPU (defaults). torch is not a sharenet dependency: the
reference (benchmarks/torch_reference.py) runs as a worker subprocess under
`--config.torch_python` (default: this interpreter, if it can import torch); without torch the
script measures sharenet alone and says so.

Shape (the issue's): byte vocabulary, 8 layers, d_model/64 heads, SwiGLU with mlp 3 x d_model,
seq 256, batch 8, float32, AdamW. The two models' FLOPs per token (sharenet:
models/accounting.py; reference: the same count over its modules) must agree within 2 %, or
the script stops.

Timing is interleaved: each round times `steps` train steps of every sharenet variant (the
untied model under each dense_grad x remat in `dense_grads`, `remats`), then `steps` of the
reference, so slow drift of the
machine hits both alike; each side's matmul rate (float32 2048^3, jnp.dot and torch.matmul) is
measured in the same run. Reported per width: tokens/s (median over rounds; sharenet at its
fastest remat and dense_grad in the nested scan), the paired ratio sharenet / reference per
round (median and min-max), model GFLOP/s and its fraction of each library's matmul rate;
every sharenet variant's tokens/s (dense_grad=xla is the weight-gradient program before
model.dense_grad existed; `lowerings=nested,unrolled` adds the Python-loop model, which has no
scan buffers).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import ml_collections

from benchmarks import steps
from benchmarks.torch_worker import TorchWorker, torch_python
from sharenet.config import cli
from sharenet.train import perf



def options() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.widths = '256,512'           # d_model values, comma list
  o.layers = 8
  o.seq_len = 256
  o.batch = 8
  o.remats = 'dots_no_batch,dots'   # sharenet remat policies tried; the fastest is reported
  o.dense_grads = 'auto,xla'     # model.dense_grad values tried (auto = rows on CPU); ditto
  o.lowerings = 'nested'         # layer lowerings timed: nested (the scan, reported) | flat |
                                 # unrolled (Python loop; reported by variant, never the headline)
  o.rounds = 5                   # interleaved rounds
  o.steps = 3                    # timed steps per library per round
  o.torch_python = ''            # interpreter that can import torch ('' = this one)
  o.torch_threads = 0            # torch.set_num_threads (0 = torch's default)
  o.out = ''                     # JSON results file ('' = print only)
  return o


_OPTIONS = cli.define_config_dict('config', options(), 'Benchmark options.')


def spread(xs: list[float]) -> tuple[float, float, float]:
  return statistics.median(xs), min(xs), max(xs)


def compare(d: int, args, python: str | None) -> dict:
  # 'dense_grad/remat', '/lowering' appended unless nested
  names = [f'{dg}/{remat}' + ('' if low == 'nested' else f'/{low}')
           for low in args.lowerings.split(',') if low
           for dg in args.dense_grads.split(',') if dg for remat in args.remats.split(',') if remat]
  variants = {}
  for name in names:
    dg, remat, *low = name.split('/')
    v = steps.build(d, 'untied', remat, low[0] if low else 'nested', args.seq_len, args.batch,
                    'float32', num_layers=args.layers, dense_grad=dg)
    steps.run_step(v)                                   # warm-up
    variants[name] = v
  flops_tok = next(iter(variants.values()))['flops_tok']
  worker = None
  if python:
    worker = TorchWorker(python, d, args.layers, args.seq_len, args.batch, args.torch_threads)
    ref_flops = worker.header['flops_per_token']
    if abs(ref_flops / flops_tok - 1) > 0.02:
      worker.close()
      raise SystemExit(f'error: FLOPs per token differ by more than 2 % (sharenet {flops_tok:.4g}, '
                       f'reference {ref_flops:.4g}); the two models are not the same shape')
  jax_mm, torch_mm = perf.matmul_peak_flops(), 0.0
  if worker:
    torch_mm = worker.ask('matmul')['matmul_flops']
  rounds = []
  for _ in range(args.rounds):
    r = {name: statistics.median([steps.run_step(v) for _ in range(args.steps)])
         for name, v in variants.items()}
    if worker:
      r['torch'] = statistics.median(worker.ask(f'steps {args.steps}')['times'])
    rounds.append(r)
  jax_mm = max(jax_mm, perf.matmul_peak_flops())
  if worker:
    torch_mm = max(torch_mm, worker.ask('matmul')['matmul_flops'])
    worker.close()
  tokens = args.batch * args.seq_len
  scanned = [m for m in names if m.count('/') == 1] or names
  best = min(scanned, key=lambda m: statistics.median([r[m] for r in rounds]))
  sn_s = statistics.median([r[best] for r in rounds])
  row = {'d_model': d, 'layers': args.layers, 'seq_len': args.seq_len, 'batch': args.batch,
         'flops_per_token': flops_tok, 'sharenet_variant': best,
         'sharenet_tokens_per_sec': round(tokens / sn_s, 1),
         'sharenet_tokens_per_sec_by_variant': {m: round(tokens / statistics.median(
             [r[m] for r in rounds]), 1) for m in names},
         'sharenet_gflops': round(tokens / sn_s * flops_tok / 1e9, 1),
         'jax_matmul_gflops': round(jax_mm / 1e9, 1),
         'sharenet_fraction_of_matmul': round(tokens / sn_s * flops_tok / jax_mm, 3),
         'step_ms': {k: [round(1e3 * r[k], 1) for r in rounds] for k in rounds[0]}}
  if worker:
    t_s = statistics.median([r['torch'] for r in rounds])
    med, lo, hi = spread([r['torch'] / r[best] for r in rounds])
    row.update({'torch_tokens_per_sec': round(tokens / t_s, 1),
                'torch_gflops': round(tokens / t_s * flops_tok / 1e9, 1),
                'torch_matmul_gflops': round(torch_mm / 1e9, 1),
                'torch_fraction_of_matmul': round(tokens / t_s * flops_tok / torch_mm, 3),
                'ratio': round(med, 3), 'ratio_min_max': [round(lo, 3), round(hi, 3)],
                'torch': worker.header['torch'], 'torch_threads': worker.header['threads']})
  return row


def main(argv):
  del argv
  args = _OPTIONS.value
  python = torch_python(args.torch_python)
  if python is None:
    print('peer_compare: torch is not importable here; measuring sharenet alone (pass '
          '--config.torch_python=PATH to a python with torch)', file=sys.stderr, flush=True)
  rows = []
  for d in [int(w) for w in args.widths.split(',') if w]:
    rows.append(compare(d, args, python))
    print(json.dumps(rows[-1]), flush=True)
  print('\n| d_model | sharenet tokens/s (dense_grad/remat) | PyTorch eager tokens/s | sharenet / PyTorch '
        '(median, min-max) | model GFLOP/s sharenet / PyTorch | matmul GFLOP/s jax / torch |')
  print('|---|---|---|---|---|---|')
  for r in rows:
    if 'ratio' in r:
      print(f"| {r['d_model']} | {r['sharenet_tokens_per_sec']:,.0f} ({r['sharenet_variant']}) | "
            f"{r['torch_tokens_per_sec']:,.0f} | {r['ratio']:.2f}x ({r['ratio_min_max'][0]:.2f}-"
            f"{r['ratio_min_max'][1]:.2f}) | {r['sharenet_gflops']:.0f} / {r['torch_gflops']:.0f} "
            f"| {r['jax_matmul_gflops']:.0f} / {r['torch_matmul_gflops']:.0f} |")
    else:
      print(f"| {r['d_model']} | {r['sharenet_tokens_per_sec']:,.0f} ({r['sharenet_variant']}) | "
            f"- | - | {r['sharenet_gflops']:.0f} / - | {r['jax_matmul_gflops']:.0f} / - |")
  if args.out:
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w') as f:
      json.dump({'device': jax.devices()[0].device_kind, 'date': time.strftime('%Y-%m-%d'),
                 'rows': rows,
                 # the interpreter's path is machine-specific: keep its venv-relative tail
                 'args': {**args.to_dict(), 'torch_python': os.path.join(
                     *args.torch_python.split(os.sep)[-2:]) if args.torch_python else ''}},
                f, indent=2)


if __name__ == '__main__':
  cli.run(main)
