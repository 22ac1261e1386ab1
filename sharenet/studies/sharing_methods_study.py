"""Sharing methods at equal stored parameters: every way to share of docs/sharing.md and
docs/loops.md beside untied, cycle and MASA.

  python -m sharenet.studies.sharing_methods_study --config configs/sharing_methods_study.py \
      --out runs/sharing_methods_study [--config.study.variants=cycle,bank,...]
      [--config.study.seeds=0,1]

The budget is the stored parameters of the base model (configs/sharing_methods_study.py: 4
applied layers) as a cycle of 2 stored sets. Each variant sets its own knob so that its stored
parameters come closest to that budget (`variant_config`: the candidate values' counts from the
role table, nothing allocated): untied stores 2 layers; MASA 2 atoms of all six kernel types;
the bank the budget less everything outside the block kernels; MPO at full bonds (its shared
centres hold one set of kernels) and CEM's tied layers the number of layers. Variants without a
knob (sliced loops, sampled and Euler-step depth, factorized embeddings, experts) take the
cycle's plan and report their own count. Every variant trains the same steps on the same data;
the looped ones (but the sliced and the self-attentive embedding, which the compatibility table
refuses at another depth) are also evaluated at one loop
(`evaluate_workdir_depths`, eval.py --depths): the Euler-step model and the plain looped one,
both trained with a sampled depth, and the cycle trained at its fixed depth.

Dynamic tying starts from the cycle's plan (an explicit 0,1,0,1) and its controller re-chooses
the plan every 25 steps with at most 2 stored sets; its row reports the plan it ended with.
Not in the grid: PostShare and DirectShare (conversions of a trained untied model; measured in
docs/sharing.md).

Writes OUT/sharing_methods_study.json (a row per variant x seed), OUT/sharing_methods_study.md
(mean +- sd over seeds; results_tables regenerates it) and OUT/sharing_methods_study.png (eval
bits per byte against stored parameters).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Any, Callable

from sharenet.errors import ConfigError
from sharenet.main import eval_workdir
from sharenet.models import ModelConfig, bank as bank_lib, param_table
from sharenet.models.masa import atom_specs
from sharenet.studies import common
from sharenet.train import experiment, loop, workdir_io

CYCLE = {'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2}
ALL = 'q,k,v,o,mlp_in,mlp_out'
# recurrent depth's sampled loops (docs/loops.md): Poisson log-normal around the plan's 2
SAMPLED = {'model.recurrence.depth': 'poisson_lognormal', 'model.recurrence.mean': 2.0,
           'model.recurrence.backprop': 2}


def bank_sizes(config: Any) -> list[int]:
  """The bank sizes whose stored totals bracket the budget: everything but the bank and its
  mappings from one model, the mappings (sets x ceil(C / n_p)) by arithmetic, so only the two
  columns counts nearest the budget are built (`variant_config` picks the closer)."""
  d = config.model.d_model
  c0 = config.model.mlp_dim
  probe = common.with_overrides(config, {'model.bank.size': d * c0})
  mcfg = ModelConfig.from_experiment(probe)
  widths = [bank_lib.window_width(spec[0], spec[2])
            for spec in atom_specs(mcfg, mcfg.bank_kernels).values()]
  sets = mcfg.plan.num_unique
  mappings = lambda c: sets * sum(-(-c // n) for n in widths)
  rest = stored(probe) - d * c0 - mappings(c0)
  budget = stored(common.with_overrides(config, CYCLE))
  c = c0
  while rest + d * (c + 1) + mappings(c + 1) <= budget:
    c += 1
  return [d * c, d * (c + 1)]
# name -> (what it is, the paper, fixed overrides, (knob key, candidate values) or None)
VARIANTS: dict[str, tuple[str, str, dict[str, Any], tuple[str, Callable] | None]] = {
    'untied': ('2 untied layers', '-', {}, ('model.num_layers', lambda c: range(1, 9))),
    'cycle': ('cycle, 2 sets x 2 loops', 'RRT arXiv:2410.20672', CYCLE, None),
    'masa': ('MASA atoms, all kernels', 'arXiv:2508.04581',
             {'model.masa.targets': ALL}, ('model.masa.atoms', lambda c: range(1, 5))),
    'bank': ('parameter bank', 'SSN arXiv:2006.10598', {}, ('model.bank.size', bank_sizes)),
    # at full bonds the shared centres hold one set of kernels: the budget buys depth
    'mpo': ('MPO, central tensor shared, full bonds', 'MPOBERT (EMNLP 2023)',
            {'model.mpo.cores': 3}, ('model.num_layers', lambda c: range(4, 25))),
    'cem': ('CEM tied attention + MLP', 'arXiv:2605.07588',
            {'model.attention_sharing': 'cem', 'model.mlp_tied': True},
            ('model.num_layers', lambda c: range(1, 9))),
    'sliced': ('cycle, loop 1 in 4 slices', 'SReT arXiv:2111.05297',
               {**CYCLE, 'model.loop_slices': '4,1'}, None),
    'sampled': ('cycle, sampled depth', 'arXiv:2502.05171', {**CYCLE, **SAMPLED}, None),
    'ode': ('cycle as Euler steps, sampled depth', 'arXiv:2310.12818',
            {**CYCLE, **SAMPLED, 'model.recurrence.ode_step': True}, None),
    'embed_linear': ('cycle, factorized embedding E = d/4', 'ALBERT arXiv:1909.11942',
                     {**CYCLE, 'model.embed_projection': 'linear'}, None),
    'embed_safe': ('cycle, self-attentive embedding', 'Subformer arXiv:2101.00234',
                   {**CYCLE, 'model.embed_projection': 'self_attentive'}, None),
    'moe_cycle': ('cycle, sigma-MoE experts', 'MoEUT arXiv:2405.16039',
                  {**CYCLE, 'model.moe.kind': 'sigma_moe', 'model.moe.num_experts': 4,
                   'model.moe.top_k': 2}, None),
    # starts as the cycle's plan (explicit) and re-chooses it 12 times a run (every 25 of the
    # study's 300 steps; `variant_config`), at most 2 sets
    'dynamic_tying': ('explicit plan re-chosen every 25 steps, <= 2 sets', 'arXiv:2401.12819',
                      {'model.sharing.scheme': 'explicit', 'model.sharing.num_unique': 0,
                       'model.sharing.pattern': '0,1,0,1', 'train.tying.max_sets': 2}, None),
    'moe_router_per_layer': ('cycle, experts with per-layer routers', 'arXiv:2209.08326',
                             {**CYCLE, 'model.moe.kind': 'sigma_moe',
                              'model.moe.num_experts': 4, 'model.moe.top_k': 2,
                              'model.moe.router_per_layer': True}, None),
}
# evaluated at one loop too (the table refuses test-time depth for sliced loops, whose slicing
# is fixed per loop, and for the self-attentive embedding)
LOOPED = ('cycle', 'sampled', 'ode', 'embed_linear', 'moe_cycle', 'moe_router_per_layer')


def stored(config: Any) -> int:
  """Stored trainable parameters of `config`'s model (its role table; nothing allocated)."""
  return sum(math.prod(i.shape) for i in param_table(ModelConfig.from_experiment(config))
             .values())


