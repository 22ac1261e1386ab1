"""Recursion study: routed and sub-layer sharing against vanilla and recursive, at equal FLOPs.

  python -m sharenet.studies.recursion_study --config configs/recursion_study.py \
      --out runs/recursion_study [--config.study.variants=vanilla,mor_expert,...]
      [--config.study.seeds=0,1]

Every variant trains the same base model (configs/recursion_study.py) with its overrides, for as
many steps as the training-FLOPs budget allows: budget = study.base_steps x the vanilla model's
training FLOPs per step, steps = round(budget / (flops_per_token x tokens per step)) with
flops_per_token from sharenet/models/accounting.py (routed models count only the tokens each
recursion processes). This is how the Mixture-of-Recursions recipe sets its step counts
(Bae et al. 2025, arXiv 2507.10524, section 3 / its released configs: equal training FLOPs, so a
model that spends fewer FLOPs per token sees more tokens). The LR schedule follows each run's
own step count (warmup fixed, WSD decay over the last train.decay_fraction).

Writes OUT/recursion_study.json (one row per variant x seed: eval bits per byte, stored
parameters in total and in the layer stack, FLOPs per token, steps, tokens seen, median
tokens/s), OUT/recursion_study.md (mean +- sd over seeds) and OUT/recursion_study.png (eval
bits per byte against stored stack parameters).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Any

from sharenet.models import ModelConfig, accounting, param_table
from sharenet.studies import common
from sharenet.train import experiment, loop
from sharenet.train.metrics import read_metrics
from sharenet.train.workdir_io import load_config

# name -> (what it is, overrides as dotted config keys on the base config)
RECURSIVE = {'model.sharing.scheme': 'middle_cycle', 'model.sharing.repeats': 3}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    'vanilla': ('untied', {}),
    'recursive': ('middle_cycle, R=3', RECURSIVE),
    'mor_expert': ('MoR expert choice', {**RECURSIVE, 'model.routing.kind': 'expert_choice'}),
    'mor_token': ('MoR token choice', {**RECURSIVE, 'model.routing.kind': 'token_choice'}),
    'masa': ('matrix atoms (q, k, v, o)', {'model.masa.atoms': 3}),
    'kv_shared': ('Q-K=V projections', {'model.attention_sharing': 'kv_shared'}),
}
# Variants renamed since rows were written (old OUT/recursion_study.json rows still count).
RENAMED = {'qk_v': 'kv_shared'}


def _variant(row: dict[str, Any]) -> str:
  return RENAMED.get(row['variant'], row['variant'])


def _key(row: dict[str, Any]) -> tuple[str, int]:
  return _variant(row), row['seed']


def steps_for(config: Any, budget: float) -> tuple[int, float]:
  """Steps that spend `budget` training FLOPs, and the model's FLOPs per token."""
  mcfg = experiment.validate(config)
  t = config.train
  flops_tok = accounting.flops_per_token(mcfg, t.seq_len)
  return max(1, round(budget / (flops_tok * t.batch_size * t.seq_len))), flops_tok


def run_one(base: Any, variant: str, out: str, seed: int, budget: float) -> dict[str, Any]:
  config = common.with_overrides(base, {**VARIANTS[variant][1], 'train.seed': seed})
  steps, flops_tok = steps_for(config, budget)
  config = common.with_overrides(config, {'train.steps': steps,
                                          'train.checkpoint_every': steps})
  workdir = os.path.join(out, f'{variant}-seed{seed}')
  t0 = time.time()
  res = common.completed(loop.train_and_evaluate(config, workdir), workdir)
  summary = json.load(open(os.path.join(workdir, 'config.json')))
  tps = [r['tokens_per_sec'] for r in read_metrics(workdir) if 'tokens_per_sec' in r][1:]
  t = config.train
  return {'variant': variant, 'seed': seed, 'what': VARIANTS[variant][0], 'steps': steps,
          'tokens': steps * t.batch_size * t.seq_len, 'flops_per_token': flops_tok,
          'train_flops': steps * t.batch_size * t.seq_len * flops_tok,
          'params_unique': summary['params_unique'], 'params_stack': stack_params(workdir),
          'eval_bits_per_byte': res['eval_bits_per_byte'], 'eval_loss': res['eval_loss'],
          'tokens_per_sec': round(statistics.median(tps), 1) if tps else None,
          'seconds': round(time.time() - t0, 1)}


