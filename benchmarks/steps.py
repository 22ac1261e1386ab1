"""The scanned train step the CPU benchmarks time (step_bench.py, peer_compare.py)."""
from __future__ import annotations

import functools
import statistics
import time

import jax

from configs import default
from sharenet.train import trainer
from sharenet.models import ModelConfig, accounting

SCHEMES = {'untied': {}, 'cycle': {'num_unique': 4}, 'universal': {}}


def build(d_model: int, scheme: str, remat: str, layers: str, seq_len: int, batch: int,
          dtype: str, num_layers: int = 8, dense_grad: str = 'auto'):
  """layers: 'nested' | 'flat' (model.scan_lowering) or 'unrolled' (Python loop)."""
  config = default.get_config()
  m = config.model
  m.d_model, m.num_heads, m.mlp_dim = d_model, max(1, d_model // 64), 3 * d_model
  m.num_layers, m.dense_grad = num_layers, dense_grad
  m.remat, m.scan_layers, m.dtype = remat, layers != 'unrolled', dtype
  m.scan_lowering = 'nested' if layers == 'unrolled' else layers
  m.sharing.scheme = scheme
  for k, v in SCHEMES[scheme].items():
    m.sharing[k] = v
  mcfg = ModelConfig.from_experiment(config)
  exp = trainer.setup(config, mcfg)
  state = jax.jit(functools.partial(trainer.init_state, exp.model, exp.tx, tr=exp.tr,
                                    pz=exp.pz))(jax.random.key(0))
  step = jax.jit(trainer.make_train_step(exp, config.train.grad_accum), donate_argnums=0)
  batch_BT1 = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, 256)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch_BT1).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  temp_mb = getattr(mem, 'temp_size_in_bytes', 0) / 2**20 if mem is not None else float('nan')
  return {'state': state, 'step': compiled, 'batch': batch_BT1, 'compile_s': compile_s,
          'temp_mb': temp_mb, 'flops_tok': accounting.flops_per_token(mcfg, seq_len),
          'times': []}


def run_step(v: dict) -> float:
  t0 = time.perf_counter()
  v['state'], metrics = v['step'](v['state'], v['batch'])
  jax.block_until_ready(metrics)
  return time.perf_counter() - t0


def quantile(xs: list[float], q: float) -> float:
  if len(xs) < 2:
    return xs[0]
  return statistics.quantiles(xs, n=100, method='inclusive')[round(100 * q) - 1]
