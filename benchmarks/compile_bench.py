"""Lowering + compile time of the train step for a 2-layer block repeated R times.

Command: python benchmarks/compile_bench.py [--d_model 256] [--lowering nested|flat]
Prints one JSON line per R (minimum over interleaved passes) and the ratio
compile(R=16) / compile(R=1). Both lowerings keep the traced program the same size for every R
(nested: repeats are an outer scan; flat: one scan over 2R layers with a gather), so the ratio
should stay near 1 (target <= 1.5). Runtime ~1.5 min on the 2-core CPU.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import default  # noqa: E402
from sharenet import optim, train_lib  # noqa: E402
from sharenet.models import DecoderLM, ModelConfig, param_table  # noqa: E402


def measure(repeats: int, d_model: int, seq_len: int, batch: int,
            lowering: str = 'nested') -> dict:
  config = default.get_config()
  m = config.model
  m.d_model, m.num_heads, m.mlp_dim = d_model, max(1, d_model // 64), 3 * d_model
  m.num_layers = 2 * repeats
  m.sharing.scheme, m.sharing.num_unique = 'cycle', 2
  m.scan_lowering = lowering
  mcfg = ModelConfig.from_config(m)
  model, tx = DecoderLM(mcfg), optim.make_optimizer(config.train, table=param_table(mcfg))
  state = jax.eval_shape(lambda: train_lib.init_state(model, tx, jax.random.key(0)))
  batch_BT1 = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
  step = jax.jit(functools.partial(train_lib.train_step, model=model, tx=tx, grad_accum=1))
  t0 = time.perf_counter()
  lowered = step.lower(state, batch_BT1)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return {'repeats': repeats, 'applied_layers': 2 * repeats, 'lower_s': t1 - t0,
          'compile_s': t2 - t1, 'total_s': t2 - t0, 'hlo_chars': len(lowered.as_text())}


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--d_model', type=int, default=256)
  p.add_argument('--seq_len', type=int, default=256)
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--passes', type=int, default=3)
  p.add_argument('--lowering', default='nested', help='model.scan_lowering: nested | flat')
  args = p.parse_args()
  jax.config.update('jax_enable_compilation_cache', False)  # measure real compiles
  measure(1, 64, 16, 2)  # warm up tracing machinery so R=1 is not charged for imports
  # Compile time on a shared 2-core machine jitters by ~20%: interleave passes, keep the minimum.
  passes = [[measure(r, args.d_model, args.seq_len, args.batch, args.lowering)
             for r in (1, 2, 4, 8, 16)]
            for _ in range(args.passes)]
  rows = [{**ps[0], **{k: min(p[k] for p in ps) for k in ('lower_s', 'compile_s', 'total_s')}}
          for ps in zip(*passes)]
  for row in rows:
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
  print(json.dumps({'total_ratio_R16_over_R1': round(rows[-1]['total_s'] / rows[0]['total_s'], 3),
                    'compile_ratio_R16_over_R1': round(rows[-1]['compile_s'] / rows[0]['compile_s'],
                                                       3)}))


if __name__ == '__main__':
  main()
