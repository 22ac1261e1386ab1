"""Normalization study: every activation norm and parameter transform, same steps, same data.

  python -m sharenet.studies.norm_study --config configs/norm_study.py --out runs/norm_study \
      [--schemes untied,cycle] [--variants rmsnorm,dyt,...]

Each variant is a set of config overrides on the base config, trained with the one train loop
(train_lib.train_and_evaluate) into OUT/<scheme>/<variant>. A run that hits a non-finite loss is
recorded as diverged (its step), not dropped. Writes OUT/norm_study.json and OUT/norm_study.md
(eval bits per byte, final train loss, seconds, status).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
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
    'agc': ('update', {'transforms.update': 'agc'}),
    'adamp': ('update', {'transforms.update': 'adamp'}),
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
  except train_lib.NonFiniteLoss as e:
    row.update(status='diverged', error=str(e).split(';')[0])
  row['seconds'] = round(time.time() - t0, 1)
  return row


def to_markdown(rows: list[dict[str, Any]]) -> str:
  schemes = list(dict.fromkeys(r['scheme'] for r in rows))
  by = {(r['scheme'], r['variant']): r for r in rows}
  head = '| variant | kind | ' + ' | '.join(f'{s} eval bits/byte' for s in schemes) + ' |'
  lines = [head, '|---|---|' + '---|' * len(schemes)]
  for v in dict.fromkeys(r['variant'] for r in rows):
    cells = []
    for s in schemes:
      r = by.get((s, v))
      if r is None:
        cells.append('')
      elif r['status'] != 'ok':
        cells.append(r['status'])
      else:
        cells.append(f"{r['eval_bits_per_byte']:.3f}")
    lines.append(f'| {v} | {VARIANTS[v][0]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog='python -m sharenet.studies.norm_study', description=__doc__)
  p.add_argument('--config', default='configs/norm_study.py')
  p.add_argument('--out', required=True)
  p.add_argument('--schemes', default='untied,cycle')
  p.add_argument('--variants', default='all')
  p.add_argument('--steps', type=int, default=0, help='override train.steps (0: keep)')
  a = p.parse_args(argv)
  schemes = [s for s in a.schemes.split(',') if s]
  variants = list(VARIANTS) if a.variants == 'all' else [v for v in a.variants.split(',') if v]
  for name, valid in ((schemes, SCHEMES), (variants, VARIANTS)):
    bad = [n for n in name if n not in valid]
    if bad:
      print(f'error: unknown {bad[0]!r}; valid: {", ".join(valid)}', file=sys.stderr)
      return 2
  import importlib.util
  spec = importlib.util.spec_from_file_location('study_config', a.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  base = module.get_config()
  if a.steps:
    base.train.steps = a.steps
  base.train.progress = False
  os.makedirs(a.out, exist_ok=True)
  path = os.path.join(a.out, 'norm_study.json')
  rows = json.load(open(path)) if os.path.exists(path) else []
  done = {(r['scheme'], r['variant']) for r in rows}
  for s in schemes:
    for v in variants:
      if (s, v) in done:
        continue
      row = run_one(base, s, v, a.out)
      print(json.dumps(row), flush=True)
      rows.append(row)
      with open(path, 'w') as f:
        json.dump(rows, f, indent=1)
  with open(os.path.join(a.out, 'norm_study.md'), 'w') as f:
    f.write(to_markdown(rows))
  bad = [r for r in rows if r['status'] != 'ok' or not math.isfinite(r['eval_bits_per_byte'])]
  print(to_markdown(rows))
  return 1 if bad else 0


if __name__ == '__main__':
  sys.exit(main())
