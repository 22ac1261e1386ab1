"""Markdown table of finished runs: python -m benchmarks.summarize_runs runs/untied runs/cycle ...

Per run: eval bits per byte (last eval), params_unique, params_applied, median tokens/s over the
logged steps after the first log window (which includes compilation).
"""
import json
import os
import statistics

from sharenet import config_lib
from sharenet.errors import ConfigError


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


def main(argv):
  dirs = argv[1:]
  if not dirs:
    raise ConfigError('no workdirs given; valid: python -m benchmarks.summarize_runs DIR [DIR ...]')
  rows = [summarize(d) for d in dirs]
  print('| config | plan | LoRA r | steps | eval bits/byte | params_unique | params_applied | tokens/s |')
  print('|---|---|---|---|---|---|---|---|')
  for r in rows:
    print(f"| {r['run']} | {r['plan']} | {r['lora_rank']} | {r['steps']} | {r['eval_bpb']:.3f} | "
          f"{r['params_unique']:,} | {r['params_applied']:,} | {r['tokens_per_sec']:,.0f} |")


if __name__ == '__main__':
  config_lib.run(main)
