"""What train.watch costs: the non-log steps' program and speed, and a log step's.

Command: python -m benchmarks.watch_bench [--config.steps=20]
             [--config.out=benchmarks/results/watch_cpu.json]   (from the repository root)
Runtime: ~2 min on the 2-core CPU.

What runs: the default model (configs/default.py: 4 layers, d_model 256, batch 16 x 256 bytes)
as a cycle of 2 stored sets, its real train step (trainer.make_train_step, jitted as the loop
jits it) with train.watch off and on. With watch on the loop runs the plain step at every
non-log step and the watched one at log steps; reported: whether the plain step of a run with
train.watch=True lowers to the same program text as without it, the
median seconds per step of the plain and the watched step (blocks of `steps` steps,
alternated so drift hits both), and their ratio: the extra cost of one log step.
Result: docs/checkpoints.md "Watching a run".
"""
from __future__ import annotations

import json
import statistics
import time

import jax
import ml_collections

from configs import default
from sharenet.config import cli
from sharenet.studies import common
from sharenet.train import experiment, trainer


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.steps = 20        # steps per timed block
  c.blocks = 3        # blocks per step kind, alternated
  c.out = ''
  return c


def run(opts) -> dict:
  config = common.with_overrides(default.get_config(), {
      'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2})
  exp = trainer.setup(config, experiment.validate(config))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), tr=exp.tr, pz=exp.pz)
  t = config.train
  batch = jax.random.randint(jax.random.key(1), (t.batch_size, t.seq_len + 1), 0, 256)
  plain = jax.jit(trainer.make_train_step(exp))
  watched = jax.jit(trainer.make_train_step(exp, watch=True))
  # the plain step of a run with train.watch=True: the same program as without it
  on = common.with_overrides(config, {'train.watch': True})
  plain_on = jax.jit(trainer.make_train_step(trainer.setup(on, experiment.validate(on))))
  same = plain.lower(state, batch).as_text() == plain_on.lower(state, batch).as_text()
  times = {'plain': [], 'watched': []}
  for name, fn in (('plain', plain), ('watched', watched)):   # compile outside the timing
    jax.block_until_ready(fn(state, batch))
  for _ in range(opts.blocks):
    for name, fn in (('plain', plain), ('watched', watched)):
      s = state
      t0 = time.perf_counter()
      for _ in range(opts.steps):
        s, m = fn(s, batch)
      jax.block_until_ready((s, m))
      times[name].append((time.perf_counter() - t0) / opts.steps)
  out = {'model': 'configs/default.py, cycle of 2 sets', 'device': jax.devices()[0].device_kind,
         'plain_program_identical': same, 'watch_rows': sum(k.startswith('watch/') for k in m),
         'plain_sec_per_step': round(statistics.median(times['plain']), 4),
         'watched_sec_per_step': round(statistics.median(times['watched']), 4)}
  out['watched_over_plain'] = round(out['watched_sec_per_step'] / out['plain_sec_per_step'], 3)
  print(json.dumps(out))
  if opts.out:
    with open(opts.out, 'w') as f:
      json.dump(out, f, indent=2)
  return out


_OPTIONS = cli.define_config_dict('config', get_config(), 'Benchmark options.')


def main(argv):
  del argv
  run(_OPTIONS.value)


if __name__ == '__main__':
  cli.run(main)
