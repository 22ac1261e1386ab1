"""Coordinate check: mean|x| of every sown activation against width, loop count R or depth.

  python -m sharenet.studies.coord_check --config configs/mup/coord_check.py --out DIR

Protocol (TP5, arXiv:2203.03466, as microsoft/mup `get_coord_data` runs it): a fixed batch reused
every step, Adam at a deliberately large LR, no clipping or decay; the statistic is mean|x|
('l1') of each activation, recorded in the forward pass *before* each update (t=0 is init).
The step is the train loop's (train_lib.train_step with the config's transforms and grad_accum).
Shared blocks record every use (one value per loop iteration). Writes DIR/coord_check.json
(per axis, variant, activation and step: the slope of log mean|x| against log x, plus the raw
values), DIR/coord_check.md (the largest |slope| over steps >= 1), DIR/coord_check_steps.md
(the slope at each step of the residual stream, attention and MLP outputs) and
DIR/coord_check_{axis}.png (rows: variants, columns: steps).
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

from sharenet import config_lib, train_lib
from sharenet.models.layers import INTERMEDIATES
from sharenet.studies import common

# Activations whose flatness the muP criterion covers.
CORE = ('embed_out', 'residual', 'attn_out', 'mlp_hidden', 'mlp_out')


def trajectories(config: Any, steps: int, seeds: int, tokens_BT1: np.ndarray
                 ) -> tuple[list[list[dict[str, np.ndarray]]], np.ndarray]:
  """Per seed and step t = 0..steps: the sown mean|x| per activation and use (`_flatten`) in the
  forward pass of the train loop's step (train_lib.train_step) on the fixed batch, and its loss
  (seeds, steps + 1)."""
  exp = train_lib.setup(config, config_lib.validate(config))
  step = jax.jit(train_lib.make_train_step(exp, config.train.grad_accum, mutable=[INTERMEDIATES]))
  init = jax.jit(functools.partial(train_lib.init_state, exp.model, exp.tx, tr=exp.tr, pz=exp.pz))
  toks = jnp.asarray(tokens_BT1)
  runs, losses = [], []
  for seed in range(seeds):
    state = init(jax.random.key(config.train.seed + seed))
    per_step, loss = [], []
    for _ in range(steps + 1):
      state, metrics = step(state, toks)
      per_step.append(_flatten(metrics[INTERMEDIATES]))
      loss.append(float(metrics['loss']))
    runs.append(per_step)
    losses.append(loss)
  return runs, np.asarray(losses)


def measure(config: Any, overrides: dict[str, Any], steps: int, seeds: int,
            tokens_BT1: np.ndarray) -> dict[str, list[list[float]]]:
  """{activation: [[mean|x| per use] for t in 0..steps]} averaged over seeds, for one model."""
  runs, _ = trajectories(common.with_overrides(config, overrides), steps, seeds, tokens_BT1)
  names = runs[0][0].keys()
  return {n: [np.mean([r[t][n] for r in runs], axis=0).tolist() for t in range(steps + 1)]
          for n in names}


def _flatten(inter: Any) -> dict[str, np.ndarray]:
  """Sown scalars -> {activation name: values per use in applied order}."""
  out: dict[str, list] = {}
  for path, value in sorted(flatten_dict(inter).items()):
    arr = np.asarray(value[0] if isinstance(value, tuple) else value, np.float64).ravel()
    out.setdefault(path[-1], []).extend(arr.tolist())
  out['residual_final'] = out['residual'][-1:]
  return {k: np.asarray(v) for k, v in out.items()}


def run_axis(config: Any, axis: str, log=print) -> dict[str, Any]:
  """Sweeps one axis ('width' | 'repeats' | 'depth') for every variant of that axis."""
  s = config.study
  xs = common.parse_list(s[f'{axis}_values'])
  tokens = common.fixed_batch(config.data, config.train.batch_size, config.train.seq_len)
  out: dict[str, Any] = {'xs': xs, 'variants': {}}
  for spec in common.parse_list(s[f'{axis}_variants'], str):
    name, settings = common.parse_variant(spec)
    lr = settings.pop('lr', config.train.lr)
    base = {f'parametrization.{k}': v for k, v in settings.items()}
    base.setdefault('parametrization.base_d_model', xs[0] if axis == 'width' else s.fixed_width)
    base['train.lr'] = lr
    values = {}
    for x in xs:
      t0 = time.perf_counter()
      values[x] = measure(config, {**base, **common.point_overrides(axis, x, s)}, s.steps, s.seeds,
                          tokens)
      log(f'coord_check {axis} {name} x={x}: {time.perf_counter() - t0:.1f}s')
    acts = values[xs[0]].keys()
    slopes = {a: [common.loglog_slope(xs, [np.mean(values[x][a][t]) for x in xs])
                  for t in range(s.steps + 1)] for a in acts}
    out['variants'][name] = {'lr': lr, 'slopes': slopes,
                             'l1': {str(x): v for x, v in values.items()}}
  return out


def summary(result: dict[str, Any], t_min: int = 1) -> dict[str, dict[str, float]]:
  """Per variant and activation: the largest |slope| over steps t >= t_min."""
  return {v: {a: float(np.nanmax(np.abs(sl[t_min:]))) for a, sl in r['slopes'].items()}
          for v, r in result['variants'].items()}


def plot(result: dict[str, Any], axis: str, path: str) -> None:
  """Grid: one row per variant, one column per step; log-log mean|x| against the axis."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  variants = list(result['variants'])
  steps = len(next(iter(result['variants'].values()))['slopes']['residual'])
  xs = result['xs']
  colors = plt.get_cmap('tab20')
  fig, axes = plt.subplots(len(variants), steps, figsize=(3.2 * steps, 2.8 * len(variants)),
                           squeeze=False, sharex=True)
  for i, v in enumerate(variants):
    r = result['variants'][v]
    for t in range(steps):
      ax = axes[i, t]
      for k, a in enumerate(sorted(r['slopes'])):
        ys = [np.mean(r['l1'][str(x)][a][t]) for x in xs]
        ax.plot(xs, ys, marker='o', ms=3, lw=1.2 if a in CORE else 0.8, color=colors(k % 20),
                ls='-' if a in CORE else '--', label=a)
      ax.set_xscale('log', base=2)
      ax.set_yscale('log')
      ax.set_title(f'{v}  t={t}', fontsize=8)
      if v.startswith('sp'):
        ax.set_facecolor('#eeeeee')
      if i == len(variants) - 1:
        ax.set_xlabel(axis)
  axes[0, -1].legend(fontsize=6, loc='center left', bbox_to_anchor=(1.0, 0.5))
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def plot_activations(result: dict[str, Any], axis: str, acts: list[str], path: str) -> None:
  """One panel per (variant, activation): mean|x| against the axis, one line per step t."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  variants, xs = list(result['variants']), result['xs']
  fig, axes = plt.subplots(len(variants), len(acts), figsize=(3.6 * len(acts),
                           2.9 * len(variants)), squeeze=False)
  for i, v in enumerate(variants):
    r = result['variants'][v]
    steps = len(r['slopes'][acts[0]])
    cmap = plt.get_cmap('viridis')
    for j, a in enumerate(acts):
      ax = axes[i, j]
      for t in range(steps):
        ys = [np.mean(r['l1'][str(x)][a][t]) for x in xs]
        if all(y > 0 for y in ys):
          ax.plot(xs, ys, marker='o', ms=3, color=cmap(t / max(1, steps - 1)), label=f't={t}')
      ax.set_xscale('log', base=2)
      ax.set_yscale('log')
      last = r['slopes'][a][-1]
      ax.set_title(f'{v}: {a} (slope at t={steps - 1}: {last:+.2f})', fontsize=8)
      if v.startswith('sp'):
        ax.set_facecolor('#eeeeee')
      ax.set_xlabel(axis)
  axes[0, -1].legend(fontsize=6, loc='center left', bbox_to_anchor=(1.0, 0.5))
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def axes_of(result: dict[str, Any]) -> list[str]:
  """The study axes a result holds (width, repeats, depth), in the order run."""
  return [a for a, r in result.items() if isinstance(r, dict) and 'variants' in r]


def to_markdown(result: dict[str, Any]) -> str:
  """Per axis: the largest |slope| of log mean|x| against log x over steps >= 1, per variant
  (rows) and activation (columns); flat (muP-like) is near 0."""
  out = []
  for axis in axes_of(result):
    r = result[axis]
    acts = sorted({a for row in r['max_abs_slope_t_ge_1'].values() for a in row})
    out += [f'**{axis}** {", ".join(str(x) for x in r["xs"])}: max |slope| over steps >= 1', '',
            '| variant | ' + ' | '.join(acts) + ' |', '|---|' + '---|' * len(acts)]
    for v, row in r['max_abs_slope_t_ge_1'].items():
      out.append(f'| {v} | ' + ' | '.join(f'{row[a]:.2f}' if a in row else '-' for a in acts)
                 + ' |')
    out.append('')
  return '\n'.join(out)


STEP_ACTS = ('residual', 'attn_out', 'mlp_out')


def steps_markdown(result: dict[str, Any], acts: tuple[str, ...] = STEP_ACTS) -> str:
  """Per axis, variant and activation (`acts`, those present): the slope at each step t, so a
  reader sees when a variant starts to grow, not only its largest |slope|."""
  out = []
  for axis in axes_of(result):
    r = result[axis]
    steps = len(next(iter(r['variants'].values()))['slopes'][acts[0]])
    out += [f'**{axis}** {", ".join(str(x) for x in r["xs"])}: slope of log mean|x| at step t',
            '', '| variant | activation | ' + ' | '.join(f't={t}' for t in range(steps)) + ' |',
            '|---|---|' + '---|' * steps]
    for v, vr in r['variants'].items():
      out += [f'| {v} | {a} | ' + ' | '.join(f'{s:+.2f}' for s in vr['slopes'][a]) + ' |'
              for a in acts if a in vr['slopes']]
    out.append('')
  return '\n'.join(out)


def main(config: Any, out_dir: str) -> dict[str, Any]:
  def annotate(res: dict[str, Any]) -> None:
    res['max_abs_slope_t_ge_1'] = summary(res)
  result = common.run_axes(config, out_dir, 'coord_check', run_axis, plot, annotate, to_markdown)
  with open(os.path.join(out_dir, 'coord_check_steps.md'), 'w') as f:
    f.write(steps_markdown(result))
  for axis in common.parse_list(config.study.axes, str):
    for v, row in result[axis]['max_abs_slope_t_ge_1'].items():
      print(f'{axis:8s} {v:34s} ' + ' '.join(f'{a}={row[a]:.2f}' for a in sorted(row)))
  print(f'wrote {out_dir}/coord_check.json ({result["runtime_s"]} s)')
  return result


if __name__ == '__main__':
  common.run_cli(main, 'runs/coord_check')
