"""Normalization study: every activation norm and parameter transform, same steps, same data.

  python -m sharenet.studies.norm_study --config configs/norm_study.py --out runs/norm_study \
      [--config.study.schemes=untied,cycle] [--config.study.variants=rmsnorm,dyt,...]
      [--config.study.seeds=0,1,2] [--config.train.steps=N ...]

Each variant is a set of config overrides on the base config, trained with the one train loop
(loop.train_and_evaluate) into OUT/<scheme>/<variant> (seed = train.seed of the config) or
OUT/<scheme>/<variant>-seed<N> (another seed: train.seed = N, which sets both the init and the
data order). A run that hits a non-finite loss is recorded as diverged (its step), not dropped;
one that stays finite but ends more than a nat worse than the uniform distribution (eval loss >
ln vocab + 1) is recorded as unstable. Writes OUT/norm_study.json (one row per scheme x variant x
seed), OUT/norm_study.md and OUT/norm_study.png (train-loss curves of the base seed).

The table gives eval bits per byte: mean +- sample standard deviation over the seeds a cell has
(the count in brackets when it is not 1), and per scheme the difference to the baseline
(rmsnorm) paired by seed (same seed = same data order), marked resolved when a two-sided paired
t-test at 95 % rejects a zero difference (at least 2 shared seeds; 3 seeds need |t| > 4.30).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from sharenet import errors
from sharenet.studies import common
from sharenet.train import loop

# name -> (kind, overrides as dotted config keys)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    'rmsnorm': ('activation norm', {}),
    'layernorm': ('activation norm', {'model.norm.kind': 'layernorm'}),
    'crmsnorm': ('activation norm', {'model.norm.kind': 'crmsnorm'}),
    'scalenorm': ('activation norm', {'model.norm.kind': 'scalenorm'}),
    'dyt': ('activation norm', {'model.norm.kind': 'dyt'}),
    'none': ('activation norm', {'model.norm.kind': 'none'}),
    'lpnorm': ('activation norm', {'model.norm.kind': 'lpnorm', 'model.norm.p': 1.0}),
    'selu': ('no norm', {'model.mlp': 'selu', 'model.norm.kind': 'none'}),   # Klambauer et al.
    # Shen et al.'s running statistics; warmup on the batch statistic for 10 % of the 200 steps
    # (the reference's 10,000 would never leave it here)
    'powernorm': ('activation norm', {'model.norm.kind': 'powernorm',
                                      'model.norm.stats_warmup': 20}),
    # Yang et al.'s window of statistics (4, the reference's) after the same 20 steps
    'unified_norm': ('activation norm', {'model.norm.kind': 'unified_norm',
                                         'model.norm.stats_warmup': 20}),
    # Chiley et al.'s stream of tokens, with the reference's momenta and activation clamping
    'online_norm': ('activation norm', {'model.norm.kind': 'online_norm',
                                        'model.norm.stats_momentum': 0.999,
                                        'model.norm.stats_grad_momentum': 0.99}),
    'peri_rmsnorm': ('placement', {'model.norm.placement': 'peri'}),
    'qk_rms': ('QK-norm', {'model.norm.qk_norm': 'rms'}),
    'qk_l2': ('QK-norm', {'model.norm.qk_norm': 'l2'}),
    'fixnorm': ('embedding norm', {'model.norm.fixnorm': True}),
    'zero_mean_writers': ('reparam', {'transforms.reparam': 'zero_mean_writers'}),
    'weight_norm': ('reparam', {'transforms.reparam': 'weight_norm'}),
    'sigma_reparam': ('reparam', {'transforms.reparam': 'sigma_reparam'}),
    'weight_std': ('reparam', {'transforms.reparam': 'weight_std'}),
    'scale_vectors': ('reparam', {'transforms.reparam': 'scale_vectors'}),
    'weight_conditioning': ('reparam', {'transforms.reparam': 'weight_conditioning'}),
    'compander': ('reparam', {'transforms.reparam': 'compander'}),
    'ngpt_projection': ('projection', {'transforms.project': 'ngpt', 'train.weight_decay': 0.0}),
    'nap': ('projection', {'transforms.project': 'nap',                # Lyle et al.'s two parts
                           'model.norm.pre_activation': 'layernorm'}),
    'norm_project': ('projection', {'transforms.project': 'norm_project'}),
    'agc': ('update', {'transforms.updates': 'agc'}),
    'adamp': ('update', {'transforms.updates': 'adamp'}),
}
SCHEMES = {'untied': {}, 'cycle': {'model.sharing.scheme': 'cycle', 'model.sharing.repeats': 2}}
BASELINE = 'rmsnorm'
# two-sided 95 % Student t quantiles by degrees of freedom (paired test over seeds)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262}


def _seed(row: dict[str, Any], base_seed: int) -> int:
  return row.get('seed', base_seed)     # rows written before seeds existed ran the base seed


def _key(row: dict[str, Any], base_seed: int) -> tuple[str, str, int]:
  return row['scheme'], row['variant'], _seed(row, base_seed)


def run_one(base: Any, scheme: str, variant: str, out: str, seed: int) -> dict[str, Any]:
  config = common.with_overrides(base, {**SCHEMES[scheme], **VARIANTS[variant][1],
                                        'train.seed': seed})
  suffix = '' if seed == base.train.seed else f'-seed{seed}'
  workdir = os.path.join(out, scheme, variant + suffix)
  t0 = time.time()
  row = {'scheme': scheme, 'variant': variant, 'seed': seed, 'kind': VARIANTS[variant][0],
         'steps': config.train.steps}
  try:
    res = common.completed(loop.train_and_evaluate(config, workdir), workdir)
    row.update(status='ok', eval_bits_per_byte=res.get('eval_bits_per_byte'),
               eval_loss=res.get('eval_loss'), final_loss=res.get('loss'))
    if not row['eval_loss'] <= math.log(config.model.vocab_size) + 1.0:
      row['status'] = 'unstable'     # finite, but blown up: > 1 nat worse than uniform
  except errors.NonFiniteLoss as e:
    row.update(status='diverged', error=str(e).split(';')[0])
  row['seconds'] = round(time.time() - t0, 1)
  return row


def _stats(xs: list[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 for one value)."""
  mean = sum(xs) / len(xs)
  sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
  return mean, sd


