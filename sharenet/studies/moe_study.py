"""Experts study: a MoEUT-shaped model vs dense tied and untied models (issue 30 part 7).

  python -m sharenet.studies.moe_study --config configs/moe_study.py --out runs/moe_study
      [--config.study.variants=untied,moeut,...] [--config.study.seeds=0,1]

MoEUT (Csordas et al., "MoEUT: Mixture-of-Experts Universal Transformers", arXiv:2405.16039)
reports that a shared-layer model with sigma-MoE feed-forwards, SwitchHead attention, its
peri-layernorm and G = 2 groups of layers slightly outperforms a dense untied transformer of the
same parameter count with less compute. Every variant here trains the base model
(configs/moe_study.py: untied, dense SwiGLU) with its overrides (VARIANTS). The G = 2 models
that carry the claim are sized to the untied model's stored parameters, fitting one key each
(FIT: the dense model's mlp_dim, the MoE models' num_experts at fixed expert_dim and top_k;
`fit`). moeut is the whole MoEUT layer; moeut_ffn keeps dense attention and pre-norms, so it
differs from dense_universal only in the feed-forward (one wide dense SwiGLU against many small
sigma-MoE experts of which top_k run) and from moeut only in attention and norm placement.

Two comparisons, one budget each:
- equal stored parameters: every variant trains study.base_steps steps (same tokens);
- equal training FLOPs: budget = study.base_steps x the untied model's train FLOPs per step;
  each variant takes the steps whose FLOPs sum to it (depth_study.steps_for, within half a
  step), its FLOPs per token being what it executes (models/accounting.py: attention, every
  layer's matmuls, of an expert stack only the top_k experts a token runs, every selector row).
A variant whose steps are the same under both (the untied model, and the small dense G = 2
model, which has the untied model's FLOPs per token) trains once and its row serves both.

Writes OUT/results.json (one row per variant x steps x seed; rerunning skips the rows there),
OUT/table.md (moe_report: the two tables, mean and per seed) and OUT/plot.png (eval loss
against training FLOPs).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from sharenet.errors import ConfigError
from sharenet.models import lm
from sharenet.studies import common, depth_study, moe_report
from sharenet.studies.moe_report import COMPARISONS, VARIANTS
from sharenet.train import experiment, loop

FIT = {'dense_universal': 'model.mlp_dim', 'moeut': 'model.moe.num_experts',
       'moeut_ffn': 'model.moe.num_experts'}


def overrides(variant: str, s: Any) -> dict[str, Any]:
  """Dotted config overrides of `variant` on the base config (s: its study group); a FIT key
  holds its starting value here (the fit moves it)."""
  groups = {'model.sharing.scheme': 'groups', 'model.sharing.num_unique': int(s.groups)}
  moe = {'model.moe.kind': 'sigma_moe', 'model.moe.expert_dim': int(s.expert_dim),
         'model.moe.top_k': int(s.top_k), 'model.moe.num_experts': int(s.top_k),
         'model.moe.entropy_reg': float(s.entropy_reg)}
  # MoEUT's attention and norms: SwitchHead (expert value / output projections with their
  # selection entropy) and its peri-layernorm (models/block.py placement moeut)
  attention = {'model.moe.attention': 'switchhead',
               'model.moe.attention_experts': int(s.attention_experts),
               'model.moe.attention_top_k': int(s.attention_top_k),
               'model.moe.attention_entropy_reg': float(s.attention_entropy_reg),
               'model.norm.placement': 'moeut'}
  return {'untied': {}, 'dense_universal': groups, 'moeut': {**groups, **moe, **attention},
          'moeut_ffn': {**groups, **moe}, 'dense_universal_small': groups}[variant]


def stored_params(config: Any) -> int:
  """Stored trainable parameters of the config's model (shared sets once; the role table of
  an abstract init, models/lm.py param_table: nothing is allocated)."""
  import math

  return sum(math.prod(i.shape) for i in lm.param_table(experiment.validate(config)).values())


def _get(config: Any, key: str) -> int:
  node = config
  for part in key.split('.'):
    node = node[part]
  return int(node)


def fit(config: Any, key: str, target: int) -> tuple[Any, int]:
  """(config with `key` set so its stored params come nearest to `target`, those params).
  Stored params are linear in a width or an expert count (each unit adds the same rows to
  every stored set), so two points give the line (the test checks the fitted count against
  the train loop's own); the value is rounded to the nearest integer >= its starting value
  (num_experts may not go below top_k)."""
  lo = _get(config, key)
  p_lo = stored_params(config)
  slope = stored_params(common.with_overrides(config, {key: lo + 1})) - p_lo
  if slope <= 0:
    raise ConfigError(f'{key}: stored params do not grow with it; valid: a key that sizes the '
                      f'model (model.mlp_dim, model.moe.num_experts)')
  steps = max(0, round((target - p_lo) / slope))
  return common.with_overrides(config, {key: lo + steps}), p_lo + steps * slope


def variant_config(base: Any, variant: str, target: int) -> tuple[Any, dict[str, int], int]:
  """(the variant's config, {fitted key: value}, its stored params) with FIT's key matched to
  `target` params."""
  config = common.with_overrides(base, overrides(variant, base.study))
  if variant not in FIT:
    return config, {}, stored_params(config)
  config, params = fit(config, FIT[variant], target)
  return config, {FIT[variant]: _get(config, FIT[variant])}, params


def plan(base: Any, variants: list[str]) -> list[dict[str, Any]]:
  """One entry per run: variant, config, fitted key, steps, flops per token and the
  comparisons whose budget those steps meet (both when they coincide)."""
  t = base.train
  tokens = t.batch_size * t.seq_len
  untied = common.with_overrides(base, overrides('untied', base.study))
  target = stored_params(untied)
  base_steps = int(base.study.base_steps)
  budget = base_steps * depth_study.step_flops(untied)(0) * tokens
  runs = []
  for v in variants:
    config, fitted, params = variant_config(base, v, target)
    steps_flops, per_token = depth_study.steps_for(config, budget)
    by_steps: dict[int, list[str]] = {}
    for comparison, steps in zip(COMPARISONS, (base_steps, steps_flops)):
      by_steps.setdefault(steps, []).append(comparison)
    for steps, comparisons in by_steps.items():
      runs.append({'variant': v, 'config': config, 'fitted': fitted, 'steps': steps,
                   'flops_per_token': per_token, 'comparisons': comparisons,
                   'params_unique': params, 'params_target': target,
                   'budget': budget})
  return runs


def run_one(run: dict[str, Any], seed: int, out: str) -> dict[str, Any]:
  """Trains one planned run at one seed; its row."""
  v, steps = run['variant'], run['steps']
  config = common.with_overrides(run['config'], {'train.seed': seed, 'train.steps': steps,
                                                 'train.checkpoint_every': steps})
  workdir = os.path.join(out, 'runs', f'{v}-{steps}steps-seed{seed}')
  t0 = time.time()
  res = common.completed(loop.train_and_evaluate(config, workdir), workdir)
  t = config.train
  tokens = steps * t.batch_size * t.seq_len
  return {'variant': v, 'seed': seed, 'steps': steps, 'comparisons': run['comparisons'],
          'what': VARIANTS[v], 'fitted': run['fitted'], 'params_unique': run['params_unique'],
          'params_target': run['params_target'], 'tokens': tokens,
          'flops_per_token': run['flops_per_token'],
          'train_flops': tokens * run['flops_per_token'], 'budget_flops': run['budget'],
          'eval_loss': res['eval_loss'], 'eval_bits_per_byte': res['eval_bits_per_byte'],
          'seconds': round(time.time() - t0, 1)}


def row_key(r: dict[str, Any]) -> tuple[str, int, int]:
  return r['variant'], r['steps'], r['seed']


def main(config: Any, out: str) -> int:
  """Runs config.study's variants x seeds not yet in OUT/results.json, then the table and
  plot."""
  variants = common.study_names(config, 'variants', VARIANTS, 'configs/moe_study.py')
  seeds = common.parse_list(config.study.seeds, int)
  base = common.with_overrides(config, {'train.progress': False})
  runs = plan(base, variants)
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, 'results.json')
  rows = json.load(open(path)) if os.path.exists(path) else []
  done = {row_key(r) for r in rows}
  t0 = time.time()
  for run in runs:
    for seed in seeds:
      if (run['variant'], run['steps'], seed) not in done:
        row = run_one(run, seed, out)
        print(json.dumps(row), flush=True)
        rows = common.append_row(path, row, row_key)
  table = moe_report.to_markdown(rows)
  with open(os.path.join(out, 'table.md'), 'w') as f:
    f.write(table)
  moe_report.plot(rows, os.path.join(out, 'plot.png'))
  print(table)
  print(f'moe_study: {time.time() - t0:.0f} s for the runs not yet in {path}', flush=True)
  return 0


if __name__ == '__main__':
  common.run_cli(main, 'runs/moe_study', 'configs/moe_study.py')
