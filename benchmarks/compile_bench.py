"""Lowering + compile time of the train step for a 2-layer block repeated R times.

Command: python -m benchmarks.compile_bench [--config.d_model=256]
             [--config.lowering=nested|flat]
             [--config.routing=none|expert_choice|token_choice]
             [--config.routing_buckets=0|n]   (from the repository root)
Prints one JSON line per R (minimum over interleaved passes) and the ratio
compile(R=16) / compile(R=1). Both lowerings keep the traced program the same size for every R
(nested: repeats are an outer scan; flat: one scan over 2R layers with a gather), so the ratio
should stay near 1 (target <= 1.5). Runtime ~1.5 min on the 2-core CPU.

`--config.routing` routes the R recursions (Mixture-of-Recursions, docs/routing.md). Token
choice runs one scan over the recursions (ratio near 1). Expert choice with
`--config.routing_buckets=0` runs each recursion as its own scan over a subset of a different
static length, so the program grows with R and the ratio with it; with `routing_buckets=n`
(n <= 1 here, as R starts at 1) it runs n scans whatever R, and the ratio stays near 1.
"""
from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import ml_collections

from configs import default
from sharenet.config import cli
from sharenet.train import trainer
from sharenet.models import ModelConfig


def measure(repeats: int, d_model: int, seq_len: int, batch: int,
            lowering: str = 'nested', routing: str = 'none', buckets: int = 0) -> dict:
  config = default.get_config()
  m = config.model
  m.d_model, m.num_heads, m.mlp_dim = d_model, max(1, d_model // 64), 3 * d_model
  m.num_layers = 2 * repeats
  m.sharing.scheme, m.sharing.num_unique = 'cycle', 2
  m.scan_lowering = lowering
  m.routing.kind = routing
  m.routing.buckets = buckets
  mcfg = ModelConfig.from_experiment(config)
  exp = trainer.setup(config, mcfg)
  state = trainer.abstract_state(exp.model, exp.tx, exp.tr, exp.pz)
  batch_BT1 = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
  step = jax.jit(trainer.make_train_step(exp, config.train.grad_accum))
  t0 = time.perf_counter()
  lowered = step.lower(state, batch_BT1)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return {'repeats': repeats, 'applied_layers': 2 * repeats, 'lower_s': t1 - t0,
          'compile_s': t2 - t1, 'total_s': t2 - t0, 'hlo_chars': len(lowered.as_text())}


def options() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.d_model = 256
  o.seq_len = 256
  o.batch = 8
  o.passes = 3          # interleaved passes; the minimum per R is kept
  o.lowering = 'nested'  # model.scan_lowering: nested | flat
  o.routing = 'none'     # model.routing.kind: none | expert_choice | token_choice
  o.routing_buckets = 0  # model.routing.buckets (expert_choice): 0 | 1
  return o


_OPTIONS = cli.define_config_dict('config', options(), 'Benchmark options.')


def main(argv):
  del argv
  args = _OPTIONS.value
  jax.config.update('jax_enable_compilation_cache', False)  # measure real compiles
  measure(1, 64, 16, 2)  # warm up tracing machinery so R=1 is not charged for imports
  # Compile time on a shared 2-core machine jitters by ~20%: interleave passes, keep the minimum.
  passes = [[measure(r, args.d_model, args.seq_len, args.batch, args.lowering, args.routing,
                     args.routing_buckets)
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
  cli.run(main)