def variant_config(base: Any, variant: str, budget: int) -> Any:
  """The base with the variant's overrides and, where it has a knob, the candidate value whose
  stored parameters come closest to `budget` (the first of equally close ones)."""
  _, _, fixed, knob = VARIANTS[variant]
  overrides = dict(fixed)
  d = base.model.d_model
  if variant.startswith('embed'):   # a quarter of the width, at least one attention head
    overrides['model.embed_dim'] = max(d // 4, d // base.model.num_heads)
  if variant == 'dynamic_tying':   # 12 decisions a run (every 25 steps at the study's 300)
    overrides['train.tying.every'] = max(1, base.train.steps // 12)
  if variant.startswith('moe'):   # the experts hold the dense MLP's hidden units in all
    overrides['model.moe.expert_dim'] = base.model.mlp_dim // 4
  config = common.with_overrides(base, overrides)
  if knob is None:
    return config
  key, candidates = knob
  best = None
  for value in candidates(config):
    try:
      trial = common.with_overrides(config, {key: value})
      gap = abs(stored(trial) - budget)
    except ConfigError:   # a candidate the model refuses (a bond above full rank): skipped
      continue
    if best is None or gap < best[0]:
      best = (gap, trial)
  return best[1]


def run_one(base: Any, variant: str, out: str, seed: int, budget: int) -> dict[str, Any]:
  config = common.with_overrides(variant_config(base, variant, budget), {'train.seed': seed})
  workdir = os.path.join(out, f'{variant}-seed{seed}')
  t0 = time.time()
  res = common.completed(loop.train_and_evaluate(config, workdir), workdir)
  mcfg = experiment.validate(config)
  row = {'variant': variant, 'seed': seed, 'what': VARIANTS[variant][0],
         'paper': VARIANTS[variant][1], 'params_unique': stored(config), 'budget': budget,
         'applied_layers': mcfg.num_layers, 'eval_loss': res['eval_loss'],
         'eval_bits_per_byte': res['eval_bits_per_byte'], 'seconds': round(time.time() - t0, 1)}
  if variant == 'dynamic_tying':   # the plan it ended with: its stored parameters
    final = workdir_io.load_config(workdir)
    row['params_unique'] = stored(final)
    row['plan'] = final.model.sharing.pattern
  if variant in LOOPED:   # one loop instead of the trained two
    at = eval_workdir.evaluate_workdir_depths(workdir, None, None, [1])[0]
    row['eval_loss_1_loop'] = at['eval_loss']
  return row


def to_markdown(rows: list[dict[str, Any]]) -> str:
  lines = ['| variant | what | paper | stored params (budget) | applied layers | eval loss | '
           'eval bits/byte | eval loss at 1 loop |', '|---|---|---|---|---|---|---|---|']
  for v in [v for v in VARIANTS if any(r['variant'] == v for r in rows)]:
    rs = [r for r in rows if r['variant'] == v]
    r = rs[0]
    one = [x['eval_loss_1_loop'] for x in rs if 'eval_loss_1_loop' in x]
    what = r['what'] + (f" (ended {'; '.join(x['plan'] for x in rs)})" if 'plan' in r else '')
    counts = sorted({x['params_unique'] for x in rs})
    params = f'{counts[0]:,}' + (f'-{counts[-1]:,}' if len(counts) > 1 else '')
    lines.append(
        f"| {v} | {what} | {r['paper']} | {params} ({r['budget']:,}) | "
        f"{r['applied_layers']} | {common.mean_sd([x['eval_loss'] for x in rs], '.3f', '+-')} | "
        f"{common.mean_sd([x['eval_bits_per_byte'] for x in rs], '.3f', '+-')} | "
        f"{common.mean_sd(one, '.3f', '+-') if one else '-'} |")
  seeds = sorted({r['seed'] for r in rows})
  lines.append(f'\nMean +- sd over seeds {",".join(map(str, seeds))}; eval loss in nats.')
  return '\n'.join(lines) + '\n'


def plot(rows: list[dict[str, Any]], path: str) -> None:
  """Eval bits per byte (mean, min-max over seeds) against stored parameters."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.8))
  for v in [v for v in VARIANTS if any(r['variant'] == v for r in rows)]:
    rs = [r for r in rows if r['variant'] == v]
    bpb = [r['eval_bits_per_byte'] for r in rs]
    x, m = rs[0]['params_unique'] / 1e3, statistics.mean(bpb)
    ax.errorbar([x], [m], yerr=[[m - min(bpb)], [max(bpb) - m]], fmt='o', capsize=3)
    ax.annotate(v, (x, m), textcoords='offset points', xytext=(5, 3), fontsize=8)
  ax.axvline(rows[0]['budget'] / 1e3, color='grey', lw=0.8, ls='--')
  ax.set(xlabel='stored parameters (thousands; dashed: the budget)', ylabel='eval bits per byte',
         title='sharing methods at equal stored parameters, equal steps')
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(config: Any, out: str) -> int:
  """Runs config.study's variants x seeds not yet in OUT/sharing_methods_study.json."""
  variants = common.study_names(config, 'variants', VARIANTS,
                                'configs/sharing_methods_study.py')
  seeds = common.parse_list(config.study.seeds, int)
  base = common.with_overrides(config, {'train.progress': False})
  budget = stored(common.with_overrides(base, CYCLE))
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, 'sharing_methods_study.json')
  rows = json.load(open(path)) if os.path.exists(path) else []
  done = {(r['variant'], r['seed']) for r in rows}
  for v in variants:
    for seed in seeds:
      if (v, seed) not in done:
        row = run_one(base, v, out, seed, budget)
        print(json.dumps(row), flush=True)
        rows = common.append_row(path, row, lambda r: (r['variant'], r['seed']))
  with open(os.path.join(out, 'sharing_methods_study.md'), 'w') as f:
    f.write(to_markdown(rows))
  plot(rows, os.path.join(out, 'sharing_methods_study.png'))
  print(to_markdown(rows))
  return 0


if __name__ == '__main__':
  common.run_cli(main, 'runs/sharing_methods_study', 'configs/sharing_methods_study.py')
