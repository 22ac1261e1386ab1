"""The dense matmuls of one train step, timed alone in jax and in PyTorch: each one's GEMM floor.

Command (from the repository root; torch is not a sharenet dependency, see peer_compare.py):

    python -m benchmarks.gemm_floor --torch_python /path/to/venv-with-torch/bin/python \
        [--d_model 256,512] [--rounds 3] [--out benchmarks/results/gemm_floor.json]

~3 min on the 2-core CPU. For the model benchmarks/peer_compare.py compares (8 layers, seq 256,
batch 8, byte vocabulary, SwiGLU 3d, untied readout), one train step multiplies, per dense
layer y = x W with x (M, K), W (K, N), M = batch x seq: the forward x W, the input gradient
dy W^T and the weight gradient x^T dy, three GEMMs of 2 M K N FLOPs each. This script times
exactly those GEMMs (q, k, v, o, gate, up, down per layer, and the readout) one by one, each
on its own inputs in the layout a step sees them (transposes as views / dot dimension numbers,
never copies), and sums them per step. The attention's batched score and value products are
left out (PyTorch runs them inside its fused causal kernel). Both libraries run the same
shapes on the same 2 threads, interleaved by round; the minimum over rounds is kept.

Reading: the step-time gap between sharenet and the PyTorch reference (peer_compare.py) that
the GEMM floors' difference accounts for is the part only a faster XLA:CPU dot library would
remove; what is left over is the rest of the program (docs/performance.md).
The same file runs under either library (--lib jax | torch prints one JSON line), so it imports
neither sharenet nor the other library.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def gemms(d_model: int, layers: int = 8, mlp_mult: int = 3, seq_len: int = 256, batch: int = 8,
          vocab: int = 256) -> list[tuple[str, int, int, int, int]]:
  """(name, kind, M, K, N) for every GEMM of one train step; kind 0 forward x W, 1 input
  gradient dy W^T, 2 weight gradient x^T dy (each 2 M K N FLOPs)."""
  M, D, F = batch * seq_len, d_model, mlp_mult * d_model
  dense = [('qkvo', D, D)] * 4 + [('gate_up', D, F)] * 2 + [('down', F, D)]
  out = []
  for name, K, N in dense * layers + [('readout', D, vocab)]:
    out += [(name, kind, M, K, N) for kind in range(3)]
  return out


def time_jax(shapes, repeats: int) -> list[float]:
  import jax
  import jax.numpy as jnp
  fwd = jax.jit(lambda x, w: x @ w)
  dx = jax.jit(lambda g, w: jax.lax.dot_general(g, w, (((1,), (1,)), ((), ()))))
  dw = jax.jit(lambda x, g: jax.lax.dot_general(x, g, (((0,), (0,)), ((), ()))))
  key = jax.random.key(0)
  times = []
  for _, kind, M, K, N in shapes:
    a_shape, b_shape = {0: ((M, K), (K, N)), 1: ((M, N), (K, N)), 2: ((M, K), (M, N))}[kind]
    a = jax.random.normal(key, a_shape, jnp.float32)
    b = jax.random.normal(key, b_shape, jnp.float32)
    f = (fwd, dx, dw)[kind]
    jax.block_until_ready(f(a, b))
    best = float('inf')
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(f(a, b))
      best = min(best, time.perf_counter() - t0)
    times.append(best)
  return times


def time_torch(shapes, repeats: int) -> list[float]:
  import torch
  times = []
  with torch.no_grad():
    for _, kind, M, K, N in shapes:
      if kind == 0:
        a, b = torch.randn(M, K), torch.randn(K, N)
        f = lambda: torch.mm(a, b)
      elif kind == 1:
        a, b = torch.randn(M, N), torch.randn(K, N)
        f = lambda: torch.mm(a, b.t())
      else:
        a, b = torch.randn(M, K), torch.randn(M, N)
        f = lambda: torch.mm(a.t(), b)
      f()
      best = float('inf')
      for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
      times.append(best)
  return times


def summarize(shapes, times) -> dict:
  flops = sum(2 * M * K * N for _, _, M, K, N in shapes)
  by_name: dict[str, float] = {}
  for (name, *_), t in zip(shapes, times):
    by_name[name] = by_name.get(name, 0.0) + t
  total = sum(times)
  return {'step_gemm_s': total, 'gflops': flops / 1e9, 'gflop_per_s': flops / total / 1e9,
          'by_layer_s': by_name}


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--lib', choices=('jax', 'torch'), default=None,
                 help='time one library and print one JSON line (the driver runs both)')
  p.add_argument('--d_model', default='256,512')
  p.add_argument('--repeats', type=int, default=3, help='timings per GEMM (minimum kept)')
  p.add_argument('--rounds', type=int, default=3, help='interleaved rounds (minimum kept)')
  p.add_argument('--torch_python', default='', help='a python with torch importable')
  p.add_argument('--out', default='', help='JSON file for the results')
  return p.parse_args(argv)


def run_lib(lib: str, widths: list[int], repeats: int) -> dict:
  if lib == 'torch':
    import torch
    torch.set_num_threads(2)   # peer_compare's reference runs torch's default, 2 on the dev CPU
  fn = time_jax if lib == 'jax' else time_torch
  return {str(d): fn(gemms(d), repeats) for d in widths}


def main(argv=None) -> None:
  args = parse(argv)
  widths = [int(w) for w in args.d_model.split(',')]
  if args.lib:
    print(json.dumps(run_lib(args.lib, widths, args.repeats)))
    return
  if not args.torch_python:
    sys.exit('gemm_floor: --torch_python is required (a python with torch importable)')
  best: dict[str, dict[str, list[float]]] = {'jax': {}, 'torch': {}}
  for _ in range(args.rounds):
    got = {'jax': run_lib('jax', widths, args.repeats)}
    res = subprocess.run([args.torch_python, __file__, '--lib', 'torch', '--d_model',
                          args.d_model, '--repeats', str(args.repeats)],
                         capture_output=True, text=True, check=True)
    got['torch'] = json.loads(res.stdout.strip().splitlines()[-1])
    for lib, per_width in got.items():
      for d, times in per_width.items():
        prev = best[lib].get(d)
        best[lib][d] = times if prev is None else [min(a, b) for a, b in zip(prev, times)]
  rows = {}
  for d in map(str, widths):
    shapes = gemms(int(d))
    rows[d] = {lib: summarize(shapes, best[lib][d]) for lib in ('jax', 'torch')}
    j, t = rows[d]['jax'], rows[d]['torch']
    print(json.dumps({'d_model': int(d), 'jax_step_gemm_s': round(j['step_gemm_s'], 4),
                      'torch_step_gemm_s': round(t['step_gemm_s'], 4),
                      'difference_s': round(j['step_gemm_s'] - t['step_gemm_s'], 4),
                      'jax_gflop_per_s': round(j['gflop_per_s'], 1),
                      'torch_gflop_per_s': round(t['gflop_per_s'], 1)}))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'args': {k: v for k, v in vars(args).items() if k != 'torch_python'},
                 'rows': rows}, f, indent=1)


if __name__ == '__main__':
  main()