def paired_difference(variant: dict[int, float], baseline: dict[int, float]
                      ) -> tuple[float, float, int, bool] | None:
  """(mean, sd, n, resolved) of variant - baseline over their shared seeds; None if none."""
  shared = sorted(set(variant) & set(baseline))
  if not shared:
    return None
  mean, sd = _stats([variant[s] - baseline[s] for s in shared])
  n = len(shared)
  if n < 2:
    return mean, sd, n, False
  resolved = mean != 0 and (sd == 0 or abs(mean) / (sd / math.sqrt(n)) > T975[min(n - 1, 9)])
  return mean, sd, n, resolved


def to_markdown(rows: list[dict[str, Any]], base_seed: int = 0) -> str:
  schemes = [s for s in SCHEMES if any(r['scheme'] == s for r in rows)]
  cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
  for r in sorted(rows, key=lambda r: _seed(r, base_seed)):
    cells.setdefault((r['scheme'], r['variant']), []).append(r)
  ok = {k: {_seed(r, base_seed): r['eval_bits_per_byte'] for r in rs if r['status'] == 'ok'}
        for k, rs in cells.items()}
  multi = any(len(rs) > 1 for rs in cells.values())
  head = '| variant | kind | ' + ' | '.join(
      f'{s} eval bits/byte' + (f' | {s} vs {BASELINE} (paired)' if multi else '')
      for s in schemes) + ' |'
  lines = [head, '|---|---|' + '---|' * (len(schemes) * (2 if multi else 1))]
  for v in [v for v in VARIANTS if any(r['variant'] == v for r in rows)]:
    out = []
    for s in schemes:
      rs = cells.get((s, v), [])
      bad = [r for r in rs if r['status'] != 'ok']
      if not rs:
        text = ''
      elif bad and bad[0]['status'] == 'unstable':
        text = f"unstable ({bad[0]['eval_bits_per_byte']:.3g})"
      elif bad:
        text = bad[0]['status']
      else:
        mean, sd = _stats(list(ok[(s, v)].values()))
        n = len(rs)
        text = f'{mean:.3f}' + (f' +- {sd:.3f} ({n})' if n > 1 else '')
      out.append(text)
      if multi:
        diff = None if bad or v == BASELINE or not rs else paired_difference(
            ok[(s, v)], ok.get((s, BASELINE), {}))
        out.append('' if diff is None else
                   f'{diff[0]:+.3f}' + (f' +- {diff[1]:.3f} ({diff[2]}), '
                                        f'{"resolved" if diff[3] else "unresolved"}'
                                        if diff[2] > 1 else ' (1 seed)'))
    lines.append(f'| {v} | {VARIANTS[v][0]} | ' + ' | '.join(out) + ' |')
  return '\n'.join(lines) + '\n'


