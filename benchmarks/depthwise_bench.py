"""Early exit and continuous depth-wise batching vs vanilla batching, on the CPU.

Command: python -m benchmarks.depthwise_bench [--workdir DIR] [--out FILE]   (repository root)
Runtime: ~4 min on the 2-core CPU (training the model 3.3 min, the timed runs ~40 s).
Result:  at exit_threshold 0.5 (mean exit depth 1.60 of 3 loops) depth-wise batching ran 2,718
         tokens/s, 1.67x vanilla batching (1,589 tokens/s) and 1.33-1.56x the same tick
         machinery without exits; early exit in static batches gained nothing over no exit
         (374 of 384 ticks: each batch waits for its slowest member); 57 % of the tokens equal
         vanilla greedy's. docs/generation.md has the table (measured 2026-12-01,
         benchmarks/results/depthwise_cpu.json).

Model: a cycle model (2 stored sets looped 3 times, width 128, 4 heads, SwiGLU 384, RoPE, byte
vocabulary) trained 250 steps (batch 16, seq 128) on the stdlib corpus's train split, in a
temporary workdir (or `--workdir`: reuse / keep one). It is trained with the final loop's loss
only (no intermediate-loop loss, unlike RRT's early-exit training), so the shallow exits are
what the plain model gives.

Request stream: 32 prompts cut at seeded offsets from the held-out (validation) split, lengths
drawn from 8..48 bytes, 32 new tokens each, greedy. Three ways to serve it with 8 sequences in
flight:
  vanilla:   `generate.generate` on 4 fixed batches of 8 (one compiled while_loop per batch;
             every token runs every loop);
  early_exit: `DepthwiseScheduler(sync=True)`: the same fixed batches, per-sequence early exit,
             each token waiting for the slowest member of its batch;
  depthwise: `DepthwiseScheduler(sync=False)`: 8 slots, a finished request's slot refilled at
             once, a slot starts its next token right after the current one exits.
Each is run once to compile, then timed (wall time, prefill included) round-robin: each of 5
rounds runs every variant once, so drift of the shared machine hits all alike; seconds is the
median over rounds, vs_vanilla the median of the paired per-round ratios.
Also reported: ticks (batched loop applications; vanilla: 3 per token per batch), mean exit
depth (loops per token, of 3), slot occupancy, and token agreement
with vanilla greedy decoding (the fraction of generated tokens equal to vanilla's at the same
index: early exit changes the output, which is its quality cost). threshold 1.0 runs the tick
machinery without exits, which isolates its overhead against the single compiled program of
`generate`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from configs import default
from sharenet.inference import generate as gen
from sharenet.inference import loop_by_loop as ri
from sharenet.train import loop
from sharenet.main import eval_workdir
from sharenet.data import corpus

SLOTS, REQUESTS, NEW, THRESHOLDS, ROUNDS = 8, 32, 32, (1.0, 0.9, 0.7, 0.5), 5


def train_config():
  c = default.get_config()
  m, t = c.model, c.train
  m.d_model, m.num_heads, m.mlp_dim, m.num_layers = 128, 4, 384, 6
  m.sharing.scheme, m.sharing.num_unique = 'cycle', 2
  t.steps, t.batch_size, t.seq_len, t.warmup_steps = 250, 16, 128, 25
  t.checkpoint_every, t.progress, t.eval_batch_size = 250, False, 64
  return c


def request_stream(data_cfg, seed: int = 0) -> list[list[int]]:
  _, val = corpus.load_splits(data_cfg)
  rng = np.random.default_rng(seed)
  lengths = rng.integers(8, 49, REQUESTS)
  starts = rng.integers(0, len(val) - 64, REQUESTS)
  return [val[s:s + n].astype(int).tolist() for s, n in zip(starts, lengths)]


def timed_round_robin(variants: dict) -> tuple[dict, dict]:
  """{name: output of a warm run}, {name: [seconds per round]}."""
  outputs = {name: fn() for name, fn in variants.items()}   # compile
  seconds = {name: [] for name in variants}
  for _ in range(ROUNDS):
    for name, fn in variants.items():
      t0 = time.perf_counter()
      fn()
      seconds[name].append(time.perf_counter() - t0)
  return outputs, seconds


def agreement(tokens, reference) -> float:
  same = total = 0
  for a, b in zip(tokens, reference):
    same += sum(x == y for x, y in zip(a, b))
    total += len(b)
  return same / total


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--workdir', default='')
  ap.add_argument('--out', default='benchmarks/results/depthwise_cpu.json')
  args = ap.parse_args()
  t_start = time.perf_counter()
  workdir = args.workdir or tempfile.mkdtemp(prefix='depthwise_bench_')
  train_seconds = 0.0
  if not os.path.exists(os.path.join(workdir, 'config.json')):
    t0 = time.perf_counter()
    final = loop.train_and_evaluate(train_config(), workdir)
    train_seconds = time.perf_counter() - t0
    print('trained', final, f'{train_seconds:.0f}s', flush=True)
  run = eval_workdir.load_for_generation(workdir)
  model, variables = run.model, run.variables
  requests = request_stream(run.config.data)
  num_positions = max(len(p) for p in requests) + NEW - 1
  batches = [requests[i:i + SLOTS] for i in range(0, REQUESTS, SLOTS)]

  def vanilla():
    return [t for b in batches for t in gen.generate(model, variables, b, NEW,
                                                     temperature=0).tokens]

  variants = {('vanilla', None): vanilla}
  for threshold in THRESHOLDS:
    for mode, sync in (('early_exit', True), ('depthwise', False)):
      sched = ri.DepthwiseScheduler(model, variables, num_slots=SLOTS, max_new_tokens=NEW,
                                    num_positions=num_positions, exit_threshold=threshold,
                                    sync=sync)
      variants[(mode, threshold)] = (lambda sched: lambda: sched.run(requests))(sched)
  outputs, seconds = timed_round_robin(variants)
  van_tokens, van_s = outputs[('vanilla', None)], seconds[('vanilla', None)]
  n_tokens = sum(len(t) for t in van_tokens)
  loops = model.cfg.plan.segments[0].repeats
  rows = []
  for (mode, threshold), out in outputs.items():
    s = statistics.median(seconds[(mode, threshold)])
    row = dict(mode=mode, threshold=threshold, seconds=round(s, 3),
               tokens_per_sec=round(n_tokens / s, 1),
               vs_vanilla=round(statistics.median(
                   [v / x for v, x in zip(van_s, seconds[(mode, threshold)])]), 3))
    if mode == 'vanilla':
      row.update(mean_exit_depth=float(loops), occupancy=1.0, ticks=NEW * loops * len(batches),
                 agreement=1.0)
    else:
      row.update(mean_exit_depth=round(out.mean_exit_depth, 3),
                 occupancy=round(out.occupancy, 3), ticks=out.ticks,
                 agreement=round(agreement(out.tokens, van_tokens), 3))
    rows.append(row)
    print(row, flush=True)
  result = dict(device=jax.devices()[0].platform, slots=SLOTS, requests=REQUESTS,
                max_new_tokens=NEW, loops=model.cfg.plan.segments[0].repeats,
                sets_per_loop=model.cfg.plan.segments[0].num_sets, d_model=model.cfg.d_model,
                train_steps=int(run.step), train_seconds=round(train_seconds, 1),
                total_seconds=round(time.perf_counter() - t_start, 1), rows=rows)
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == '__main__':
  main()
