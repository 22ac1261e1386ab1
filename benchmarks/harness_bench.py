"""Downstream-task throughput: how long a 1,000-item multiple-choice task takes through the harness.

Command: python -m benchmarks.harness_bench [--config.num_items=1000]
             [--config.out=benchmarks/results/harness_cpu.json]   (from the repository root)
Runtime: ~1 min on the 2-core CPU.

What runs: the whole harness path (`task_eval.run_tasks`: the harness builds the requests, our
`HarnessLM` scores them, the harness aggregates accuracy) on a task of `num_items` four-choice items
(the fixture task tests/fixtures/tasks/sharenet_mc.yaml's format, its items written here with
other numbers) and, for contrast, the same requests scored one by one (batch of one row, the
shape a naive adapter would use). Model: configs/tiny.py at 4 layers (bytes, d_model 32),
random weights; the harness context is 64 tokens. Reported: seconds for the task (first run,
compilation included, and a second run), requests per second, and the one-by-one rate.
Result: docs/evaluation.md "Speed".
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import time

import jax
import ml_collections

from configs import tiny
from sharenet.config import cli
from sharenet.data import tokenizer
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.tasks import task_eval

TASK_YAML = """task: bench_mc
custom_dataset: !function utils.load
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""
TASK_UTILS = """import json, os
import datasets
def load(**kwargs):
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'items.jsonl')) as f:
    return datasets.DatasetDict({'test': datasets.Dataset.from_list(
        [json.loads(line) for line in f])})
"""


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.num_items = 1000
  c.layers = 4
  c.max_length = 64
  c.out = ''
  return c


def write_task(path: str, items: int) -> None:
  rng = random.Random(0)
  with open(os.path.join(path, 'bench_mc.yaml'), 'w') as f:
    f.write(TASK_YAML)
  with open(os.path.join(path, 'utils.py'), 'w') as f:
    f.write(TASK_UTILS)
  with open(os.path.join(path, 'items.jsonl'), 'w') as f:
    for _ in range(items):
      a, b = rng.randint(1, 999), rng.randint(1, 999)
      choices = [a + b, a + b + 1, a + b - 10, a + b + 100]
      rng.shuffle(choices)
      f.write(json.dumps({'question': f'What is {a} + {b}?', 'choices': [str(c) for c in choices],
                          'label': choices.index(a + b)}) + '\n')


def run(config: ml_collections.ConfigDict) -> dict:
  c = tiny.get_config()
  c.model.num_layers = config.layers
  model = DecoderLM(ModelConfig.from_config(c.model))
  variables = init_variables(model, jax.random.key(0), seq_len=config.max_length)
  tok = tokenizer.load('bytes')
  out = {'items': config.num_items, 'requests': 4 * config.num_items, 'layers': config.layers,
         'd_model': c.model.d_model, 'max_length': config.max_length,
         'device': jax.devices()[0].device_kind}
  with tempfile.TemporaryDirectory() as tmp:
    write_task(tmp, config.num_items)
    lm = task_eval.as_harness_model(model, variables, tok, max_length=config.max_length)
    for key in ('first_run_sec', 'second_run_sec'):
      t0 = time.perf_counter()
      acc = task_eval.run_tasks(lm, ['bench_mc'], tmp)['bench_mc']['acc']
      out[key] = round(time.perf_counter() - t0, 2)
    out['acc'] = acc
    out['requests_per_sec'] = round(out['requests'] / out['second_run_sec'], 1)
    # the same kind of requests one row at a time (every bucket compiled first)
    one = task_eval.as_harness_model(model, variables, tok, max_length=config.max_length,
                                     max_batch_tokens=16)
    pairs = [(list(b'Question: What is 123 + 456?\nAnswer:'), list(b' 579'))] * 200
    one.score(pairs[:1])
    t0 = time.perf_counter()
    one.score(pairs)
    out['one_by_one_requests_per_sec'] = round(len(pairs) / (time.perf_counter() - t0), 1)
  print(json.dumps(out))
  if config.out:
    with open(config.out, 'w') as f:
      json.dump(out, f, indent=2)
  return out


_OPTIONS = cli.define_config_dict('config', get_config(), 'Benchmark options.')


def main(argv):
  del argv
  run(_OPTIONS.value)


if __name__ == '__main__':
  cli.run(main)
