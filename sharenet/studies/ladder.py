"""Compute ladder: muP models of growing width for several sharing plans, each trained to a
token budget that grows with its size at the learning rate transferred from the smallest rung;
power-law fits of the loss against stored parameters, applied parameters and training FLOPs;
the largest rung predicted from the others.

  python -m sharenet.studies.ladder --config configs/ladder.py --out runs/ladder

The protocol (Mu-scaling, Yao et al., arXiv:2304.06875: under muP the loss of models at the
transferred hyperparameters follows a scaling law that predicts larger models without a search
at their size; the frontier of shared against untied models as Mixture-of-Recursions,
arXiv:2507.10524, draws it from a ladder of 135M-1.7B models):

1. per plan of `study.plans`, an LR sweep (`study.log2_lrs`, `study.sweep_seeds` seeds) at the
   smallest width of `study.widths` for that rung's budget: its optimum (the quadratic vertex of
   sharenet/studies/lr_sweep.py) is the plan's LR at every width (muP, base width = the
   smallest);
2. every rung (plan x width) trains `study.seeds` seeds at that LR for
   steps = ceil(study.tokens_per_param x applied parameters / tokens per step): the budget in
   tokens grows in proportion to the applied parameters (the config's rule; Chinchilla's is 20
   tokens per parameter), so FLOPs grow as their square; its loss is the validation loss after
   the last step (seed mean);
3. per plan and per x in (stored parameters, applied parameters, training FLOPs):
   L(x) = E + A x^-alpha fitted to all rungs, and to all but the largest, whose loss the latter
   predicts (the held-out error);
4. the frontier: loss against training FLOPs and against stored parameters, one curve per plan,
   and each plan's fit read at the untied rungs' stored sizes (equal stored parameters).

The rungs of one plan differ only in width: plans with the same applied depth train the same
tokens at a width (equal FLOPs); a plan with depth-wise LoRA adds the LoRA's applied parameters.
Writes OUT/ladder.json, OUT/ladder.md (`python -m sharenet.studies.results_tables` regenerates
it from the JSON) and OUT/ladder_frontier.png. Each sweep and rung is a cell kept under
OUT/cells with a fingerprint of its inputs: rerunning the command resumes at the first missing
cell.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import numpy as np

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, abstract_variables, accounting
from sharenet.studies import common, lr_sweep
from sharenet.train import experiment

AXES = ('stored', 'applied', 'flops')
AXIS_LABELS = {'stored': 'stored parameters', 'applied': 'applied parameters',
               'flops': 'training FLOPs'}


def overrides_of(spec: str) -> dict[str, Any]:
  """'model.sharing.scheme=cycle;model.sharing.num_unique=2' -> its dotted-key overrides
  (values read as JSON where they parse: numbers, booleans)."""
  out: dict[str, Any] = {}
  for item in (x.strip() for x in str(spec).split(';')):
    if not item:
      continue
    if '=' not in item:
      raise ConfigError(f'study.plan_overrides: {item!r} is not key=value; valid: '
                        f'\'model.sharing.scheme=cycle;model.sharing.num_unique=2\'')
    key, value = item.split('=', 1)
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out


def plans(study: Any) -> dict[str, dict[str, Any]]:
  """{plan name: its config overrides} of study.plans, each a name of study.plan_overrides."""
  names = common.parse_list(study.plans, str)
  table = study.plan_overrides.to_dict()
  unknown = [n for n in names if n not in table]
  if unknown or not names:
    raise ConfigError(f'study.plans names {unknown or "no plan"}; valid: a comma list of '
                      f'{", ".join(table)}')
  return {n: overrides_of(table[n]) for n in names}


def widths(study: Any) -> list[int]:
  """study.widths, checked: at least 3 rungs (a fit of 3 parameters and one held out needs 4
  for a prediction), strictly growing, each divisible by the heads."""
  ws = common.parse_list(study.widths, int)
  if len(ws) < 3 or any(b <= a for a, b in zip(ws, ws[1:])):
    raise ConfigError(f'study.widths={study.widths!r}: the rungs must grow (each wider than '
                      f'the last) and number at least 3; valid: e.g. 64,96,128,192,256')
  return ws


def rung_config(config: Any, plan: dict[str, Any], width: int, base_width: int) -> Any:
  """The config of one rung: the plan at `width` (mlp_dim = study.mlp_ratio x width), muP with
  base width `base_width`, the budget's steps."""
  s = config.study
  heads = config.model.num_heads
  if width % heads:
    raise ConfigError(f'study.widths: {width} is not divisible by model.num_heads={heads}; '
                      f'valid: widths that are multiples of {heads}')
  c = common.with_overrides(config, {**plan, 'model.d_model': width,
                                     'model.mlp_dim': int(s.mlp_ratio * width),
                                     'parametrization.base_d_model': base_width})
  sizes = sizes_of(c)
  tokens_per_step = c.train.batch_size * c.train.seq_len
  steps = max(1, math.ceil(s.tokens_per_param * sizes['applied'] / tokens_per_step))
  return common.with_overrides(c, {'train.steps': steps})


