"""Depth study: loops at training and at test time, at equal training FLOPs (issue 29 part 7).

  python -m sharenet.studies.depth_study --config configs/depth_study.py \
      --out runs/depth_study [--config.study.variants=recursive,sampled,...]
      [--config.study.seeds=0,1]

Every variant trains the base model (configs/depth_study.py: middle_cycle, a prelude layer, one
layer looped study.mean times, a coda layer) with its overrides (VARIANTS) for as many steps as
the training-FLOPs budget allows: budget = study.base_steps x the fixed-depth recursive model's
train FLOPs per step. A step's FLOPs are what it executes (sharenet/train/sampled_depth.py
FlopsCounter:
accounting.flops_per_token for fixed depth and MoR, which counts only the tokens each recursion
runs; for a sampled depth the step's drawn depth, forward through every loop and backward
through the last `backprop`), summed over the run's own draws (a pure function of (seed, step))
until the budget is spent; the table reports their mean per token.

Each run is then evaluated at every test-time depth of study.depths
(evaluation.evaluate_depths;
MoR routes each token's recursions and takes no schedule: its trained depth only). After the
last run every trained model decodes a fixed batch of study.prompts validation windows greedily
(generate.generate): one warm-up call each that compiles, then study.decode_repeats rounds in
which each model decodes once (round robin, so a change in the shared machine's load touches
every model alike); the median tokens/s and Generation.kv_bytes_per_token. The recursive model
decodes a second time under model.kv_sharing=first with its own parameters (the stored tree is
the same: docs/loops.md), so that row measures the cache and the speed, not a model
trained with shared KV.

Writes OUT/depth_study.json (one row per variant x seed), OUT/depth_study.md (the tables: mean
over seeds) and OUT/depth_study.png (eval loss against test-time depth).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import numpy as np

from sharenet import data
from sharenet.errors import ConfigError
from sharenet.inference import generate
from sharenet.main import eval_workdir
from sharenet.models import loops
from sharenet.studies import common, depth_report
from sharenet.studies.depth_report import LOOPED, VARIANTS
from sharenet.train import evaluation, experiment, loop, sampled_depth



def overrides(variant: str, s: Any) -> dict[str, Any]:
  """Dotted config overrides of `variant` on the base config (s: its study group)."""
  sampled = {'model.recurrence.depth': 'poisson_lognormal',
             'model.recurrence.mean': float(s.mean), 'model.recurrence.backprop': int(s.backprop)}
  return {
      'vanilla': {'model.sharing.scheme': 'untied', 'model.sharing.num_unique': 0},
      'recursive': {},
      'sampled': sampled,
      'sampled_inject': {**sampled, 'model.recurrence.injection': 'add'},
      # each loop an Euler step of size mean / (the loops run): R / n at n loops
      'sampled_ode': {**sampled, 'model.recurrence.ode_step': True},
      'mor_expert': {'model.routing.kind': 'expert_choice'},
  }[variant]


def step_flops(config: Any) -> Any:
  """flops(step) -> train FLOPs per token that step executes (its sampled depth)."""
  mcfg = experiment.validate(config)
  counter, seed = sampled_depth.FlopsCounter(config.train, mcfg), int(config.train.seed)
  return lambda step: counter(sampled_depth.sample_depth(mcfg, seed, step))


def steps_for(config: Any, budget: float) -> tuple[int, float]:
  """Steps whose executed train FLOPs sum to `budget` (within half a step), and their mean
  FLOPs per token."""
  flops, tokens = step_flops(config), config.train.batch_size * config.train.seq_len
  steps, spent = 0, 0.0
  while spent + flops(steps) * tokens / 2 < budget:
    spent += flops(steps) * tokens
    steps += 1
  steps = max(steps, 1)
  spent = max(spent, flops(0) * tokens)
  return steps, spent / (steps * tokens)


def prompts(config: Any) -> list[list[int]]:
  """study.prompts windows of study.prompt_len tokens at seeded offsets of the validation split."""
  _, val = data.load_splits(config.data)
  s = config.study
  starts = np.random.default_rng(0).integers(0, len(val) - s.prompt_len, s.prompts)
  return [np.asarray(val[i:i + s.prompt_len], np.int64).tolist() for i in starts]


def _loaded(out: str, rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str, Any]]:
  """(row, field, restored model) for every row not yet decoded: its own model under 'decode',
  and the recursive model under kv_sharing=first under 'decode_kv_first'."""
  out_list = []
  for r in rows:
    if 'decode' in r:
      continue
    workdir = os.path.join(out, 'runs', f"{r['variant']}-seed{r['seed']}")
    out_list.append((r, 'decode', eval_workdir.load_for_generation(workdir)))
    if r['variant'] == 'recursive':
      out_list.append((r, 'decode_kv_first', eval_workdir.load_for_generation(
          workdir, overrides={'model.kv_sharing': 'first'})))
  return out_list


def decode_all(config: Any, out: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Greedy decoding of the fixed prompt batch by every trained model not yet decoded: one
  warm-up (compiling) call each, then study.decode_repeats rounds in which every model decodes
  once (round robin, so that a change in the machine's load touches every model alike); the
  median tokens/s, and the KV bytes per token the final cache holds. Returns the rows changed."""
  batch, s = prompts(config), config.study
  loaded = _loaded(out, rows)
  run = lambda g: generate.generate(g.model, g.variables, batch, s.new_tokens, temperature=0.0)
  warm = [run(g) for _, _, g in loaded]
  speeds: list[list[float]] = [[] for _ in loaded]
  for _ in range(s.decode_repeats):
    for i, (_, _, g) in enumerate(loaded):
      gen = run(g)
      assert gen.tokens == warm[i].tokens   # greedy: the same tokens every call
      speeds[i].append(gen.tokens_per_sec)
  for (row, field, _), w, sp in zip(loaded, warm, speeds):
    row[field] = {'tokens_per_sec': statistics.median(sp), 'kv_bytes_per_token':
                  w.kv_bytes_per_token, 'compile_seconds': round(w.compile_seconds, 2),
                  'tokens': sum(len(t) for t in w.tokens)}
  return list({id(r): r for r, _, _ in loaded}.values())


