"""Coordinate check: a statistic of every sown activation against width, loop count R or depth.

  python -m sharenet.studies.coord_check --config configs/mup/coord_check.py --out DIR

Protocol (TP5, arXiv:2203.03466, as microsoft/mup `get_coord_data` runs it): a fixed batch reused
every step, Adam at a deliberately large LR, no clipping or decay, each activation recorded in the
forward pass *before* each update (t=0 is init). The step is the train loop's
(trainer.train_step with the config's transforms and grad_accum). Shared blocks record every use
(one value per loop iteration). `study.statistic` picks what is recorded:

- `l1` (default): mean|x_t|, microsoft/mup's 'l1'. Its size at init is Theta(1) in every
  parametrization, so it shows a step only once the steps outweigh the init.
- `delta`: mean|x_t - x_0|, the change of each coordinate from its value at init on the same batch
  (entries a mask leaves out are skipped). This is the quantity the spectral condition for feature
  learning constrains (Yang, Simon & Bernstein, arXiv:2310.17813, Desideratum 1:
  ||Delta h||_2 = Theta(sqrt(n)), i.e. mean|Delta h| = Theta(1)); it reads a step's width
  scaling from t = 1 on, whatever the init's size. It is 0 at t = 0 (slope undefined there).

Writes DIR/coord_check.json (per axis, variant, activation and step: the slope of log statistic
against log x, plus the raw values), DIR/coord_check.md (the largest |slope| over steps >= 1),
DIR/coord_check_steps.md (the slope at each step of the residual stream, attention and MLP outputs)
and DIR/coord_check_{axis}.png (rows: variants, columns: steps).
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

from sharenet.errors import ConfigError
from sharenet.models.layers import ACTIVATION_SUFFIX, INTERMEDIATES, sow_activations
from sharenet.studies import common
from sharenet.train import experiment, trainer

# Activations whose flatness the muP criterion covers.
CORE = ('embed_out', 'residual', 'attn_out', 'mlp_hidden', 'mlp_out')
# study.statistic -> what it records of each activation x at step t (the module docstring).
STATISTICS = {'l1': 'mean|x|', 'delta': 'mean|x - x0|'}


def check_config(config: Any, stat: str | None = None) -> str:
  """The statistic to record, `stat` or config.study.statistic, if the model and the statistic
  can be checked together; else one ConfigError line naming the valid choices."""
  stat = stat or config.study.get('statistic', 'l1')
  kind = config.model.routing.kind
  if kind != 'none':   # models/stack.py _routed: gathered tokens per recursion, nothing sown
    raise ConfigError(f'coordinate check: model.routing.kind={kind} records no activations of '
                      f'its routed recursions; valid: model.routing.kind=none')
  if not config.model.scan_layers:   # stack.py _python_loop: sown per stored set, not per layer
    raise ConfigError('coordinate check: model.scan_layers=False records each stored set\'s uses '
                      'apart, not in applied order; valid: model.scan_layers=True')
  if stat not in STATISTICS:
    raise ConfigError(f'study.statistic: unknown {stat!r}; valid: {", ".join(STATISTICS)}')
  if stat == 'delta' and config.train.grad_accum != 1:
    raise ConfigError(f'study.statistic=delta compares each activation with its value at init, '
                      f'which micro-batches would average away; valid: train.grad_accum=1 '
                      f'(got {config.train.grad_accum}) or study.statistic=l1')
  return stat


def trajectories(config: Any, steps: int, seeds: int, tokens_BT1: np.ndarray,
                 statistic: str | None = None
                 ) -> tuple[list[list[dict[str, np.ndarray]]], np.ndarray]:
  """Per seed and step t = 0..steps: the statistic (`STATISTICS`) of each sown activation per use
  (`_flatten`) in the forward pass of the train loop's step (trainer.train_step) on the fixed
  batch, and its loss (seeds, steps + 1). `statistic`: config.study.statistic unless given.
  Under 'delta' the step is traced inside layers.sow_activations(), and each activation is
  compared with its value at t = 0 of the same seed: entries NaN at t = 0 (masked) are left out,
  a NaN that appears later (a diverged run) makes the value NaN, as under 'l1'."""
  delta = check_config(config, statistic) == 'delta'
  exp = trainer.setup(config, experiment.validate(config))
  step = jax.jit(trainer.make_train_step(exp, config.train.grad_accum, mutable=[INTERMEDIATES]))
  init = jax.jit(functools.partial(trainer.init_state, exp.model, exp.tx, tr=exp.tr, pz=exp.pz))
  toks = jnp.asarray(tokens_BT1)
  runs, losses = [], []
  with sow_activations() if delta else contextlib.nullcontext():
    for seed in range(seeds):
      state = init(jax.random.key(config.train.seed + seed))
      per_step, loss, x0 = [], [], None
      for _ in range(steps + 1):
        state, metrics = step(state, toks)
        inter = metrics[INTERMEDIATES]
        if delta:
          x = _activations(inter)
          x0 = x if x0 is None else x0
          per_step.append(_by_name({p: _mean_change(a, x0[p]) for p, a in x.items()}))
        else:
          per_step.append(_flatten(inter))
        loss.append(float(metrics['loss']))
      runs.append(per_step)
      losses.append(loss)
  return runs, np.asarray(losses)


def measure(config: Any, overrides: dict[str, Any], steps: int, seeds: int,
            tokens_BT1: np.ndarray, statistic: str | None = None
            ) -> dict[str, list[list[float]]]:
  """{activation: [[statistic per use] for t in 0..steps]} averaged over seeds, for one model."""
  runs, _ = trajectories(common.with_overrides(config, overrides), steps, seeds, tokens_BT1,
                         statistic)
  names = runs[0][0].keys()
  return {n: [np.mean([r[t][n] for r in runs], axis=0).tolist() for t in range(steps + 1)]
          for n in names}


def _mean_change(x: np.ndarray, x0: np.ndarray) -> np.ndarray:
  """Per row (use): mean |x - x0| over the entries x0 holds (not NaN: inside the mask)."""
  kept = ~np.isnan(x0)
  return np.sum(np.where(kept, np.abs(x - x0), 0.0), axis=1) / np.sum(kept, axis=1)


def _uses(value: Any) -> tuple:
  """A sown value's entries: a tuple, one per sow call (each stacked over scanned uses)."""
  return value if isinstance(value, tuple) else (value,)


