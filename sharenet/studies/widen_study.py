"""Growth study: does a trained model grown wider (convert.py --config.to=wider, the row-column
ansatz) train on better than the same wider model from scratch, at equal steps?

  python -m sharenet.studies.widen_study --config configs/widen_study.py \
      --out runs/widen_study [--config.study.widths=128,96] [--config.study.seeds=0,1]

The row-column mean-field ansatz reads zero-shot weight transfer ("model growth") as sampling
the rows and columns of a trained small model's matrices (sharenet/transforms/widen.py). At CPU
scale, under the config's parametrization (muP: one LR for every width):

1. the source: `study.source_steps` steps of the config's model, OUT/source;
2. for each width of `study.widths`: the source grown to it (`--config.to=wider
   --config.d_model=W`), evaluated zero-shot, OUT/grown/dW;
3. for each width x seed of `study.seeds` (train.seed: data order): the grown workdir trained
   `study.steps` more steps with a fresh optimizer (`grown`), and the wider model trained
   `study.steps` steps from its init (`scratch`, init seed = the seed), at the same LR, schedule
   and data; and per seed the source itself trained the same `study.steps` more steps at its
   own width (`continued`: what growing buys over not growing).

Every model is evaluated on the same validation tokens (`study.eval_tokens`, 0 = all). Writes
OUT/widen_study.json and OUT/widen_study.md (mean +- sd over seeds; `python -m
sharenet.studies.results_tables` regenerates it from the JSON). Each cell is kept under
OUT/cells with a fingerprint of its inputs, so an interrupted study resumes at its first
missing cell.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from typing import Any

from sharenet.config import defaults
from sharenet.errors import ConfigError
from sharenet.main import convert_workdir
from sharenet.studies import common
from sharenet.train import experiment, workdir_io

METHODS = ('grown', 'scratch')


def check(config: Any) -> tuple[list[int], list[int]]:
  """(widths, seeds) of config.study; one ConfigError line for what cannot run."""
  if 'study' not in config:
    raise ConfigError('the config has no study group; valid: a config like '
                      'configs/widen_study.py')
  s = config.study
  widths, seeds = common.parse_list(s.widths, int), common.parse_list(s.seeds, int)
  if not widths or any(w <= config.model.d_model for w in widths):
    raise ConfigError(f'study.widths={s.widths!r}: each must be wider than model.d_model='
                      f'{config.model.d_model}; valid: e.g. {2 * config.model.d_model}')
  if not seeds:
    raise ConfigError(f'study.seeds={s.seeds!r}; valid: train.seed values, e.g. 0,1')
  if s.source_steps < 1 or s.steps < 1:
    raise ConfigError(f'study.source_steps={s.source_steps}, study.steps={s.steps}; valid: '
                      f'>= 1 each')
  return widths, seeds


def _run_overrides(study: Any, steps: int, seed: int) -> dict[str, Any]:
  return {'train.steps': int(steps), 'train.seed': int(seed),
          'train.checkpoint_every': int(steps), 'train.progress': False,
          'train.eval_every': 0, 'data.eval_tokens': int(study.eval_tokens)}


def _grown(source: str, workdir: str, study: Any, seed: int) -> dict[str, Any]:
  """The grown `source` (or the source itself: `continued`) copied to `workdir` and trained
  study.steps more steps."""
  if os.path.isdir(workdir):
    shutil.rmtree(workdir)   # an interrupted cell starts over (its row was never kept)
  shutil.copytree(source, workdir)
  config = workdir_io.load_config(workdir)
  base = int(study.source_steps)   # the grown checkpoint's step: the source's last
  # The schedule continues at the source's step: its decay spans the same last steps as the
  # scratch run's (wsd's decay_fraction of study.steps), and the peak LR is reached already.
  t = config.train
  overrides = {**_run_overrides(study, base + study.steps, seed),
               'train.decay_fraction': float(t.decay_fraction) * study.steps /
               (base + study.steps),
               'train.restore': 'params'}   # the seed's own data stream, a fresh optimizer
  return common.trained(common.with_overrides(config, overrides), workdir)


def _scratch(config: Any, workdir: str, study: Any, width: int, seed: int) -> dict[str, Any]:
  """The wider model (the grown one's config) trained study.steps steps from its init."""
  if os.path.isdir(workdir):
    shutil.rmtree(workdir)
  grown = workdir_io.load_config(os.path.join(os.path.dirname(os.path.dirname(workdir)),
                                              'grown', f'd{width}'))
  c = common.with_overrides(config, {**_run_overrides(study, study.steps, seed),
                                     'model.d_model': grown.model.d_model,
                                     'model.mlp_dim': grown.model.mlp_dim,
                                     'model.num_heads': grown.model.num_heads,
                                     'model.num_kv_heads': grown.model.num_kv_heads,
                                     # the same proxy as the grown model's (muP)
                                     'parametrization.base_d_model':
                                         grown.parametrization.base_d_model,
                                     'parametrization.base_num_heads':
                                         grown.parametrization.base_num_heads})
  return common.trained(c, workdir)


def main(config: Any, out: str) -> int:
  widths, seeds = check(config)
  s = config.study
  cells = os.path.join(out, 'cells')
  t0 = time.time()
  source = os.path.join(out, 'source')
  base = json.loads(experiment.to_json(config))
  base.pop('study')

  def train_source():
    c = common.with_overrides(config, _run_overrides(s, s.source_steps, config.train.seed))
    return {**common.trained(c, source),
            'params_unique': common.stored_params(source)}

  source_inputs = {'config': base, 'steps': s.source_steps, 'eval_tokens': s.eval_tokens}
  result: dict[str, Any] = {'study': s.to_dict(), 'd_model': config.model.d_model,
                            'source': common.cached_cell(cells, 'source', source_inputs,
                                                         train_source),
                            'grown': {}, 'rows': []}
  result['continued'] = []
  for seed in seeds:
    workdir = os.path.join(out, 'runs', f'continued-seed{seed}')
    cell = {'source': source_inputs, 'method': 'continued', 'seed': seed, 'steps': s.steps,
            'eval_tokens': s.eval_tokens}
    row = common.cached_cell(cells, f'continued-seed{seed}', cell,
                             lambda: _grown(source, workdir, s, seed))
    result['continued'].append({'seed': seed, **row})
  for w in widths:
    dst = os.path.join(out, 'grown', f'd{w}')
    opts = defaults.conversion_config()
    opts.to, opts.d_model = 'wider', int(w)

    def grow(dst=dst, opts=opts):
      if os.path.isdir(dst):
        shutil.rmtree(dst)
      info = convert_workdir.convert_workdir(source, dst, opts)
      return {**common.evaluated(dst, s.eval_tokens), 'params_unique': common.stored_params(dst),
              'zero_shot': info['zero_shot']}

    inputs = {'source': source_inputs, 'conversion': opts.to_dict()}
    result['grown'][str(w)] = common.cached_cell(cells, f'grow-d{w}', inputs, grow)
    for method in METHODS:
      for seed in seeds:
        workdir = os.path.join(out, 'runs', f'd{w}-{method}-seed{seed}')
        cell = {**inputs, 'method': method, 'seed': seed, 'steps': s.steps,
                'eval_tokens': s.eval_tokens}
        run = (lambda: _grown(dst, workdir, s, seed)) if method == 'grown' else (
            lambda: _scratch(config, workdir, s, w, seed))
        row = common.cached_cell(cells, f'd{w}-{method}-seed{seed}', cell, run)
        result['rows'].append({'width': w, 'method': method, 'seed': seed, **row})
        print(json.dumps(result['rows'][-1]), flush=True)
  result['runtime_s'] = round(time.time() - t0, 1)
  common.write_result(out, 'widen_study', result, to_markdown)
  return 0


def to_markdown(result: dict[str, Any]) -> str:
  """Per width: the grown model's zero-shot loss, each method's eval loss after the same steps
  (mean ± sd over seeds) and grown minus scratch."""
  s, src = result['study'], result['source']
  continued = [r['eval_loss'] for r in result.get('continued', [])]
  lines = [f"Source: d_model {result['d_model']} after {s['source_steps']} steps, eval loss "
           f"{src['eval_loss']:.4f} ({src['params_unique']:,} params); trained {s['steps']} "
           f"more steps at its own width: "
           f"{common.mean_sd(continued) if continued else '-'} (continued). Each width: the source "
           f"grown by the row-column draw (convert.py --config.to=wider) then trained "
           f"{s['steps']} steps with a fresh optimizer (grown), against the same model trained "
           f"{s['steps']} steps from its init (scratch); seeds {s['seeds']}.", '',
           '| d_model | params | zero-shot (grown, no training) | max logit diff | grown | '
           'scratch | grown - scratch |', '|---|---|---|---|---|---|---|']
  for w, g in sorted(result['grown'].items(), key=lambda kv: int(kv[0])):
    by = {m: [r['eval_loss'] for r in result['rows'] if str(r['width']) == w and
              r['method'] == m] for m in METHODS}
    diff = statistics.mean(by['grown']) - statistics.mean(by['scratch'])
    lines.append(f"| {w} | {g['params_unique']:,} | {g['eval_loss']:.4f} | "
                 f"{g['zero_shot']['max_abs_logit_diff']:.1e} | {common.mean_sd(by['grown'])} | "
                 f"{common.mean_sd(by['scratch'])} | {diff:+.4f} |")
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  common.run_cli(main, 'runs/widen_study', 'configs/widen_study.py')
