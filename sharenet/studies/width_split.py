"""Width-stable and width-sensitive parts of the loss over (width, learning rate).

  python -m sharenet.studies.width_split --sweep docs/results/mup/lr_sweep.json \
      [--out docs/results/ladder/width_split.md]

"Understanding the Mechanisms of Fast Hyperparameter Transfer" (Ghosh, Wu and Bietti,
arXiv:2512.22768) conjectures that the loss reduction splits into a width-stable component,
which sets the optimal hyperparameters, and a width-sensitive component, which improves with
width but barely moves the optimum; transfer is then "fast". This module reads the conjecture
off an LR sweep over widths (sharenet/studies/lr_sweep.py, its `width` axis) as a two-way
additive split of the seed-mean loss L_n(lr) at width n (our operationalisation, on the final
losses rather than the paper's trajectory decomposition):

  L_n(lr) = c_n + S(lr) + R_n(lr)
  c_n     = mean over lr of L_n                  the width-sensitive level (falls with width)
  S(lr)   = mean over n of L_n(lr) - c_n         the width-stable profile (one for all widths)
  R_n(lr) = the rest                             how the profile itself changes with width

Reported per parametrization: the share of the loss's LR dependence that S carries
(1 - sum R^2 / sum (L - c)^2), the optimum of S (the quadratic vertex in log2 LR, as the sweep
fits each width's), each width's own optimum and its distance from S's, the loss each width
loses at S's optimum (the transfer's suboptimality, on the grid), and the level c_n. If the
optimum's shift is explained by the width-stable part, the widths' optima sit at S's and the
suboptimality is small beside the level's fall; under SP the residual carries the shift.
Only learning rates where every width's loss is finite enter the split.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from sharenet.errors import ConfigError
from sharenet.studies import lr_sweep


def split(variant: dict[str, Any], xs: list[int]) -> dict[str, Any]:
  """The decomposition of one parametrization's width sweep (an lr_sweep variant)."""
  log2_lrs = np.asarray(variant['log2_lrs'], np.float64)
  L = np.stack([np.asarray(variant['cells'][str(x)]['final_loss'], np.float64).mean(axis=1)
                for x in xs])   # (widths, lrs), seed means
  finite = np.all(np.isfinite(L), axis=0)
  if finite.sum() < 3:
    raise ConfigError(f'width split: {int(finite.sum())} learning rates finite at every width; '
                      f'valid: a sweep with 3 or more')
  L, log2_lrs = L[:, finite], log2_lrs[finite]
  level = L.mean(axis=1)                       # c_n
  stable = (L - level[:, None]).mean(axis=0)   # S
  rest = L - level[:, None] - stable[None]     # R_n
  centred = L - level[:, None]
  share = 1.0 - float(np.sum(rest ** 2) / np.sum(centred ** 2))
  opt = lr_sweep.optimum(list(log2_lrs), stable[:, None])
  at_stable = int(np.argmin(np.abs(log2_lrs - opt['fit_log2_lr'])))
  widths = []
  for i, x in enumerate(xs):
    own = variant['cells'][str(x)]['fit_log2_lr']
    widths.append({'width': x, 'mean_loss': float(level[i]), 'optimum_log2_lr': own,
                   'offset_log2': own - opt['fit_log2_lr'],
                   'suboptimality': float(L[i, at_stable] - L[i].min()),
                   'residual_rms': float(np.sqrt(np.mean(rest[i] ** 2)))})
  return {'log2_lrs': list(log2_lrs), 'stable': stable.tolist(), 'stable_share': share,
          'stable_optimum_log2_lr': opt['fit_log2_lr'], 'stable_at_edge': opt['at_edge'],
          'level_fall': float(level[0] - level[-1]), 'widths': widths}


def to_markdown(sweep: dict[str, Any]) -> str:
  """The split of every parametrization of an lr_sweep.json's width axis."""
  if 'width' not in sweep:
    raise ConfigError('width split: the sweep has no width axis; valid: an lr_sweep.json run '
                      'with study.axes=width')
  r = sweep['width']
  xs = r['xs']
  out = ['Per parametrization: the share of the loss\'s LR dependence the width-stable profile '
         'carries, its optimum (log2 LR), and per width the level c_n (mean loss over the LRs), '
         'the width\'s own optimum minus the stable one, the loss lost at the stable optimum '
         '(grid) and the residual\'s RMS.', '',
         '| parametrization | stable share | stable optimum | level fall (first - last width) |',
         '|---|---|---|---|']
  splits = {v: split(vr, xs) for v, vr in r['variants'].items()}
  for v, s in splits.items():
    edge = ' (edge)' if s['stable_at_edge'] else ''
    out.append(f"| {v} | {s['stable_share']:.3f} | {s['stable_optimum_log2_lr']:.2f}{edge} | "
               f"{s['level_fall']:.3f} |")
  out += ['', '| parametrization | width | level c_n | optimum - stable (log2) | loss lost at '
          'stable optimum | residual RMS |', '|---|---|---|---|---|---|']
  for v, s in splits.items():
    for w in s['widths']:
      out.append(f"| {v} | {w['width']} | {w['mean_loss']:.3f} | {w['offset_log2']:+.2f} | "
                 f"{w['suboptimality']:.3f} | {w['residual_rms']:.3f} |")
  return '\n'.join(out) + '\n'


def sweeps_markdown(sweeps: list[tuple[str, dict[str, Any]]]) -> str:
  """to_markdown of several width sweeps ((optimizer label, lr_sweep.json)), one section each."""
  return '\n'.join(f'**{label}**\n\n{to_markdown(sweep)}' for label, sweep in sweeps)


def main(argv: list[str]) -> None:
  del argv
  from absl import flags
  f = flags.FLAGS
  if not os.path.isfile(f.sweep):
    raise ConfigError(f'--sweep {f.sweep} is not a file; valid: an lr_sweep.json')
  with open(f.sweep) as fh:
    text = to_markdown(json.load(fh))
  if f.out:
    with open(f.out, 'w') as fh:
      fh.write(text)
  print(text, flush=True)


if __name__ == '__main__':
  from absl import flags
  from sharenet.config import cli
  flags.DEFINE_string('sweep', 'docs/results/mup/lr_sweep.json', 'An lr_sweep.json with a '
                      'width axis.')
  flags.DEFINE_string('out', '', 'Markdown file to write (default: print only).')
  cli.run(main)
