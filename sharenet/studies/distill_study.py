"""Distillation study: does uptraining a recursive conversion by knowledge distillation from its
untied source close more of the conversion's gap than plain cross entropy, at equal steps?

  python -m sharenet.studies.distill_study --config configs/distill_study.py \
      --out runs/distill_study [--config.study.ranks=8,64] [--config.study.seeds=0,1]

Relaxed Recursive Transformers (Bae et al., arXiv:2410.20672, section 3.3 and its uptraining
tables) uptrain a converted model with and without distillation from the model it was
converted from. At CPU scale:

1. the teacher: `study.teacher_steps` steps of the config's model (untied) on its data,
   OUT/teacher;
2. for each LoRA rank r of `study.ranks`: convert.py's own conversion of the teacher
   (`--config.to=recursive`, `study.scheme` with `study.num_unique` sets, init
   `study.init`, SVD LoRA of rank r on `study.lora_targets`, norms per layer), OUT/convert/rank{r};
3. for each rank x method x seed of `study.seeds` (train.seed: data order): the converted
   workdir copied and uptrained `study.steps` steps at `study.lr`, with plain cross entropy
   (`ce`) or distilled from OUT/teacher (`kd`: train.teacher.weight `study.kd_weight`,
   temperature `study.temperature`); the same steps, schedule and data for both.

Every model is evaluated on the same validation tokens (`study.eval_tokens`, 0 = all). The
gap closed is (converted - uptrained) / (converted - teacher) eval loss. Writes
OUT/distill_study.json (teacher, converted and one row per rank x method x seed), OUT/
distill_study.md (mean +- sd over seeds; `python -m sharenet.studies.results_tables`
regenerates it from the JSON). Each cell is kept under OUT/cells with a fingerprint of its
inputs, so an interrupted study resumes at its first missing cell.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from sharenet.config import defaults
from sharenet.errors import ConfigError
from sharenet.main import convert_workdir
from sharenet.studies import common
from sharenet.train import experiment, workdir_io

METHODS = ('ce', 'kd')


def conversion(study: Any, rank: int) -> Any:
  """convert.py's options (defaults.conversion_config) for the student of LoRA rank `rank`."""
  opts = defaults.conversion_config()
  opts.to, opts.scheme, opts.num_unique = 'recursive', study.scheme, int(study.num_unique)
  opts.init, opts.lora_targets, opts.untie_norms = study.init, study.lora_targets, True
  opts.lora_rank, opts.lora_init = int(rank), 'svd' if rank else 'zero'
  return opts


def check(config: Any) -> tuple[list[int], list[int]]:
  """(ranks, seeds) of config.study; one ConfigError line for what cannot run."""
  if 'study' not in config:
    raise ConfigError('the config has no study group; valid: a config like '
                      'configs/distill_study.py')
  s = config.study
  ranks, seeds = common.parse_list(s.ranks, int), common.parse_list(s.seeds, int)
  if not ranks or any(r < 0 for r in ranks):
    raise ConfigError(f'study.ranks={s.ranks!r}; valid: LoRA ranks >= 0, e.g. 8,64')
  if not seeds:
    raise ConfigError(f'study.seeds={s.seeds!r}; valid: train.seed values, e.g. 0,1')
  if s.teacher_steps < 1 or s.steps < 1:
    raise ConfigError(f'study.teacher_steps={s.teacher_steps}, study.steps={s.steps}; valid: '
                      f'>= 1 each')
  if config.model.sharing.scheme != 'untied':
    raise ConfigError(f'model.sharing.scheme={config.model.sharing.scheme!r}: the teacher is '
                      f'the untied model the students are converted from; valid: untied')
  return ranks, seeds


def _uptrain(source: str, workdir: str, study: Any, method: str, seed: int,
             teacher: str) -> dict[str, Any]:
  """The converted `source` copied to `workdir` and trained study.steps more steps."""
  if os.path.isdir(workdir):
    shutil.rmtree(workdir)   # an interrupted cell starts over (its row was never kept)
  shutil.copytree(source, workdir)
  config = workdir_io.load_config(workdir)
  base = int(study.teacher_steps)   # the converted checkpoint's step: the teacher's last
  overrides = {'train.steps': int(base + study.steps), 'train.lr': float(study.lr),
               'train.warmup_steps': int(study.warmup_steps), 'train.seed': int(seed),
               'train.checkpoint_every': int(base + study.steps), 'train.progress': False,
               'train.eval_every': 0, 'data.eval_tokens': int(study.eval_tokens),
               'train.restore': 'params'}   # the seed's own data stream, a fresh optimizer
  if method == 'kd':
    overrides.update({'train.teacher.workdir': teacher,
                      'train.teacher.weight': float(study.kd_weight),
                      'train.teacher.temperature': float(study.temperature)})
  return common.trained(common.with_overrides(config, overrides), workdir)