def plot(rows: list[dict[str, Any]], out: str, path: str, base_seed: int = 0) -> None:
  """Train-loss curves (from each run's metrics.jsonl), one panel per scheme; one colour per
  variant across panels; solid: activation norms, dashed: reparams/projections, dotted: updates."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  schemes = [s for s in SCHEMES if any(r['scheme'] == s for r in rows)]
  fig, axes = plt.subplots(1, len(schemes), figsize=(6 * len(schemes) + 2, 4.5), squeeze=False,
                           sharey=True)
  cmap, handles = plt.get_cmap('tab20'), {}
  finished = {(r['scheme'], r['variant']) for r in rows if _seed(r, base_seed) == base_seed}
  for ax, scheme in zip(axes[0], schemes):
    for i, (v, (kind, _)) in enumerate(VARIANTS.items()):
      f = os.path.join(out, scheme, v, 'metrics.jsonl')
      if (scheme, v) not in finished or not os.path.exists(f):
        continue
      pts = [json.loads(line) for line in open(f)]
      pts = [(m['step'], m['loss']) for m in pts if 'loss' in m and math.isfinite(m['loss'])]
      if pts:
        style = {'reparam': '--', 'projection': '--', 'update': ':'}.get(kind, '-')
        handles[v], = ax.plot(*zip(*pts), label=v, lw=1.2, color=cmap(i % 20), ls=style)
    ax.set(title=scheme, xlabel='step', ylabel='train loss (nats/byte)', ylim=(1.3, 2.6))
    ax.grid(alpha=0.3)
  fig.legend(list(handles.values()), list(handles), loc='center right', fontsize=7)
  fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(config: Any, out: str) -> int:
  """Runs config.study's schemes x variants not yet in OUT/norm_study.json; 1 if any row is bad."""
  schemes = common.study_names(config, 'schemes', SCHEMES, 'configs/norm_study.py')
  variants = common.study_names(config, 'variants', VARIANTS, 'configs/norm_study.py')
  seeds = common.parse_list(config.study.seeds, int)
  base = common.with_overrides(config, {'train.progress': False})
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, 'norm_study.json')
  rows = json.load(open(path)) if os.path.exists(path) else []
  seed0 = config.train.seed
  done = {_key(r, seed0) for r in rows}
  for v in variants:               # a variant's cells complete before the next one starts
    for s in schemes:
      for seed in seeds:
        if (s, v, seed) in done:
          continue
        row = run_one(base, s, v, out, seed)
        print(json.dumps(row), flush=True)
        rows = common.append_row(path, row, lambda r: _key(r, seed0))
  rows = json.load(open(path)) if os.path.exists(path) else rows  # rows other workers added
  with open(os.path.join(out, 'norm_study.md'), 'w') as f:
    f.write(to_markdown(rows, seed0))
  if rows:
    plot(rows, out, os.path.join(out, 'norm_study.png'), seed0)
  bad = [r for r in rows if r['status'] != 'ok' or not math.isfinite(r['eval_bits_per_byte'])]
  print(to_markdown(rows, seed0))
  return 1 if bad else 0


if __name__ == '__main__':
  common.run_cli(main, 'runs/norm_study', 'configs/norm_study.py')
