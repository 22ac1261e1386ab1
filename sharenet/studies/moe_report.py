"""The experts study's tables and plot from its rows (sharenet/studies/moe_study.py).

Eval loss is in nats per token of the byte vocabulary, i.e. nats per byte. A row serves every
comparison in its `comparisons`; "vs untied" pairs each seed with the untied run of that seed
(the untied run is the same in both comparisons: its steps are the budget).
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

VARIANTS: dict[str, str] = {
    'untied': 'dense SwiGLU, untied (the baseline)',
    'dense_universal': 'dense SwiGLU, groups G=2, mlp_dim widened to the untied params',
    'moeut': 'sigma-MoE + SwitchHead, MoEUT norms, groups G=2, num_experts fitted to the '
             'untied params',
    'moeut_ffn': 'sigma-MoE feed-forward only (dense attention, pre-norm), groups G=2, '
                 'num_experts fitted to the untied params',
    'dense_universal_small': 'dense SwiGLU, groups G=2, base mlp_dim (untied FLOPs/token)',
}
COMPARISONS = ('params', 'flops')   # equal stored parameters (same steps), equal train FLOPs



TITLES = {'params': 'Equal stored parameters (every variant trains study.base_steps steps)',
          'flops': 'Equal training FLOPs (steps = the untied model\'s budget / the variant\'s '
                   'train FLOPs per step)'}


def _mean_sd(xs: Sequence[float], fmt: str = '.3f') -> str:
  m = statistics.mean(xs)
  return f'{m:{fmt}} +- {statistics.stdev(xs):{fmt}}' if len(xs) > 1 else f'{m:{fmt}}'


def rows_of(rows: list[dict[str, Any]], comparison: str) -> dict[str, list[dict[str, Any]]]:
  """variant -> its rows in `comparison`, seeds in order, variants in VARIANTS order."""
  out = {v: sorted((r for r in rows if r['variant'] == v and comparison in r['comparisons']),
                   key=lambda r: r['seed']) for v in VARIANTS}
  return {v: rs for v, rs in out.items() if rs}


def _paired(rs: list[dict[str, Any]], ref: list[dict[str, Any]]) -> str:
  """Eval loss minus the untied run's of the same seed, per seed."""
  by_seed = {r['seed']: r['eval_loss'] for r in ref}
  d = [f"{r['eval_loss'] - by_seed[r['seed']]:+.3f}" for r in rs if r['seed'] in by_seed]
  return ', '.join(d) if d else '-'


def table(rows: list[dict[str, Any]], comparison: str) -> str:
  lines = ['| variant | fitted | stored params (vs untied) | train FLOPs/token | steps | '
           'train FLOPs | eval loss (nats/byte) | per seed | vs untied, paired by seed | '
           'eval bits/byte |', '|---|---|---|---|---|---|---|---|---|---|']
  by_v = rows_of(rows, comparison)
  ref = by_v.get('untied', [])
  for v, rs in by_v.items():
    r0 = rs[0]
    fitted = ', '.join(f'{k.split(".")[-1]}={x}' for k, x in r0['fitted'].items()) or '-'
    ratio = r0['params_unique'] / r0['params_target']
    per_seed = ', '.join(f"{r['eval_loss']:.3f}" for r in rs)
    lines.append(
        f"| {v} | {fitted} | {r0['params_unique']:,} ({ratio:.3f}) | "
        f"{r0['flops_per_token'] / 1e6:.3f} M | {r0['steps']} | "
        f"{statistics.mean(r['train_flops'] for r in rs) / 1e12:.3f} T | "
        f"{_mean_sd([r['eval_loss'] for r in rs])} | "
        f"{per_seed} | "
        f"{'-' if v == 'untied' else _paired(rs, ref)} | "
        f"{_mean_sd([r['eval_bits_per_byte'] for r in rs])} |")
  return '\n'.join(lines) + '\n'


def to_markdown(rows: list[dict[str, Any]]) -> str:
  parts = []
  for c in COMPARISONS:
    if rows_of(rows, c):
      parts.append(f'{TITLES[c]}; mean +- sd over seeds:\n\n{table(rows, c)}')
  return '\n'.join(parts)


def plot(rows: list[dict[str, Any]], path: str) -> None:
  """Eval loss against training FLOPs: a line per variant through its runs (the mean over
  seeds, bars min-max), the equal-steps run filled, the equal-FLOPs run open; a dotted line
  at the FLOPs budget."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for v in VARIANTS:
    steps = sorted({r['steps'] for r in rows if r['variant'] == v})
    if not steps:
      continue
    pts = []
    for s in steps:
      rs = [r for r in rows if r['variant'] == v and r['steps'] == s]
      ls = [r['eval_loss'] for r in rs]
      pts.append((statistics.mean(r['train_flops'] for r in rs), statistics.mean(ls), min(ls),
                  max(ls), 'params' in rs[0]['comparisons']))
    (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], '-', label=v)
    for x, m, lo, hi, filled in pts:
      ax.errorbar([x], [m], yerr=[[m - lo], [hi - m]], fmt='o', capsize=3,
                  color=line.get_color(), mfc=line.get_color() if filled else 'white')
  budget = next((r['budget_flops'] for r in rows), None)
  if budget:
    ax.axvline(budget, color='gray', linestyle=':', label='equal-FLOPs budget')
  ax.set_xscale('log')
  ax.set(xlabel='training FLOPs', ylabel='eval loss (nats/byte)',
         title='filled: equal steps (equal stored params); open: equal FLOPs')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