def _flatten(inter: Any) -> dict[str, np.ndarray]:
  """Sown scalars -> {activation name: values per use in applied order}."""
  return _by_name({p: v for p, v in flatten_dict(inter).items()
                   if not p[-1].endswith(ACTIVATION_SUFFIX)})


def _by_name(flat: dict[tuple[str, ...], Any]) -> dict[str, np.ndarray]:
  """{sown path: values} -> {activation name: values per use, in path order} (applied order:
  the stack's scans stack each path's uses; check_config refuses the Python-loop stack)."""
  out: dict[str, list] = {}
  for path, value in sorted(flat.items()):
    for entry in _uses(value):
      out.setdefault(path[-1], []).extend(np.asarray(entry, np.float64).ravel().tolist())
  out['residual_final'] = out['residual'][-1:]
  return {k: np.asarray(v) for k, v in out.items()}


def _activations(inter: Any) -> dict[tuple[str, ...], np.ndarray]:
  """The activations sown inside layers.sow_activations(), keyed by their scalar's path:
  (uses, entries) float32, one row per value `_flatten` lists for that path."""
  flat = flatten_dict(inter)
  out = {}
  for path, value in flat.items():
    if path[-1].endswith(ACTIVATION_SUFFIX):
      scalar = path[:-1] + (path[-1][:-len(ACTIVATION_SUFFIX)],)
      out[scalar] = np.concatenate([np.asarray(a, np.float32).reshape(np.size(s), -1)
                                    for s, a in zip(_uses(flat[scalar]), _uses(value))])
  return out


def run_axis(config: Any, axis: str, log=print) -> dict[str, Any]:
  """Sweeps one axis ('width' | 'repeats' | 'depth') for every variant of that axis."""
  s = config.study
  stat = check_config(config)
  xs = common.parse_list(s[f'{axis}_values'])
  tokens = common.fixed_batch(config.data, config.train.batch_size, config.train.seq_len)
  out: dict[str, Any] = {'xs': xs, 'statistic': stat, 'variants': {}}
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
                          tokens, stat)
      log(f'coord_check {axis} {name} x={x}: {time.perf_counter() - t0:.1f}s')
    acts = values[xs[0]].keys()
    slopes = {a: [common.loglog_slope(xs, [np.mean(values[x][a][t]) for x in xs])
                  for t in range(s.steps + 1)] for a in acts}
    out['variants'][name] = {'lr': lr, 'slopes': slopes,
                             stat: {str(x): v for x, v in values.items()}}
  return out