def main(config: Any, out: str) -> int:
  ranks, seeds = check(config)
  s = config.study
  cells = os.path.join(out, 'cells')
  t0 = time.time()
  teacher = os.path.join(out, 'teacher')
  base = json.loads(experiment.to_json(config))
  base.pop('study')

  def train_teacher():
    cfg = common.with_overrides(config, {'train.steps': int(s.teacher_steps),
                                         'train.checkpoint_every': int(s.teacher_steps),
                                         'train.progress': False, 'train.eval_every': 0,
                                         'data.eval_tokens': int(s.eval_tokens)})
    return common.trained(cfg, teacher)

  teacher_inputs = {'config': base, 'steps': s.teacher_steps, 'eval_tokens': s.eval_tokens}
  result: dict[str, Any] = {'study': s.to_dict(),
                            'teacher': common.cached_cell(cells, 'teacher', teacher_inputs,
                                                          train_teacher),
                            'converted': {}, 'rows': []}
  for r in ranks:
    dst = os.path.join(out, 'convert', f'rank{r}')
    opts = conversion(s, r)

    def convert(dst=dst, opts=opts):
      if os.path.isdir(dst):
        shutil.rmtree(dst)
      convert_workdir.convert_workdir(teacher, dst, opts)
      return {**common.evaluated(dst, s.eval_tokens), 'params_unique': common.stored_params(dst)}

    inputs = {'teacher': teacher_inputs, 'conversion': opts.to_dict()}
    result['converted'][str(r)] = common.cached_cell(cells, f'convert-rank{r}', inputs, convert)
    for method in METHODS:
      for seed in seeds:
        workdir = os.path.join(out, 'runs', f'rank{r}-{method}-seed{seed}')
        keys = ('steps', 'lr', 'warmup_steps', 'eval_tokens') + (
            ('kd_weight', 'temperature') if method == 'kd' else ())
        cell = {**inputs, 'method': method, 'seed': seed, **{k: s[k] for k in keys}}
        row = common.cached_cell(cells, f'rank{r}-{method}-seed{seed}', cell,
                                 lambda: _uptrain(os.path.join(out, 'convert', f'rank{r}'),
                                                  workdir, s, method, seed, teacher))
        result['rows'].append({'rank': r, 'method': method, 'seed': seed, **row})
        print(json.dumps(result['rows'][-1]), flush=True)
  result['runtime_s'] = round(time.time() - t0, 1)
  common.write_result(out, 'distill_study', result, to_markdown)
  return 0


def to_markdown(result: dict[str, Any]) -> str:
  """The study's table: per rank, the converted model's eval loss, each method's after
  uptraining (mean ± sd over seeds) and the share of the conversion's gap it closed."""
  s, tl = result['study'], result['teacher']['eval_loss']
  lines = [f"Teacher: the untied model after {s['teacher_steps']} steps, eval loss {tl:.4f}. "
           f"Students: {s['scheme']} with {s['num_unique']} sets (init {s['init']}), SVD LoRA on "
           f"{s['lora_targets']}, uptrained {s['steps']} steps at LR {s['lr']} with cross "
           f"entropy (CE) or distillation from the teacher (KD: weight {s['kd_weight']}, "
           f"temperature {s['temperature']}); seeds {s['seeds']} (data order). Gap closed = "
           f"(converted - uptrained) / (converted - teacher).", '',
           '| LoRA rank | stored params | converted | CE | KD | gap closed: CE | gap closed: KD |',
           '|---|---|---|---|---|---|---|']
  for r, conv in sorted(result['converted'].items(), key=lambda kv: int(kv[0])):
    cl = conv['eval_loss']
    by = {m: [row['eval_loss'] for row in result['rows']
              if str(row['rank']) == r and row['method'] == m] for m in METHODS}
    closed = {m: [(cl - x) / (cl - tl) for x in xs] for m, xs in by.items()}
    lines.append(f"| {r} | {conv['params_unique']:,} | {cl:.4f} | {common.mean_sd(by['ce'])} | "
                 f"{common.mean_sd(by['kd'])} | {common.mean_sd(closed['ce'])} | {common.mean_sd(closed['kd'])} |")
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  common.run_cli(main, 'runs/distill_study', 'configs/distill_study.py')