def sizes_of(config: Any) -> dict[str, float]:
  """Stored and applied parameters of the config's model, and its training FLOPs per token."""
  cfg = ModelConfig.from_experiment(config)
  variables = abstract_variables(DecoderLM(cfg))
  return {'stored': accounting.params_unique(variables),
          'applied': accounting.params_applied(variables, cfg),
          'flops_per_token': accounting.flops_per_token(cfg, config.train.seq_len)}


def fit_power(xs: list[float], ys: list[float], grid: int = 400) -> dict[str, float]:
  """L(x) = E + A x^-alpha by least squares in log(L - E): for each E the log-linear fit is
  exact least squares, and E minimises the remaining squared error, first on a grid over
  [0, min L), then by golden-section search between the grid neighbours of the best point.
  Needs 3 or more points."""
  x, y = np.log(np.asarray(xs, np.float64)), np.asarray(ys, np.float64)
  if len(x) < 3:
    raise ValueError('a power law with an irreducible term needs 3 or more points')

  def line(e: float) -> tuple[float, float, float]:
    slope, intercept = np.polyfit(x, np.log(y - e), 1)
    return float(np.sum((intercept + slope * x - np.log(y - e)) ** 2)), intercept, slope

  es = np.linspace(0.0, 0.999 * y.min(), grid)
  i = int(np.argmin([line(e)[0] for e in es]))
  lo, hi = es[max(i - 1, 0)], es[min(i + 1, grid - 1)]
  golden = (np.sqrt(5.0) - 1.0) / 2.0
  for _ in range(60):
    a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
    if line(a)[0] <= line(b)[0]:
      hi = b
    else:
      lo = a
  e = (lo + hi) / 2.0
  _, intercept, slope = line(e)
  return {'E': float(e), 'A': float(np.exp(intercept)), 'alpha': float(-slope)}


def predict(fit: dict[str, float], x: float) -> float:
  return fit['E'] + fit['A'] * float(x) ** -fit['alpha']


def _x(rung: dict[str, Any], axis: str) -> float:
  return rung['flops'] if axis == 'flops' else rung[f'params_{axis}']


def fits(rungs: list[dict[str, Any]]) -> dict[str, Any]:
  """Per axis: the fit to every rung, the fit without the largest and its prediction there."""
  out = {}
  loss = [r['loss'] for r in rungs]
  for axis in AXES:
    xs = [_x(r, axis) for r in rungs]
    whole = fit_power(xs, loss)
    row = {'all': whole}
    if len(rungs) >= 4:
      held = fit_power(xs[:-1], loss[:-1])
      pred = predict(held, xs[-1])
      row.update(held_out=held, predicted=pred, actual=loss[-1], error=pred - loss[-1],
                 relative_error=(pred - loss[-1]) / loss[-1])
    out[axis] = row
  return out