def eval_depths(workdir: str, config: Any, depths: list[int]) -> list[dict[str, Any]]:
  """Eval loss of the workdir's final checkpoint at every test-time depth."""
  g = eval_workdir.load_for_generation(workdir)
  return evaluation.evaluate_depths(g.model, g.variables, config.data, config.train.seq_len,
                               config.train.eval_batch_size, depths)


def run_one(base: Any, variant: str, out: str, seed: int, budget: float) -> dict[str, Any]:
  """Trains one variant x seed at the budget, then evaluates it at every test-time depth."""
  config = common.with_overrides(base, {**overrides(variant, base.study), 'train.seed': seed})
  steps, flops_tok = steps_for(config, budget)
  config = common.with_overrides(config, {'train.steps': steps,
                                          'train.checkpoint_every': steps})
  workdir = os.path.join(out, 'runs', f'{variant}-seed{seed}')
  t0 = time.time()
  res = common.completed(loop.train_and_evaluate(config, workdir), workdir)
  t = config.train
  row = {'variant': variant, 'seed': seed, 'what': VARIANTS[variant], 'steps': steps,
         'tokens': steps * t.batch_size * t.seq_len, 'flops_per_token': flops_tok,
         'train_flops': steps * t.batch_size * t.seq_len * flops_tok,
         'eval_loss': res['eval_loss'], 'eval_bits_per_byte': res['eval_bits_per_byte'],
         'train_seconds': round(time.time() - t0, 1)}
  if variant in LOOPED:
    row['depths'] = eval_depths(workdir, config, common.parse_list(base.study.depths, int))
  row['seconds'] = round(time.time() - t0, 1)
  return row


def check_mean(config: Any) -> None:
  """One ConfigError line unless study.mean is the plan's loop count R (the fixed-depth model's
  depth, the sampled models' mean, the plot's trained depth)."""
  R = loops.looped(experiment.validate(config)).loops
  if config.study.mean != R:
    raise ConfigError(f'study.mean={config.study.mean} must equal the plan\'s loops R={R} (the '
                      f'fixed-depth model\'s depth); valid: study.mean={R}, or model.num_layers '
                      f'set for R=study.mean')


def main(config: Any, out: str) -> int:
  """Runs config.study's variants x seeds not yet in OUT/depth_study.json, then the tables."""
  variants = common.study_names(config, 'variants', VARIANTS, 'configs/depth_study.py')
  seeds = common.parse_list(config.study.seeds, int)
  base = common.with_overrides(config, {'train.progress': False})
  recursive = common.with_overrides(base, overrides('recursive', base.study))
  check_mean(recursive)
  # the budget: study.base_steps of the fixed-depth recursive model
  per_token = step_flops(recursive)(0)
  budget = int(config.study.base_steps) * per_token * base.train.batch_size * base.train.seq_len
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, 'depth_study.json')
  rows = json.load(open(path)) if os.path.exists(path) else []
  done = {(r['variant'], r['seed']) for r in rows}
  t0 = time.time()
  for v in variants:
    for seed in seeds:
      if (v, seed) not in done:
        row = run_one(base, v, out, seed, budget)
        print(json.dumps(row), flush=True)
        rows = common.append_row(path, row, lambda r: (r['variant'], r['seed']))
  t1 = time.time()
  for row in decode_all(base, out, rows):
    rows = common.append_row(path, row, lambda r: (r['variant'], r['seed']))
  print(f'depth_study: decoding {time.time() - t1:.0f} s', flush=True)
  table = depth_report.to_markdown(rows, common.parse_list(config.study.depths, int))
  with open(os.path.join(out, 'depth_study.md'), 'w') as f:
    f.write(table)
  depth_report.plot(rows, int(config.study.mean), os.path.join(out, 'depth_study.png'))
  print(table)
  print(f'depth_study: {time.time() - t0:.0f} s for the runs not yet in {path}', flush=True)
  return 0


if __name__ == '__main__':
  common.run_cli(main, 'runs/depth_study', 'configs/depth_study.py')
