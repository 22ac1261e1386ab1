"""LR-transfer sweep: final loss over widths (or R / depth) x learning rates x seeds.

  python -m sharenet.studies.lr_sweep --config configs/mup/transfer.py --out DIR

Every (LR, seed) cell of one model is trained at once: the cells are vmapped and the steps run
in one lax.scan of the train loop's step (trainer.train_step: transforms, grad_accum and the
optimizer of the config), each cell with its peak LR set in its optimizer state
(chain.with_peak_lr). Cell (lr, i) is the train run of the config with train.lr=lr,
train.steps=study.steps and init seed train.seed + i; all cells read the loop's batches of
train.seed in the same order.
Per width the optimum is the vertex of a quadratic in log2 LR fitted to the seed-mean loss at
the grid argmin and its neighbours (the protocol of Lingle, arXiv:2404.05728). Writes
DIR/lr_sweep.json and DIR/lr_sweep_{axis}.png (loss against LR, one curve per x, one panel per
parametrization). Each (variant, x) row is also kept in DIR/cells/ with a fingerprint of its
config and LRs: rerunning the command on DIR trains only the rows not there (an interrupted
sweep resumes; a changed config trains again).
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharenet import data
from sharenet.errors import ConfigError
from sharenet.optim import chain
from sharenet.studies import common
from sharenet.train import experiment, trainer


def batches(config: Any, steps: int) -> np.ndarray:
  """(steps, B, T + 1): the train loop's first `steps` batches (data.make_train_iterator)."""
  t = config.train
  it = data.make_train_iterator(config.data, t.seq_len, t.batch_size, t.seed)
  return np.stack([next(it) for _ in range(steps)])


def val_batch(config: Any, n: int) -> np.ndarray:
  _, val = data.load_splits(config.data)
  T = config.train.seq_len
  starts = np.linspace(0, len(val) - T - 2, n).astype(np.int64)
  return np.asarray(val, np.int32)[starts[:, None] + np.arange(T + 1)]


def train_cells(config: Any, lrs: list[float], seeds: int, tokens_SBT1: np.ndarray,
                val_BT1: np.ndarray, avg_last: int, last: tuple[str, ...] = ()) -> tuple:
  """(final train loss, val loss), each (len(lrs), seeds), for one model config; with `last`
  (names of step metrics, e.g. 'output_norm/rms_to_inf') also {name: its value after the last
  step, (len(lrs), seeds)}."""
  exp = trainer.setup(config, experiment.validate(config))
  step = trainer.make_train_step(exp, config.train.grad_accum)

  def one_cell(key, lr, toks_SBT1, val):
    state = trainer.init_state(exp.model, exp.tx, key, tr=exp.tr, pz=exp.pz)
    state = state.replace(opt_state=chain.with_peak_lr(state.opt_state, lr))
    state, metrics = jax.lax.scan(step, state, toks_SBT1)
    val_loss, _ = trainer.loss_fn(state.params, state.tstate, val, model=exp.model, tr=exp.tr,
                                    pz=exp.pz)
    return jnp.mean(metrics['loss'][-avg_last:]), val_loss, {k: metrics[k][-1] for k in last}

  seed_cells = config.train.seed + jnp.tile(jnp.arange(seeds), len(lrs))
  keys = jax.vmap(jax.random.key)(seed_cells)
  lr_cells = jnp.repeat(jnp.asarray(lrs, jnp.float32), seeds)
  run = jax.jit(jax.vmap(one_cell, in_axes=(0, 0, None, None)))
  final, val, ends = run(keys, lr_cells, jnp.asarray(tokens_SBT1), jnp.asarray(val_BT1))
  shape = (len(lrs), seeds)
  out = np.asarray(final).reshape(shape), np.asarray(val).reshape(shape)
  return out + ({k: np.asarray(v).reshape(shape) for k, v in ends.items()},) if last else out


def optimum(log2_lrs: list[float], losses: np.ndarray) -> dict[str, Any]:
  """Sub-grid optimum: vertex of a quadratic in log2 LR around the grid argmin (seed mean)."""
  mean = np.where(np.isfinite(losses), losses, np.inf).mean(axis=1)
  i = int(np.argmin(mean))
  out = {'grid_argmin_log2_lr': log2_lrs[i], 'at_edge': i in (0, len(mean) - 1)}
  lo, hi = max(0, i - 1), min(len(mean), i + 2)
  if hi - lo < 3:          # at the edge: use the 3 nearest points
    lo, hi = (0, 3) if i == 0 else (len(mean) - 3, len(mean))
  x, y = np.asarray(log2_lrs[lo:hi]), mean[lo:hi]
  if np.all(np.isfinite(y)):
    a, b, _ = np.polyfit(x, y, 2)
    v = -b / (2 * a) if a > 0 else log2_lrs[i]
    out['fit_log2_lr'] = float(np.clip(v, log2_lrs[0], log2_lrs[-1]))
  else:
    out['fit_log2_lr'] = float(log2_lrs[i])
  return out