def main(config: Any, out: str) -> dict[str, Any]:
  s = config.study
  ps, ws = plans(s), widths(s)
  log2_lrs = lr_sweep._grid(s.log2_lrs)   # noqa: SLF001 - the sweep's own grid syntax
  configs = {(n, w): rung_config(config, o, w, ws[0]) for n, o in ps.items() for w in ws}
  os.makedirs(out, exist_ok=True)
  cells = os.path.join(out, 'cells')
  val = lr_sweep.val_batch(config, s.val_windows)
  t_start = time.perf_counter()
  log = lambda m: print(m, flush=True)
  result: dict[str, Any] = {'widths': ws, 'plans': {}}
  for name, overrides in ps.items():
    small = configs[name, ws[0]]

    def sweep(c=small):
      t0 = time.perf_counter()
      final, vloss = lr_sweep.train_cells(c, [2.0 ** v for v in log2_lrs], s.sweep_seeds,
                                          lr_sweep.batches(c, c.train.steps), val, s.avg_last)
      return {'val_loss': vloss.tolist(), **lr_sweep.optimum(log2_lrs, vloss),
              'seconds': round(time.perf_counter() - t0, 1)}
    swept = common.cached_cell(cells, f'sweep-{name}', {'config': experiment.to_json(small),
                                                         'log2_lrs': log2_lrs}, sweep, log)
    lr = 2.0 ** swept['fit_log2_lr']
    log(f'ladder {name}: LR 2^{swept["fit_log2_lr"]:.2f} from width {ws[0]}')
    rungs = []
    for w in ws:
      c = configs[name, w]

      def rung(c=c):
        t0 = time.perf_counter()
        final, vloss = lr_sweep.train_cells(c, [lr], s.seeds, lr_sweep.batches(c, c.train.steps),
                                            val, s.avg_last)
        return {'val_loss': vloss[0].tolist(), 'final_loss': final[0].tolist(),
                'seconds': round(time.perf_counter() - t0, 1)}
      got = common.cached_cell(cells, f'rung-{name}-{w}', {'config': experiment.to_json(c),
                                                            'lr': lr}, rung, log)
      sz = sizes_of(c)
      tokens = c.train.steps * c.train.batch_size * c.train.seq_len
      rungs.append({'width': w, 'steps': c.train.steps, 'tokens': tokens,
                    'params_stored': sz['stored'], 'params_applied': sz['applied'],
                    'flops': sz['flops_per_token'] * tokens, 'lr': lr,
                    'loss': float(np.mean(got['val_loss'])), **got})
      log(f'ladder {name} d={w}: {c.train.steps} steps, val loss {rungs[-1]["loss"]:.4f} '
          f'({got["seconds"]} s)')
    result['plans'][name] = {'overrides': overrides, 'sweep': swept, 'rungs': rungs,
                             'fits': fits(rungs)}
  result['runtime_s'] = round(time.perf_counter() - t_start, 1)
  result['config'] = json.loads(experiment.to_json(config))
  with open(os.path.join(out, 'ladder.json'), 'w') as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out, 'ladder.md'), 'w') as f:
    f.write(to_markdown(result))
  plot(result, os.path.join(out, 'ladder_frontier.png'))
  print(f'wrote {out}/ladder.json ({result["runtime_s"]} s)')
  return result


def equal_stored(result: dict[str, Any], reference: str = 'untied') -> list[dict[str, Any]]:
  """Each plan's fitted loss (stored-parameter law, all rungs) at the reference plan's stored
  sizes, within the range the plan's own rungs span (no extrapolation)."""
  ref = result['plans'].get(reference) or next(iter(result['plans'].values()))
  rows = []
  for r in ref['rungs']:
    row = {'stored': r['params_stored'], 'losses': {}}
    for name, p in result['plans'].items():
      xs = [q['params_stored'] for q in p['rungs']]
      inside = min(xs) <= r['params_stored'] <= max(xs)
      row['losses'][name] = predict(p['fits']['stored']['all'], r['params_stored']) \
          if inside else None
    rows.append(row)
  return rows


def _m(x: float) -> str:
  return f'{x / 1e6:.2f}M' if x < 1e9 else f'{x / 1e9:.2f}B'


