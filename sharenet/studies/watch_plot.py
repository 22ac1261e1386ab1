"""Plots a run's train.watch rows: python -m sharenet.studies.watch_plot --workdir DIR [--out PNG]

One panel per kind (the residual stream's RMS after each applied layer; the parameters', the
gradients' and the updates' RMS; the update-to-parameter ratio; for shared sets, each use's
gradient RMS and share of its set's gradient), one line per applied layer or per role and set, against the step (sharenet/train/watch.py names the rows). Writes
DIR/watch.png unless --out names another file, and prints its path.
"""
from __future__ import annotations

import os
from typing import Any

from absl import flags

from sharenet.config import cli
from sharenet.errors import ConfigError
from sharenet.train import watch
from sharenet.train.metrics import read_metrics

KINDS = ('residual_rms', 'param_rms', 'grad_rms', 'update_rms', 'update_ratio', 'use_grad_rms',
         'use_grad_share')


def series(rows: list[dict[str, Any]]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
  """{kind: {group: (steps, values)}} of the rows' watch entries."""
  out: dict[str, dict[str, tuple[list[int], list[float]]]] = {k: {} for k in KINDS}
  for r in rows:
    for key, value in r.items():
      if key.startswith(watch.PREFIX):
        kind, group = key[len(watch.PREFIX):].split('/', 1)
        steps, values = out[kind].setdefault(group, ([], []))
        steps.append(r['step'])
        values.append(value)
  return out


def plot(workdir: str, out: str | None = None) -> str:
  """Writes the figure of `workdir`'s watch rows; -> its path (one ConfigError line for a run
  without them)."""
  if not os.path.isfile(os.path.join(workdir, 'metrics.jsonl')):
    raise ConfigError(f'--workdir {workdir} has no metrics.jsonl; valid: a train.py workdir')
  data = series(read_metrics(workdir))
  if not any(data.values()):
    raise ConfigError(f'--workdir {workdir} has no watch rows; valid: a run trained with '
                      f'--config.train.watch=True')
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  kinds = [k for k in KINDS if data[k]]
  fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 4), squeeze=False)
  for ax, kind in zip(axes[0], kinds):
    groups = sorted(data[kind], key=lambda g: (g.rstrip('0123456789'),
                                               int('0' + g[len(g.rstrip('0123456789')):])))
    for g in groups:
      steps, values = data[kind][g]
      ax.plot(steps, values, label=g, lw=1)
    ax.set_yscale('linear' if kind == 'use_grad_share' else 'log')   # shares can be < 0
    ax.set_xlabel('step')
    ax.set_title(kind)
    if len(groups) <= 12:
      ax.legend(fontsize=6)
  fig.tight_layout()
  path = out or os.path.join(workdir, 'watch.png')
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv):
  del argv
  print(plot(flags.FLAGS.workdir, flags.FLAGS.out), flush=True)


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'A train.py workdir run with train.watch.', required=True)
  flags.DEFINE_string('out', None, 'The PNG to write (default: WORKDIR/watch.png).')
  cli.run(main)