def run_axis(config: Any, axis: str, log=print, cells_dir: str | None = None) -> dict[str, Any]:
  """One axis of the sweep: per variant, per point x, every (LR, seed) cell trained at once.
  With `cells_dir` each (variant, x) row is kept there and a rerun with the same inputs reads
  it back (common.cached_cell: an interrupted sweep resumes at its first missing point).

  Beyond width (common.BEYOND_WIDTH: batch, steps, weight_decay, warmup) every point is at
  d_model = study.fixed_width with muP's base width study.base_width, so SP and muP differ there
  as they do at that width in the width sweep. A variant may carry `log2_lrs=` (its own grid) and,
  on the weight_decay axis, `wd_scale=` (its point sets train.weight_decay = x * wd_scale, e.g. an
  independent-decay variant whose decay per step is not multiplied by the LR)."""
  s = config.study
  xs = common.parse_list(s[f'{axis}_values'], float if axis == 'weight_decay' else int)
  steps, seeds = s.steps, s.seeds
  val = val_batch(config, s.val_windows)
  beyond = axis in common.BEYOND_WIDTH
  if axis == 'width':
    base_width = xs[0]
  else:
    base_width = s.get('base_width', s.fixed_width) if beyond else s.fixed_width
  out: dict[str, Any] = {'xs': xs, 'variants': {}}
  for spec in common.parse_list(s[f'{axis}_variants'], str):
    name, settings = common.parse_variant(spec)
    log2_lrs = _grid(settings.pop('log2_lrs', s.log2_lrs))
    wd_scale = float(settings.pop('wd_scale', 1.0))
    if wd_scale != 1.0 and axis != 'weight_decay':
      raise ConfigError(f'study.{axis}_variants: {spec!r} sets wd_scale, which only the '
                        'weight_decay axis reads; valid there: wd_scale=<float>')
    lrs = [2.0 ** v for v in log2_lrs]
    base = {f'parametrization.{k}': v for k, v in settings.items()}
    base.setdefault('parametrization.base_d_model', base_width)
    base['train.steps'] = steps      # the schedule spans the sweep, as in a run of that length
    rows = {}
    for x in xs:
      point = common.point_overrides(axis, x, s)
      if axis == 'weight_decay':
        point['train.weight_decay'] = x * wd_scale
      c = common.with_overrides(config, {**base, **point})

      def cell(c=c):
        t0 = time.perf_counter()
        tokens = batches(c, c.train.steps)   # a batch / steps point reads its own stream
        final, vloss = train_cells(c, lrs, seeds, tokens, val, s.avg_last)
        return {'final_loss': final.tolist(), 'val_loss': vloss.tolist(),
                **optimum(log2_lrs, final), 'seconds': round(time.perf_counter() - t0, 1)}
      # The cell's own config, without the study keys that only pick which cells run (the
      # axes, their points and variants: a cell's point and variant are in its overrides), so
      # a slice of a sweep (e.g. one more width) shares the cells it has in common with it.
      # Cells written before this rule are fingerprinted with the whole config (`legacy`).
      own = c.to_dict()
      own['study'] = {k: v for k, v in own['study'].items()
                      if k != 'axes' and not k.endswith(('_values', '_variants'))}
      inputs = {'config': json.dumps(own, indent=2, sort_keys=True, default=str),
                'log2_lrs': log2_lrs}
      legacy = {'config': experiment.to_json(c), 'log2_lrs': log2_lrs}
      rows[str(x)] = common.cached_cell(cells_dir, f'{axis}-{name}-{x}', inputs, cell, log,
                                        also=(legacy,))
      opt = rows[str(x)]
      log(f'lr_sweep {axis} {name} x={x}: opt 2^{opt["fit_log2_lr"]:.2f} '
          f'(grid 2^{opt["grid_argmin_log2_lr"]:g}) {rows[str(x)]["seconds"]}s')
    fits = [rows[str(x)]['fit_log2_lr'] for x in xs]
    out['variants'][name] = {
        'log2_lrs': log2_lrs, 'cells': rows, 'wd_scale': wd_scale,
        'optimum_shift_log2': float(max(fits) - min(fits)),
        'optimum_slope_log2_per_doubling': slope_per_doubling(xs, fits),
        'any_at_edge': any(rows[str(x)]['at_edge'] for x in xs)}
  return out


def slope_per_doubling(xs: list[float], fits: list[float]) -> float | None:
  """Least-squares slope of the optimum (log2 LR) against log2 x over the points x > 0 (a
  weight-decay or warmup axis may start at 0); None with fewer than two such points."""
  pos = [(x, f) for x, f in zip(xs, fits) if x > 0]
  if len(pos) < 2:
    return None
  return float(np.polyfit(np.log2([x for x, _ in pos]), [f for _, f in pos], 1)[0])


def _grid(spec: str) -> list[float]:
  """'-12..-4' -> [-12, -11, ..., -4] (2x spacing); or a comma list of log2 values."""
  if '..' in str(spec):
    lo, hi = (float(v) for v in str(spec).split('..'))
    return [lo + i for i in range(int(hi - lo) + 1)]
  return common.parse_list(spec, float)


