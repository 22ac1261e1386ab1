"""Normalization study: every activation norm and parameter transform, same steps, same data.

  python -m sharenet.studies.norm_study --config configs/norm_study.py --out runs/norm_study \
      [--config.study.schemes=untied,cycle] [--config.study.variants=rmsnorm,dyt,...]
      [--config.train.steps=N ...]

Each variant is a set of config overrides on the base config, trained with the one train loop
(train_lib.train_and_evaluate) into OUT/<scheme>/<variant>. A run that hits a non-finite loss is
recorded as diverged (its step), not dropped; one that stays finite but ends more than a nat
worse than the uniform distribution (eval loss > ln vocab + 1) is recorded as unstable. Writes
OUT/norm_study.json, OUT/norm_study.md (eval bits per byte, final train loss, seconds, status)
and OUT/norm_study.png (train-loss curves).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from sharenet.studies import common

# name -> (kind, overrides as dotted config keys)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    'rmsnorm': ('activation norm', {}),
    'layernorm': ('activation norm', {'model.norm.kind': 'layernorm'}),
    'crmsnorm': ('activation norm', {'model.norm.kind': 'crmsnorm'}),
    'scalenorm': ('activation norm', {'model.norm.kind': 'scalenorm'}),
    'dyt': ('activation norm', {'model.norm.kind': 'dyt'}),
    'none': ('activation norm', {'model.norm.kind': 'none'}),
    'peri_rmsnorm': ('placement', {'model.norm.placement': 'peri'}),
    'qk_rms': ('QK-norm', {'model.norm.qk_norm': 'rms'}),
    'qk_l2': ('QK-norm', {'model.norm.qk_norm': 'l2'}),
    'fixnorm': ('embedding norm', {'model.norm.fixnorm': True}),
    'zero_mean_writers': ('reparam', {'transforms.reparam': 'zero_mean_writers'}),
    'weight_norm': ('reparam', {'transforms.reparam': 'weight_norm'}),
    'sigma_reparam': ('reparam', {'transforms.reparam': 'sigma_reparam'}),
    'weight_std': ('reparam', {'transforms.reparam': 'weight_std'}),
    'scale_vectors': ('reparam', {'transforms.reparam': 'scale_vectors'}),
    'ngpt_projection': ('projection', {'transforms.project': 'ngpt', 'train.weight_decay': 0.0}),
    'nap': ('projection', {'transforms.project': 'nap'}),
    'agc': ('update', {'transforms.updates': 'agc'}),
    'adamp': ('update', {'transforms.updates': 'adamp'}),
}
SCHEMES = {'untied': {}, 'cycle': {'model.sharing.scheme': 'cycle', 'model.sharing.repeats': 2}}


def run_one(base: Any, scheme: str, variant: str, out: str) -> dict[str, Any]:
  from sharenet import train_lib
  config = common.with_overrides(base, {**SCHEMES[scheme], **VARIANTS[variant][1]})
  workdir = os.path.join(out, scheme, variant)
  t0 = time.time()
  row = {'scheme': scheme, 'variant': variant, 'kind': VARIANTS[variant][0],
         'steps': config.train.steps}
  try:
    res = train_lib.train_and_evaluate(config, workdir)
    row.update(status='ok', eval_bits_per_byte=res.get('eval_bits_per_byte'),
               eval_loss=res.get('eval_loss'), final_loss=res.get('loss'))
    if not row['eval_loss'] <= math.log(config.model.vocab_size) + 1.0:
      row['status'] = 'unstable'     # finite, but blown up: > 1 nat worse than uniform
  except train_lib.NonFiniteLoss as e:
    row.update(status='diverged', error=str(e).split(';')[0])
  row['seconds'] = round(time.time() - t0, 1)
  return row


def to_markdown(rows: list[dict[str, Any]]) -> str:
  schemes = [s for s in SCHEMES if any(r['scheme'] == s for r in rows)]
  by = {(r['scheme'], r['variant']): r for r in rows}
  head = '| variant | kind | ' + ' | '.join(f'{s} eval bits/byte' for s in schemes) + ' |'
  lines = [head, '|---|---|' + '---|' * len(schemes)]
  for v in [v for v in VARIANTS if any(r['variant'] == v for r in rows)]:
    cells = []
    for s in schemes:
      r = by.get((s, v))
      if r is None:
        cells.append('')
      elif r['status'] == 'unstable':
        cells.append(f"unstable ({r['eval_bits_per_byte']:.3g})")
      elif r['status'] != 'ok':
        cells.append(r['status'])
      else:
        cells.append(f"{r['eval_bits_per_byte']:.3f}")
    lines.append(f'| {v} | {VARIANTS[v][0]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def plot(rows: list[dict[str, Any]], out: str, path: str) -> None:
  """Train-loss curves (from each run's metrics.jsonl), one panel per scheme; one colour per
  variant across panels; solid: activation norms, dashed: reparams/projections, dotted: updates."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  schemes = [s for s in SCHEMES if any(r['scheme'] == s for r in rows)]
  fig, axes = plt.subplots(1, len(schemes), figsize=(6 * len(schemes) + 2, 4.5), squeeze=False,
                           sharey=True)
  cmap, handles = plt.get_cmap('tab20'), {}
  finished = {(r['scheme'], r['variant']) for r in rows}
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


def _append_row(path: str, row: dict[str, Any]) -> list[dict[str, Any]]:
  """Adds `row` to the JSON list at `path` under an exclusive lock and returns the merged list.

  Several study processes may share one --out (e.g. one pinned to each core with `taskset`, each
  given its own --variants): each re-reads the file under the lock, so no row is lost.
  """
  import fcntl
  with open(path + '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    rows = json.load(open(path)) if os.path.exists(path) else []
    rows = [r for r in rows if (r['scheme'], r['variant']) != (row['scheme'], row['variant'])]
    rows.append(row)
    with open(path + '.tmp', 'w') as f:
      json.dump(rows, f, indent=1)
    os.replace(path + '.tmp', path)
  return rows


def main(config: Any, out: str) -> int:
  """Runs config.study's schemes x variants not yet in OUT/norm_study.json; 1 if any row is bad."""
  from sharenet.errors import ConfigError
  if 'study' not in config:
    raise ConfigError('the config has no study group (schemes, variants); valid: '
                      'configs/norm_study.py')
  schemes = common.parse_list(config.study.schemes, str)
  variants = common.parse_list(config.study.variants, str)
  variants = list(VARIANTS) if variants == ['all'] else variants
  for names, valid, key in ((schemes, SCHEMES, 'schemes'), (variants, VARIANTS, 'variants')):
    bad = [n for n in names if n not in valid]
    if bad:
      raise ConfigError(f'study.{key}: {bad[0]!r} is unknown; valid: {", ".join(valid)}')
  base = common.with_overrides(config, {'train.progress': False})
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, 'norm_study.json')
  rows = json.load(open(path)) if os.path.exists(path) else []
  done = {(r['scheme'], r['variant']) for r in rows}
  for s in schemes:
    for v in variants:
      if (s, v) in done:
        continue
      row = run_one(base, s, v, out)
      print(json.dumps(row), flush=True)
      rows = _append_row(path, row)
  rows = json.load(open(path)) if os.path.exists(path) else rows  # rows other workers added
  with open(os.path.join(out, 'norm_study.md'), 'w') as f:
    f.write(to_markdown(rows))
  if rows:
    plot(rows, out, os.path.join(out, 'norm_study.png'))
  bad = [r for r in rows if r['status'] != 'ok' or not math.isfinite(r['eval_bits_per_byte'])]
  print(to_markdown(rows))
  return 1 if bad else 0


if __name__ == '__main__':
  common.run_cli(main, 'runs/norm_study', 'configs/norm_study.py')