def statistic_of(result: dict[str, Any]) -> str:
  """The statistic an axis' result holds (results written before study.statistic: 'l1')."""
  return result.get('statistic', 'l1')


def values_of(result: dict[str, Any], variant: str) -> dict[str, dict[str, list]]:
  """{str(x): {activation: [values per use] per step}} of one variant of an axis' result."""
  return result['variants'][variant][statistic_of(result)]


def summary(result: dict[str, Any], t_min: int = 1) -> dict[str, dict[str, float]]:
  """Per variant and activation: the largest |slope| over steps t >= t_min."""
  return {v: {a: float(np.nanmax(np.abs(sl[t_min:]))) for a, sl in r['slopes'].items()}
          for v, r in result['variants'].items()}


def plot(result: dict[str, Any], axis: str, path: str) -> None:
  """Grid: one row per variant, one column per step; log-log statistic against the axis."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  variants = list(result['variants'])
  steps = len(next(iter(result['variants'].values()))['slopes']['residual'])
  first = 1 if statistic_of(result) == 'delta' else 0   # the change is 0 at t = 0
  xs = result['xs']
  colors = plt.get_cmap('tab20')
  fig, axes = plt.subplots(len(variants), steps - first,
                           figsize=(3.2 * (steps - first), 2.8 * len(variants)), squeeze=False,
                           sharex=True)
  for i, v in enumerate(variants):
    r = result['variants'][v]
    for t in range(first, steps):
      ax = axes[i, t - first]
      for k, a in enumerate(sorted(r['slopes'])):
        ys = [np.mean(values_of(result, v)[str(x)][a][t]) for x in xs]
        if all(y > 0 for y in ys):   # 'delta' is 0 at t = 0
          ax.plot(xs, ys, marker='o', ms=3, lw=1.2 if a in CORE else 0.8, color=colors(k % 20),
                  ls='-' if a in CORE else '--', label=a)
      ax.set_xscale('log', base=2)
      ax.set_yscale('log')
      ax.set_title(f'{v}  t={t}: {STATISTICS[statistic_of(result)]}', fontsize=8)
      if v.startswith('sp'):
        ax.set_facecolor('#eeeeee')
      if i == len(variants) - 1:
        ax.set_xlabel(axis)
  axes[0, -1].legend(fontsize=6, loc='center left', bbox_to_anchor=(1.0, 0.5))
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def plot_activations(result: dict[str, Any], axis: str, acts: list[str], path: str) -> None:
  """One panel per (variant, activation): the statistic against the axis, one line per step t."""
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
        ys = [np.mean(values_of(result, v)[str(x)][a][t]) for x in xs]
        if all(y > 0 for y in ys):
          ax.plot(xs, ys, marker='o', ms=3, color=cmap(t / max(1, steps - 1)), label=f't={t}')
      ax.set_xscale('log', base=2)
      ax.set_yscale('log')
      last = r['slopes'][a][-1]
      ax.set_title(f'{v}: {a}, {STATISTICS[statistic_of(result)]} '
                   f'(slope at t={steps - 1}: {last:+.2f})', fontsize=8)
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


def _of(r: dict[str, Any]) -> str:
  """' of log <statistic>' in a table's title, for statistics other than the default."""
  stat = statistic_of(r)
  return '' if stat == 'l1' else f' of log {STATISTICS[stat]}'


def to_markdown(result: dict[str, Any]) -> str:
  """Per axis: the largest |slope| of log statistic (mean|x| unless the title names another)
  against log x over steps >= 1, per variant (rows) and activation (columns); flat (muP-like)
  is near 0."""
  out = []
  for axis in axes_of(result):
    r = result[axis]
    acts = sorted({a for row in r['max_abs_slope_t_ge_1'].values() for a in row})
    out += [f'**{axis}** {", ".join(str(x) for x in r["xs"])}: max |slope|{_of(r)} over steps '
            f'>= 1', '',
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
    out += [f'**{axis}** {", ".join(str(x) for x in r["xs"])}: slope of log '
            f'{STATISTICS[statistic_of(r)]} at step t',
            '', '| variant | activation | ' + ' | '.join(f't={t}' for t in range(steps)) + ' |',
            '|---|---|' + '---|' * steps]
    for v, vr in r['variants'].items():   # '-': undefined ('delta' at t = 0)
      out += [f'| {v} | {a} | ' + ' | '.join('-' if np.isnan(s) else f'{s:+.2f}'
                                              for s in vr['slopes'][a]) + ' |'
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