def stack_params(workdir: str) -> int:
  """Stored parameters of the layers: the trunk's and the MASA atoms the layers share (from the
  run's config and the parameters' structure metadata), i.e. everything but the embedding,
  final norm and readout."""
  config = load_config(workdir)
  table = param_table(ModelConfig.from_experiment(config))
  return sum(math.prod(i.shape) for i in table.values()
             if i.segment is not None or i.axes[:1] == ('atoms',))


def _leaf_sizes(shapes: Any, prefix: str = '') -> list[tuple[str, int]]:
  """(path, size) of every leaf of config.json's param_shapes (nested dicts of shape lists)."""
  if isinstance(shapes, dict):
    return [x for k, v in shapes.items() for x in _leaf_sizes(v, f'{prefix}/{k}')]
  return [(prefix, math.prod(shapes))]


def to_markdown(rows: list[dict[str, Any]]) -> str:
  lines = ['| variant | what | stored params (stack) | FLOPs/token | steps | eval bits/byte | '
           'tokens/s |', '|---|---|---|---|---|---|---|']
  for v in [v for v in VARIANTS if any(_variant(r) == v for r in rows)]:
    rs = [r for r in rows if _variant(r) == v]
    bpb = [r['eval_bits_per_byte'] for r in rs]
    mean = statistics.mean(bpb)
    sd = f' +- {statistics.stdev(bpb):.3f} ({len(bpb)})' if len(bpb) > 1 else ''
    tps = [r['tokens_per_sec'] for r in rs if r['tokens_per_sec']]
    tps_text = f'{statistics.median(tps):,.0f}' if tps else '-'
    r = rs[0]
    lines.append(f"| {v} | {r['what']} | {r['params_unique']:,} ({r['params_stack']:,}) | "
                 f"{r['flops_per_token'] / 1e6:.2f} M | {r['steps']} | {mean:.3f}{sd} | "
                 f"{tps_text} |")
  return '\n'.join(lines) + '\n'


def plot(rows: list[dict[str, Any]], path: str) -> None:
  """Eval bits per byte (mean, min-max over seeds) against stored stack parameters."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for v in [v for v in VARIANTS if any(_variant(r) == v for r in rows)]:
    rs = [r for r in rows if _variant(r) == v]
    bpb = [r['eval_bits_per_byte'] for r in rs]
    x, m = rs[0]['params_stack'] / 1e6, statistics.mean(bpb)
    ax.errorbar([x], [m], yerr=[[m - min(bpb)], [max(bpb) - m]], fmt='o', capsize=3, label=v)
    ax.annotate(v, (x, m), textcoords='offset points', xytext=(5, 4), fontsize=8)
  ax.set(xlabel='stored layer-stack parameters (M)', ylabel='eval bits per byte',
         title='equal training FLOPs')
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(config: Any, out: str) -> int:
  """Runs config.study's variants x seeds not yet in OUT/recursion_study.json."""
  variants = common.study_names(config, 'variants', VARIANTS, 'configs/recursion_study.py')
  seeds = common.parse_list(config.study.seeds, int)
  base = common.with_overrides(config, {'train.progress': False})
  # the budget: study.base_steps of the base (vanilla) model
  budget = (int(config.study.base_steps) * steps_for(base, 0.0)[1] * base.train.batch_size *
            base.train.seq_len)
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, 'recursion_study.json')
  rows = json.load(open(path)) if os.path.exists(path) else []
  done = {_key(r) for r in rows}
  for v in variants:
    for seed in seeds:
      if (v, seed) not in done:
        row = run_one(base, v, out, seed, budget)
        print(json.dumps(row), flush=True)
        rows = common.append_row(path, row, _key)
  with open(os.path.join(out, 'recursion_study.md'), 'w') as f:
    f.write(to_markdown(rows))
  plot(rows, os.path.join(out, 'recursion_study.png'))
  print(to_markdown(rows))
  return 0


if __name__ == '__main__':
  common.run_cli(main, 'runs/recursion_study', 'configs/recursion_study.py')