def plot(result: dict[str, Any], axis: str, path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  variants = list(result['variants'])
  fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 4), squeeze=False)
  cmap = plt.get_cmap('viridis')
  xs = result['xs']
  for j, v in enumerate(variants):
    r, ax = result['variants'][v], axes[0, j]
    all_y = []
    for k, x in enumerate(xs):
      cell = r['cells'][str(x)]
      y = np.asarray(cell['final_loss'], np.float64)
      y = np.where(np.isfinite(y), y, np.nan)
      mean = np.nanmean(y, axis=1)
      all_y += [m for m in mean if np.isfinite(m)]
      color = cmap(k / max(1, len(xs) - 1))
      ax.plot(r['log2_lrs'], mean, marker='o', ms=3, color=color, label=f'{axis}={x}')
      ax.fill_between(r['log2_lrs'], np.nanmin(y, 1), np.nanmax(y, 1), color=color, alpha=0.2)
      ax.axvline(cell['fit_log2_lr'], color=color, ls=':', lw=1)
    lo = min(all_y)
    ax.set_ylim(lo - 0.05, lo + 1.2)
    ax.set_xlabel('log2 learning rate')
    ax.set_ylabel('final train loss (nats)')
    ax.set_title(f'{v}: optimum shift {r["optimum_shift_log2"]:.2f} (log2)', fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def to_markdown(result: dict[str, Any]) -> str:
  """Per axis: each variant's optimum (log2 LR, the quadratic vertex; `edge` where the grid
  argmin is a grid end), the optimum's shift and slope per doubling, and the seed-mean final
  train loss of every (variant, LR, x) cell."""
  out = []
  for axis in [a for a, r in result.items() if isinstance(r, dict) and 'variants' in r]:
    r = result[axis]
    xs = [str(x) for x in r['xs']]
    out += [f'**{axis}**: optimum log2 LR', '',
            f'| variant | {" | ".join(xs)} | shift (log2) | slope per doubling |',
            '|---|' + '---|' * (len(xs) + 2)]
    for v, vr in r['variants'].items():
      cells = [f"{vr['cells'][x]['fit_log2_lr']:.2f}" + (' (edge)' if vr['cells'][x]['at_edge']
                                                        else '') for x in xs]
      slope = vr['optimum_slope_log2_per_doubling']
      out.append(f"| {v} | {' | '.join(cells)} | {vr['optimum_shift_log2']:.2f} | "
                 f"{'-' if slope is None else f'{slope:+.2f}'} |")
    out += ['', f'**{axis}**: seed-mean final train loss per log2 LR (the optimum row\'s '
            'neighbourhood is what the fit uses)', '',
            f'| variant | log2 LR | {" | ".join(xs)} |', '|---|---|' + '---|' * len(xs)]
    for v, vr in r['variants'].items():
      for i, lr in enumerate(vr['log2_lrs']):
        means = []
        for x in xs:
          m = np.asarray(vr['cells'][x]['final_loss'][i], float)
          means.append(f'{m.mean():.3f}' if np.all(np.isfinite(m)) else 'diverged')
        out.append(f"| {v} | {lr:g} | {' | '.join(means)} |")
    out.append('')
  return '\n'.join(out)


def shift_table(sweeps: list[tuple[str, dict[str, Any]]]) -> str:
  """One row per (sweep, axis, variant) of several lr_sweep.json results ((label, result)):
  the swept points, the optimum's shift over them (log2 LR, max - min) and its slope per
  doubling of x (over x > 0), with `edge` where an optimum sits at a grid end."""
  out = ['| optimizer | axis | variant | points | shift (log2) | slope per doubling |',
         '|---|---|---|---|---|---|']
  for label, result in sweeps:
    for axis in [a for a, r in result.items() if isinstance(r, dict) and 'variants' in r]:
      r = result[axis]
      points = ', '.join(str(x) for x in r['xs'])
      for v, vr in r['variants'].items():
        slope = vr['optimum_slope_log2_per_doubling']
        edge = ' (edge)' if vr['any_at_edge'] else ''
        out.append(f"| {label} | {axis} | {v} | {points} | {vr['optimum_shift_log2']:.2f}{edge} | "
                   f"{'-' if slope is None else f'{slope:+.2f}'} |")
  return '\n'.join(out) + '\n'


def main(config: Any, out_dir: str) -> dict[str, Any]:
  cells = functools.partial(run_axis, cells_dir=os.path.join(out_dir, 'cells'))
  result = common.run_axes(config, out_dir, 'lr_sweep', cells, plot, table=to_markdown)
  for axis in common.parse_list(config.study.axes, str):
    for v, r in result[axis]['variants'].items():
      opts = ' '.join(f'{x}:2^{r["cells"][str(x)]["fit_log2_lr"]:.2f}' for x in result[axis]['xs'])
      print(f'{axis:8s} {v:30s} optima {opts}  shift {r["optimum_shift_log2"]:.2f} '
            f'(edge: {r["any_at_edge"]})')
  print(f'wrote {out_dir}/lr_sweep.json ({result["runtime_s"]} s)')
  return result


if __name__ == '__main__':
  common.run_cli(main, 'runs/lr_sweep')
