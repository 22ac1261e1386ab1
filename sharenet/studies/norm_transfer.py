"""Norm transfer: do the optimal (learning rate, batch size) pairs share the output layer's norm?

  python -m sharenet.studies.norm_transfer --config configs/norm_transfer.py \
      --out docs/results/norm_transfer

Filatov, Wang, Ebert, Kesselheim, "Optimal Scaling Needs Optimal Norm", arXiv:2510.03871: under
Scion the optimal (eta*, B*) at every model and dataset size gives the same RMS -> l_inf
operator norm of the output layer (sharenet/train/output_norm.py), while other pairs reaching
that norm train worse. Here at CPU scale: for each width (study.widths) and data size
(study.tokens, trained tokens), every batch size B (study.batches) trains D / (B T) steps and
every LR of study.log2_lrs (all LR cells of one (width, D, B) in one jitted vmap, the LR sweep's
`train_cells`: the train loop's step, its optimizer and schedule). Each cell records its
validation loss (study.val_windows windows of the validation split) and the output norm after
its last step. Per (width, D) the optimum is the cell of least seed-mean loss; the table gives
its (eta*, B*), loss and norm, and the norms of every cell of that (width, D) for comparison.
The reading is the spread of the optimal norms across (width, D) against the spread over all
cells (their ratio max / min).

Writes OUT/norm_transfer.json, OUT/norm_transfer.md (results_tables regenerates it) and
OUT/norm_transfer.png (loss against output norm, one panel per data size, a colour per width,
the optima ringed).
"""
from __future__ import annotations

import math
import os
import time
from typing import Any

import numpy as np

from sharenet.studies import common, lr_sweep

NORM = 'output_norm/rms_to_inf'


def cell_config(base: Any, width: int, tokens: int, batch: int) -> Any:
  """The base at `width` (MLP study.mlp_ratio x width), batch `batch` and the steps that train
  `tokens` tokens; warmup a tenth of the steps."""
  s, T = base.study, base.train.seq_len
  steps = tokens // (batch * T)
  return common.with_overrides(base, {
      'model.d_model': width, 'model.mlp_dim': int(s.mlp_ratio * width),
      'train.batch_size': batch, 'train.steps': steps,
      'train.warmup_steps': max(1, steps // 10)})


def run(config: Any, log=print) -> dict[str, Any]:
  s = config.study
  widths, tokens = common.parse_list(s.widths), common.parse_list(s.tokens)
  batches, log2_lrs = common.parse_list(s.batches), common.parse_list(s.log2_lrs, float)
  lrs = [2.0 ** v for v in log2_lrs]
  t0, cells = time.time(), []
  for w in widths:
    for d in tokens:
      for b in batches:
        c = cell_config(config, w, d, b)
        val = lr_sweep.val_batch(c, int(s.val_windows))
        _, vloss, ends = lr_sweep.train_cells(c, lrs, int(s.seeds), lr_sweep.batches(
            c, c.train.steps), val, 1, last=(NORM,))
        for i, v in enumerate(log2_lrs):
          cells.append({'width': w, 'tokens': d, 'batch': b, 'steps': c.train.steps,
                        'log2_lr': v, 'val_loss': [float(x) for x in vloss[i]],
                        'output_norm': [float(x) for x in ends[NORM][i]]})
        log(f'width {w}, tokens {d}, batch {b}: {c.train.steps} steps, {time.time() - t0:.0f} s')
  return {'widths': widths, 'tokens': tokens, 'batches': batches, 'log2_lrs': log2_lrs,
          'seq_len': config.train.seq_len, 'optimizer': config.train.optimizer,
          'parametrization': config.parametrization.kind, 'seeds': int(s.seeds),
          'cells': cells, 'runtime_s': round(time.time() - t0, 1)}


def _mean(xs: list[float]) -> float:
  xs = [x for x in xs if math.isfinite(x)]
  return sum(xs) / len(xs) if xs else math.inf


def optima(result: dict[str, Any]) -> list[dict[str, Any]]:
  """Per (width, tokens): the cell of least seed-mean validation loss, and the range of the
  output norms over that (width, tokens)'s finite cells."""
  out = []
  for w in result['widths']:
    for d in result['tokens']:
      cs = [c for c in result['cells'] if c['width'] == w and c['tokens'] == d]
      best = min(cs, key=lambda c: _mean(c['val_loss']))
      norms = [_mean(c['output_norm']) for c in cs if math.isfinite(_mean(c['val_loss']))]
      out.append({'width': w, 'tokens': d, 'batch': best['batch'], 'log2_lr': best['log2_lr'],
                  'val_loss': _mean(best['val_loss']), 'norm': _mean(best['output_norm']),
                  'norm_min': min(norms), 'norm_max': max(norms)})
  return out


def to_markdown(result: dict[str, Any]) -> str:
  rows = optima(result)
  lines = ['| width | trained tokens | B* | log2 eta* | val loss | output norm at optimum | '
           'output norms over the grid |', '|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(f"| {r['width']} | {r['tokens']:,} | {r['batch']} | {r['log2_lr']:g} | "
                 f"{r['val_loss']:.3f} | {r['norm']:.1f} | {r['norm_min']:.1f} - "
                 f"{r['norm_max']:.1f} |")
  opt = [r['norm'] for r in rows]
  grid = [n for r in rows for n in (r['norm_min'], r['norm_max'])]
  lines.append(
      f"\nOutput norm: RMS -> l_inf of the readout (sharenet/train/output_norm.py). Spread of the "
      f"optimal norms over (width, tokens): max / min = {max(opt) / min(opt):.2f}; over every "
      f"cell: {max(grid) / min(grid):.2f}. {result['optimizer']} ({result['parametrization']}), "
      f"batches {', '.join(map(str, result['batches']))}, log2 LR "
      f"{result['log2_lrs'][0]:g} to {result['log2_lrs'][-1]:g}, {result['seeds']} seed(s), "
      f"sequence length {result['seq_len']}; runtime {result['runtime_s']:.0f} s.")
  return '\n'.join(lines) + '\n'


def plot(result: dict[str, Any], path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  tokens = result['tokens']
  fig, axes = plt.subplots(1, len(tokens), figsize=(5.5 * len(tokens), 4.2), squeeze=False)
  best = {(r['width'], r['tokens']): r for r in optima(result)}
  for ax, d in zip(axes[0], tokens):
    for i, w in enumerate(result['widths']):
      cs = [c for c in result['cells'] if c['width'] == w and c['tokens'] == d
            and math.isfinite(_mean(c['val_loss']))]
      ax.scatter([_mean(c['output_norm']) for c in cs], [_mean(c['val_loss']) for c in cs],
                 s=14, color=f'C{i}', label=f'width {w}')
      r = best[(w, d)]
      ax.scatter([r['norm']], [r['val_loss']], s=90, facecolors='none', edgecolors=f'C{i}')
    ax.set_xscale('log')
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set(xlabel='output layer norm (RMS -> l_inf)', ylabel='validation loss',
           title=f'{d:,} tokens (rings: the optimum of each width)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(config: Any, out: str) -> int:
  result = run(common.with_overrides(config, {'train.progress': False}))
  common.write_result(out, 'norm_transfer', result, to_markdown)
  plot(result, os.path.join(out, 'norm_transfer.png'))
  return 0


if __name__ == '__main__':
  common.run_cli(main, 'runs/norm_transfer', 'configs/norm_transfer.py')
