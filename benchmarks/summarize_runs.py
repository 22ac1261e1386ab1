"""Markdown table of finished runs: python -m benchmarks.summarize_runs runs/untied runs/cycle ...
[--json=PATH] (PATH: the rows as JSON, e.g. docs/results/sharing_cpu.json, whose table
`python -m sharenet.studies.results_tables` regenerates).

Per run: eval bits per byte (last eval), params_unique, params_applied, median tokens/s over the
logged steps after the first log window (which includes compilation).
"""
import json
import os
import statistics

from absl import flags

from sharenet.config import cli
from sharenet.errors import ConfigError

_JSON = flags.DEFINE_string('json', None, 'also write the rows as JSON to this path')


def summarize(workdir: str) -> dict:
  cfg = json.load(open(os.path.join(workdir, 'config.json')))
  rows = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl')) if l.strip()]
  train = [r for r in rows if 'tokens_per_sec' in r]
  evals = [r for r in rows if 'eval_bits_per_byte' in r]
  s = cfg['model']['sharing']
  return {'run': os.path.basename(os.path.normpath(workdir)), 'scheme': s['scheme'],
          'plan': ''.join('ABCDEFGHIJKLMNOPQRSTUVWXYZ'[i] for i in cfg['plan_index']),
          'lora_rank': s['lora_rank'], 'steps': train[-1]['step'] if train else 0,
          'final_loss': train[-1]['loss'] if train else float('nan'),
          'eval_bpb': evals[-1]['eval_bits_per_byte'] if evals else float('nan'),
          'params_unique': cfg['params_unique'], 'params_applied': cfg['params_applied'],
          'tokens_per_sec': statistics.median(r['tokens_per_sec'] for r in train[1:] or train)}


def to_markdown(rows: list[dict]) -> str:
  lines = ['| config | plan | LoRA r | steps | eval bits/byte | params_unique | params_applied | '
           'tokens/s |', '|---|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(f"| {r['run']} | {r['plan']} | {r['lora_rank']} | {r['steps']} | "
                 f"{r['eval_bpb']:.3f} | {r['params_unique']:,} | {r['params_applied']:,} | "
                 f"{r['tokens_per_sec']:,.0f} |")
  return '\n'.join(lines) + '\n'


def main(argv):
  dirs = argv[1:]
  if not dirs:
    raise ConfigError('no workdirs given; valid: python -m benchmarks.summarize_runs DIR [DIR ...] '
                      '[--json=PATH]')
  rows = [summarize(d) for d in dirs]
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(rows, f, indent=1)
  print(to_markdown(rows), end='')


if __name__ == '__main__':
  cli.run(main)