def to_markdown(result: dict[str, Any]) -> str:
  """The rungs, the fits with their held-out predictions, and the two frontiers."""
  plans_ = result['plans']
  out = ['**Rungs** (validation loss after the budget, seed mean; LR transferred from the '
         'smallest width)', '',
         '| plan | width | stored | applied | tokens | TFLOPs | LR (log2) | val loss |',
         '|---|---|---|---|---|---|---|---|']
  for name, p in plans_.items():
    for r in p['rungs']:
      out.append(f"| {name} | {r['width']} | {_m(r['params_stored'])} | "
                 f"{_m(r['params_applied'])} | {_m(r['tokens'])} | {r['flops'] / 1e12:.3f} | "
                 f"{math.log2(r['lr']):.2f} | {r['loss']:.4f} |")
  out += ['', '**Fits** L = E + A x^-alpha (all rungs), and the largest rung predicted from the '
          'others', '',
          '| plan | x | E | A | alpha | predicted (held out) | actual | error | rel. error |',
          '|---|---|---|---|---|---|---|---|---|']
  for name, p in plans_.items():
    for axis in AXES:
      f = p['fits'][axis]
      a = f['all']
      held = (f"{f['predicted']:.4f} | {f['actual']:.4f} | {f['error']:+.4f} | "
              f"{100 * f['relative_error']:+.2f} % |") if 'predicted' in f else '- | - | - | - |'
      out.append(f"| {name} | {AXIS_LABELS[axis]} | {a['E']:.3f} | {a['A']:.4g} | "
                 f"{a['alpha']:.3f} | {held}")
  names = list(plans_)
  out += ['', '**At equal FLOPs** (each width trains every plan on the same tokens; val loss)', '',
          '| width | ' + ' | '.join(f'{n} (TFLOPs, loss)' for n in names) + ' |',
          '|---|' + '---|' * len(names)]
  for i, w in enumerate(result['widths']):
    cells = []
    for n in names:
      r = plans_[n]['rungs'][i]
      cells.append(f"{r['flops'] / 1e12:.3f}, {r['loss']:.4f}")
    out.append(f'| {w} | ' + ' | '.join(cells) + ' |')
  out += ['', '**At equal stored parameters** (each plan\'s stored-parameter law read at the '
          'reference plan\'s sizes; - outside the plan\'s own rungs)', '',
          '| stored | ' + ' | '.join(names) + ' |', '|---|' + '---|' * len(names)]
  for row in equal_stored(result):
    out.append(f"| {_m(row['stored'])} | " + ' | '.join(
        '-' if row['losses'][n] is None else f"{row['losses'][n]:.4f}" for n in names) + ' |')
  return '\n'.join(out) + '\n'


def plot(result: dict[str, Any], path: str) -> None:
  """Loss against training FLOPs and against stored parameters, one curve per plan (points:
  rungs; lines: the fits on all rungs; open marker: the held-out prediction of the largest)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, axis in zip(axes, ('flops', 'stored')):
    for k, (name, p) in enumerate(result['plans'].items()):
      color = f'C{k}'
      xs = np.asarray([_x(r, axis) for r in p['rungs']], np.float64)
      ys = [r['loss'] for r in p['rungs']]
      ax.plot(xs, ys, 'o', color=color, label=name)
      grid = np.geomspace(xs.min(), xs.max(), 50)
      ax.plot(grid, [predict(p['fits'][axis]['all'], g) for g in grid], '-', color=color, lw=1)
      if 'predicted' in p['fits'][axis]:
        ax.plot([xs[-1]], [p['fits'][axis]['predicted']], 'o', mfc='none', color=color, ms=9)
    ax.set_xscale('log')
    ax.set_xlabel(AXIS_LABELS[axis])
    ax.set_ylabel('validation loss (nats)')
    ax.set_title(f'loss against {AXIS_LABELS[axis]}', fontsize=9)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == '__main__':
  common.run_cli(main, 'runs/ladder', 'configs/ladder.py')
