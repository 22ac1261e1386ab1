"""Train-step throughput and matmul-relative MFU: scanned sharing plans vs a Python-unrolled model.

Command: python -m benchmarks.step_bench [--config.widths=256,512]
             [--config.out=benchmarks/results/step_cpu.json]   (from the repository root)
Runtime: ~12 min on the 2-core CPU. Config: 8 applied layers, seq 256, batch 8, float32,
SwiGLU (mlp 3x), byte vocab. Tied plans run under both model.scan_lowering values (nested scans;
one flat scan over the gathered sets), each with remat dots_no_batch and dots. mfu_vs_matmul =
model FLOP/s (accounting.flops_per_token, causal attention halved) / FLOP/s of a jitted 2048^3
jnp.dot measured in the same process (sharenet/train/perf.py; the train loop's `mfu` is against the
hardware peak instead).

Timing is round-robin: each round runs one step of every variant, so slow drift of the machine
hits all variants alike. Throughput is the median step time over rounds; "vs unrolled" is the
median over rounds of the paired ratio (unrolled step time / scanned step time in the same
round), reported with its 25th-75th percentile range.
"""
from __future__ import annotations

import json
import os
import statistics

import jax
import ml_collections

from benchmarks.steps import SCHEMES, build, quantile, run_step
from sharenet.config import cli
from sharenet.train import perf


def options() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.widths = '256,512'           # d_model values, comma list
  o.remats = 'dots_no_batch,dots'
  o.lowerings = 'nested,flat'    # model.scan_lowering for tied plans
  o.seq_len = 256
  o.batch = 8
  o.rounds = 8                   # timed steps per variant, round-robin
  o.dtype = 'float32'
  o.out = ''                     # JSON results file ('' = print only)
  return o


_OPTIONS = cli.define_config_dict('config', options(), 'Benchmark options.')


def main(argv):
  del argv
  args = _OPTIONS.value
  peak = perf.matmul_peak_flops()
  rows = []
  for d in [int(w) for w in args.widths.split(',')]:
    variants = {}
    for scheme in SCHEMES:
      # untied has one set per layer: its flat lowering is the nested one minus a 1-trip loop.
      for layers in ['nested'] if scheme == 'untied' else args.lowerings.split(','):
        for remat in args.remats.split(','):
          variants[(scheme, remat, layers)] = build(d, scheme, remat, layers, args.seq_len,
                                                    args.batch, args.dtype)
    for remat in ('none', 'dots_no_batch'):
      variants[('untied', remat, 'unrolled')] = build(d, 'untied', remat, 'unrolled',
                                                      args.seq_len, args.batch, args.dtype)
    for v in variants.values():
      run_step(v)                                    # warm-up
    for _ in range(args.rounds):
      for v in variants.values():
        v['times'].append(run_step(v))
      peak = max(peak, perf.matmul_peak_flops())
    tokens = args.batch * args.seq_len
    for (scheme, remat, kind), v in variants.items():
      step_s = statistics.median(v['times'])
      tps = tokens / step_s
      rows.append({'d_model': d, 'scheme': scheme, 'remat': remat, 'layers': kind,
                   'step_ms': round(1e3 * step_s, 1), 'tokens_per_sec': round(tps, 1),
                   'step_ms_all': [round(1e3 * t, 1) for t in v['times']],
                   'mfu_vs_matmul': round(tps * v['flops_tok'] / peak, 4),
                   'compile_s': round(v['compile_s'], 2), 'temp_mb': round(v['temp_mb'], 1)})
      print(json.dumps(rows[-1]), flush=True)
    del variants
  print(f'\nmatmul peak: {peak / 1e9:.1f} GFLOP/s ({jax.devices()[0].device_kind})')
  print('| d_model | model | lowering | best remat | tokens/s | MFU vs matmul | vs unrolled '
        '(median, '
        'p25-p75) |')
  print('|---|---|---|---|---|---|---|')
  summary = []
  for d in sorted({r['d_model'] for r in rows}):
    best = {}   # (scheme, layers) -> fastest remat's row
    for r in rows:
      key = ('unrolled', 'unrolled') if r['layers'] == 'unrolled' else (r['scheme'], r['layers'])
      if r['d_model'] == d and (key not in best or
                                r['tokens_per_sec'] > best[key]['tokens_per_sec']):
        best[key] = r
    base = best[('unrolled', 'unrolled')]['step_ms_all']
    for (scheme, layers), b in best.items():
      paired = [u / t for u, t in zip(base, b['step_ms_all'])]
      ratio = statistics.median(paired)
      lo, hi = quantile(paired, 0.25), quantile(paired, 0.75)
      summary.append({**b, 'name': scheme, 'vs_unrolled': round(ratio, 3),
                      'vs_unrolled_p25_p75': [round(lo, 3), round(hi, 3)]})
      print(f"| {d} | {scheme} | {layers} | {b['remat']} | {b['tokens_per_sec']:,.0f} | "
            f"{100 * b['mfu_vs_matmul']:.1f}% | {ratio:.2f}x ({lo:.2f}-{hi:.2f}) |")
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, 'w') as f:
      json.dump({'peak_flops': peak, 'device': jax.devices()[0].device_kind, 'rows': rows,
                 'summary': summary, 'args': args.to_dict()}, f, indent=2)


if __name__ == '__main__':
  cli.run(main)
