"""One script for a GPU or TPU chip: kernels against references, kernel speed, train-step MFU.

Command: python -m benchmarks.accelerator [--smoke] [--out benchmarks/results/accelerator.jsonl]
             [--budget_s 420]                                  (from the repository root)
Runtime: under 8 minutes on one GPU / TPU chip (each section stops adding shapes when the
budget is spent); --smoke runs every section at tiny size on the CPU (Pallas interpret mode) in
about a minute and is part of the tests (tests/benchmarks/test_accelerator_bench.py).

Sections (docs/scaling.md explains how to read them):
  1. check    every kernel against its jnp reference on this backend: attention (pallas, cudnn
              where present) and the fused residual-add + norm (rmsnorm, layernorm, crmsnorm),
              values and gradients, float32 and bfloat16.
  2. attention  forward + backward time of xla / cudnn / pallas at T 2k-8k, d_head 64 and 128,
              bfloat16, causal; TFLOP/s on causal FLOPs (MaxText's convention) and the ratio to
              cuDNN (target: Pallas within 10 % of cuDNN or faster).
  3. norms    the fused residual-add + norm, forward and forward + backward, bfloat16, as a
              fraction of the chip's HBM bandwidth (target >= 85 %); on the CPU the reference
              is an in-process copy's bandwidth.
  4. step     the full train step in bfloat16 (float32 parameters and optimizer state) for a
              ~125M, a ~350M and the largest model that fits, under the untied, cycle and
              universal plans, scanned, at the best remat of a short list; MFU against the
              chip's dense bf16 peak (sharenet/train/perf.py), FLOPs on applied depth with causal
              attention (target >= 45 % at the largest size).
Every measurement is one JSON line in --out; the summary table is printed and written next to
it as Markdown (same name, .md).
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

from absl import app, flags
import jax
import jax.numpy as jnp

from configs import default
from sharenet import kernels
from sharenet.train import perf, trainer
from sharenet.kernels import attention as attn_k
from sharenet.kernels import norms as norm_k
from sharenet.models import ModelConfig, accounting

_SMOKE = flags.DEFINE_bool('smoke', False, 'tiny shapes on any backend (CPU: interpret mode)')
_OUT = flags.DEFINE_string('out', '', 'JSONL results file (default '
                           'benchmarks/results/accelerator_<device>.jsonl; smoke: a temp dir)')
_BUDGET = flags.DEFINE_float('budget_s', 420.0, 'wall-clock budget for sections 2-4')

NORM_KINDS = ('rmsnorm', 'layernorm', 'crmsnorm')
# (name, d_model, applied layers, heads, mlp_dim); SwiGLU, byte vocab (256).
MODELS = (('125M', 768, 12, 12, 2048), ('350M', 1024, 24, 16, 2816),
          ('760M', 1536, 24, 16, 4096), ('1.3B', 2048, 24, 16, 5504),
          ('2.7B', 2560, 32, 20, 6912))
SMOKE_MODELS = (('tiny', 32, 4, 2, 64),)
PLANS = {'untied': {}, 'cycle': {'num_unique': 4}, 'universal': {}}
REMATS = ('dots_no_batch', 'full')


class Budget:
  def __init__(self, seconds: float):
    self.end = time.perf_counter() + seconds

  def left(self) -> float:
    return self.end - time.perf_counter()


def timeit(f: Callable[[], Any], repeats: int) -> float:
  """Median wall time of `repeats` calls after one warm-up (compile) call."""
  jax.block_until_ready(f())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def max_rel_err(a, b) -> float:
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


# ---------------------------------------------------------------------------------------------
# 1. kernels against references


def check_attention(impl: str, dtype, smoke: bool) -> dict:
  B, T, H, K, Dh = (1, 40, 4, 2, 32) if smoke else (2, 1024, 8, 2, 128)
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (B, T, H, Dh), dtype)
  k = jax.random.normal(ks[1], (B, T, K, Dh), dtype)
  v = jax.random.normal(ks[2], (B, T, K, Dh), dtype)
  g = jax.random.normal(ks[3], (B, T, H, Dh), jnp.float32)
  scale = Dh ** -0.5

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * g)

  kern = functools.partial(attn_k.attention, scale=scale, impl=impl)
  ref = functools.partial(attn_k.reference, scale=scale)
  out, grads = jax.jit(jax.value_and_grad(functools.partial(loss, kern), (0, 1, 2)))(q, k, v)
  # The reference runs in float32 from the same (rounded) inputs: the kernel's error budget.
  f32 = lambda t: t.astype(jnp.float32)
  out_r, grads_r = jax.jit(jax.value_and_grad(functools.partial(loss, ref), (0, 1, 2)))(
      f32(q), f32(k), f32(v))
  fwd = max_rel_err(kern(q, k, v), ref(f32(q), f32(k), f32(v)))
  bwd = max(max_rel_err(a, b) for a, b in zip(grads, grads_r))
  tol = (1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 5e-2)
  return {'kernel': f'attention/{impl}', 'dtype': jnp.dtype(dtype).name,
          'shape': [B, T, H, K, Dh], 'fwd_rel_err': fwd, 'bwd_rel_err': bwd,
          'ok': fwd <= tol[0] and bwd <= tol[1], 'tol': list(tol)}


def check_norm(kind: str, dtype, smoke: bool) -> dict:
  N, D = (13, 48) if smoke else (4096, 2048)
  ks = jax.random.split(jax.random.key(1), 5)
  x = jax.random.normal(ks[0], (N, D), dtype)
  r = jax.random.normal(ks[1], (N, D), dtype)
  gain = 1 + 0.1 * jax.random.normal(ks[2], (D,), jnp.float32)
  bias = 0.1 * jax.random.normal(ks[3], (D,), jnp.float32) if kind == 'layernorm' else None
  g = jax.random.normal(ks[4], (N, D), jnp.float32)

  def loss(fn, x, r, gain, bias):
    s, y = fn(x, r, gain, bias, kind=kind, eps=1e-6)
    return jnp.sum(y.astype(jnp.float32) * g) + jnp.sum(s.astype(jnp.float32) * g[::-1])

  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  grads = jax.jit(jax.grad(functools.partial(loss, norm_k.add_norm), argnums))(x, r, gain, bias)
  f32 = lambda t: None if t is None else t.astype(jnp.float32)
  grads_r = jax.jit(jax.grad(functools.partial(loss, norm_k.reference_add_norm), argnums))(
      f32(x), f32(r), gain, bias)
  y = norm_k.add_norm(x, r, gain, bias, kind=kind, eps=1e-6)[1]
  y_r = norm_k.reference_add_norm(f32(x), f32(r), gain, bias, kind=kind, eps=1e-6)[1]
  fwd = max_rel_err(y, y_r)
  bwd = max(max_rel_err(a, b) for a, b in zip(grads, grads_r))
  tol = (1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 5e-2)
  return {'kernel': f'add_norm/{kind}', 'dtype': jnp.dtype(dtype).name, 'shape': [N, D],
          'fwd_rel_err': fwd, 'bwd_rel_err': bwd, 'ok': fwd <= tol[0] and bwd <= tol[1],
          'tol': list(tol)}


def attention_impls() -> list[str]:
  impls = ['xla', 'pallas']
  if kernels.backend() == 'gpu':
    impls.insert(1, 'cudnn')
  return impls


def section_check(smoke: bool, emit) -> None:
  for dtype in (jnp.float32, jnp.bfloat16):
    for impl in attention_impls():
      if impl == 'xla' or (impl == 'cudnn' and dtype == jnp.float32):
        continue            # xla is the reference; cuDNN attention takes 16-bit inputs only
      emit('check', guarded(check_attention, impl, dtype, smoke))
    for kind in NORM_KINDS:
      emit('check', guarded(check_norm, kind, dtype, smoke))


# ---------------------------------------------------------------------------------------------
# 2. attention speed


def time_attention(impl: str, B: int, T: int, H: int, K: int, Dh: int, repeats: int) -> dict:
  ks = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(ks[0], (B, T, H, Dh), jnp.bfloat16)
  k = jax.random.normal(ks[1], (B, T, K, Dh), jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, T, K, Dh), jnp.bfloat16)
  fn = functools.partial(attn_k.attention, scale=Dh ** -0.5, impl=impl)
  fwd = jax.jit(fn)
  fwd_bwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                             (0, 1, 2)))
  t_fwd = timeit(lambda: fwd(q, k, v), repeats)
  t_all = timeit(lambda: fwd_bwd(q, k, v), repeats)
  # Causal: half of QK^T and PV (2 matmuls x 2 FLOPs x T^2 x Dh per head); backward = 2.5x.
  flops_fwd = 2 * 2 * B * H * T * T * Dh / 2
  return {'impl': impl, 'shape': [B, T, H, K, Dh], 'fwd_ms': 1e3 * t_fwd,
          'fwd_bwd_ms': 1e3 * t_all, 'fwd_tflops': flops_fwd / t_fwd / 1e12,
          'fwd_bwd_tflops': 3.5 * flops_fwd / t_all / 1e12}


def section_attention(smoke: bool, budget: Budget, emit) -> None:
  if smoke:
    shapes = [(1, 32, 2, 2, 16), (1, 40, 4, 2, 32)]
  else:   # ~16k tokens per call; GQA 4:1 at d_head 128
    shapes = [(8, 2048, 16, 16, 64), (8, 2048, 16, 4, 128), (4, 4096, 16, 4, 128),
              (2, 8192, 16, 4, 128), (2, 8192, 32, 32, 64)]
  for shape in shapes:
    rows = {}
    for impl in attention_impls():
      if budget.left() < 0:
        return
      rows[impl] = guarded(time_attention, impl, *shape, repeats=3 if smoke else 10)
    if 'cudnn' in rows and 'fwd_bwd_ms' in rows['cudnn']:
      for r in rows.values():
        if 'fwd_bwd_ms' in r:
          r['vs_cudnn'] = rows['cudnn']['fwd_bwd_ms'] / r['fwd_bwd_ms']   # > 1: faster
    for r in rows.values():
      emit('attention', r)


# ---------------------------------------------------------------------------------------------
# 3. fused norm bandwidth


def copy_bandwidth(n_bytes: int = 1 << 28) -> float:
  """Bytes/s of a jitted x + 1 over a bf16 buffer (reads and writes it once): the CPU reference."""
  x = jnp.zeros((n_bytes // 2,), jnp.bfloat16)
  f = jax.jit(lambda x: x + 1)
  return 2 * n_bytes / timeit(lambda: f(x), 5)


def time_norm(kind: str, impl: str, N: int, D: int, repeats: int) -> dict:
  ks = jax.random.split(jax.random.key(3), 2)
  x = jax.random.normal(ks[0], (N, D), jnp.bfloat16)
  r = jax.random.normal(ks[1], (N, D), jnp.bfloat16)
  gain = jnp.ones((D,), jnp.float32)
  bias = jnp.zeros((D,), jnp.float32) if kind == 'layernorm' else None
  fn = norm_k.add_norm if impl == 'pallas' else norm_k.reference_add_norm
  call = functools.partial(fn, kind=kind, eps=1e-6)
  fwd = jax.jit(call)
  fwd_bwd = jax.jit(jax.grad(lambda x, r, gain: sum(
      jnp.sum(t.astype(jnp.float32)) for t in call(x, r, gain, bias)), (0, 1, 2)))
  t_fwd = timeit(lambda: fwd(x, r, gain, bias), repeats)
  t_all = timeit(lambda: fwd_bwd(x, r, gain), repeats)
  # Forward: x and r in, s and y out, plus the per-row statistics and the gain (exact count in
  # kernels.norms.forward_bytes). The backward moves about as much again (s, dy, ds in; dx out).
  bytes_fwd = norm_k.forward_bytes((N, D), jnp.bfloat16, kind=kind, has_bias=bias is not None)
  return {'kind': kind, 'impl': impl, 'shape': [N, D], 'fwd_ms': 1e3 * t_fwd,
          'fwd_bwd_ms': 1e3 * t_all, 'fwd_bytes_per_s': bytes_fwd / t_fwd}


def section_norms(smoke: bool, budget: Budget, emit) -> None:
  peak = perf.hbm_bandwidth(jax.devices()[0].device_kind)
  label = 'hbm'
  if peak is None:
    peak, label = copy_bandwidth(1 << 22 if smoke else 1 << 28), 'copy'
  shapes = [(64, 48)] if smoke else [(8 * 2048, 1024), (4 * 4096, 2048), (2 * 8192, 4096)]
  for N, D in shapes:
    for kind in NORM_KINDS:
      for impl in ('pallas', 'xla'):
        if budget.left() < 0:
          return
        r = guarded(time_norm, kind, impl, N, D, repeats=3 if smoke else 20)
        if 'fwd_bytes_per_s' in r:
          r['bandwidth_fraction'] = r['fwd_bytes_per_s'] / peak
          r['bandwidth_reference'] = label
        emit('norms', r)


# ---------------------------------------------------------------------------------------------
# 4. train-step MFU


def build_step(size: tuple, plan: str, remat: str, seq_len: int, batch: int, dtype: str,
               kernels_: str):
  name, d, L, H, mlp = size
  config = default.get_config()
  m = config.model
  m.d_model, m.num_layers, m.num_heads, m.mlp_dim = d, L, H, mlp
  m.remat, m.dtype, m.kernels = remat, dtype, kernels_
  m.sharing.scheme = plan
  for k, v in PLANS[plan].items():
    m.sharing[k] = v
  config.train.seq_len, config.train.batch_size = seq_len, batch
  mcfg = ModelConfig.from_experiment(config)
  exp = trainer.setup(config, mcfg)
  state = jax.jit(functools.partial(trainer.init_state, exp.model, exp.tx, tr=exp.tr,
                                    pz=exp.pz))(jax.random.key(0))
  step = jax.jit(trainer.make_train_step(exp, 1), donate_argnums=0)
  batch_BT1 = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, 256)
  compiled = step.lower(state, batch_BT1).compile()
  return state, compiled, batch_BT1, accounting.flops_per_token(mcfg, seq_len)


def time_step(size, plan, remat, seq_len, batch, dtype, repeats) -> dict:
  t0 = time.perf_counter()
  # auto: the Pallas kernels where the backend and shapes allow; smoke forces them (interpret).
  state, step, batch_BT1, flops_tok = build_step(size, plan, remat, seq_len, batch, dtype,
                                                 'pallas' if _SMOKE.value else 'auto')
  compile_s = time.perf_counter() - t0
  box = {'state': state}

  def run():
    box['state'], metrics = step(box['state'], batch_BT1)
    return metrics

  step_s = timeit(run, repeats)
  tps = batch * seq_len / step_s
  row = {'model': size[0], 'd_model': size[1], 'layers': size[2], 'plan': plan, 'remat': remat,
         'dtype': dtype, 'seq_len': seq_len, 'batch': batch, 'step_ms': 1e3 * step_s,
         'tokens_per_sec': tps, 'compile_s': compile_s, 'model_tflops': tps * flops_tok / 1e12}
  peak = perf.peak_flops(jax.devices()[0].device_kind, dtype)
  if peak:
    row['mfu'] = tps * flops_tok / peak
  else:
    row['mfu_vs_matmul'] = tps * flops_tok / perf.matmul_peak_flops(
        256 if _SMOKE.value else 2048, dtype)
  del box
  return row


def section_step(smoke: bool, budget: Budget, emit) -> None:
  sizes = SMOKE_MODELS if smoke else MODELS
  seq_len, batch = (16, 2) if smoke else (2048, 8)
  repeats = 2 if smoke else 5
  for i, size in enumerate(sizes):
    if budget.left() < 0:
      return
    # The remat list on the untied plan, then the shared plans at its best remat.
    rows = [guarded(time_step, size, 'untied', remat, seq_len, batch, 'bfloat16', repeats)
            for remat in REMATS]
    ok = [r for r in rows if 'step_ms' in r]
    for r in rows:
      emit('step', r)
    if not ok:          # out of memory (or failed): the previous size was the largest that fits
      return
    best = min(ok, key=lambda r: r['step_ms'])['remat']
    for plan in ('cycle', 'universal'):
      if budget.left() < 0:
        return
      emit('step', guarded(time_step, size, plan, best, seq_len, batch, 'bfloat16', repeats))


# ---------------------------------------------------------------------------------------------


def guarded(fn, *args, **kwargs) -> dict:
  """fn's row, or a row saying why it failed (out of memory ends a size sweep, not the run)."""
  try:
    return fn(*args, **kwargs)
  except Exception as e:   # noqa: BLE001 -- recorded in the results, and printed
    traceback.print_exc(limit=2, file=sys.stderr)
    return {'fn': fn.__name__, 'args': [str(a) for a in args],
            'error': f'{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ""}'}


def summary_markdown(rows: list[dict]) -> str:
  dev = rows[0]['device'] if rows else '?'
  out = [f'# benchmarks/accelerator.py on {dev}', '']
  checks = [r for r in rows if r['section'] == 'check']
  out += ['| kernel | dtype | fwd rel err | bwd rel err | ok |', '|---|---|---|---|---|']
  out += [f"| {r.get('kernel', r.get('args'))} | {r.get('dtype', '')} | "
          f"{r.get('fwd_rel_err', float('nan')):.1e} | {r.get('bwd_rel_err', float('nan')):.1e} | "
          f"{r.get('ok', r.get('error'))} |" for r in checks]
  out += ['', '| attention impl | B,T,H,K,Dh | fwd+bwd ms | TFLOP/s | vs cuDNN |',
          '|---|---|---|---|---|']
  out += [f"| {r['impl']} | {r['shape']} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_tflops']:.1f} | "
          f"{r.get('vs_cudnn', float('nan')):.2f} |"
          for r in rows if r['section'] == 'attention' and 'fwd_bwd_ms' in r]
  out += ['', '| norm | impl | N,D | fwd ms | GB/s | fraction of bandwidth |', '|---|---|---|---|---|---|']
  out += [f"| {r['kind']} | {r['impl']} | {r['shape']} | {r['fwd_ms']:.3f} | "
          f"{r['fwd_bytes_per_s'] / 1e9:.0f} | {r['bandwidth_fraction']:.2f} "
          f"({r['bandwidth_reference']}) |"
          for r in rows if r['section'] == 'norms' and 'fwd_ms' in r]
  out += ['', '| model | plan | remat | tokens/s | step ms | MFU |', '|---|---|---|---|---|---|']
  out += [f"| {r['model']} | {r['plan']} | {r['remat']} | {r['tokens_per_sec']:,.0f} | "
          f"{r['step_ms']:.1f} | " + (f"{100 * r['mfu']:.1f}%" if 'mfu' in r else
                                      f"{100 * r['mfu_vs_matmul']:.1f}% (vs matmul)") + ' |'
          for r in rows if r['section'] == 'step' and 'step_ms' in r]
  errors = [r for r in rows if 'error' in r]
  if errors:
    out += ['', 'Failed measurements:', ''] + [f"- {r['section']}: {r.get('fn')} "
                                                 f"{r.get('args')}: {r['error']}" for r in errors]
  return '\n'.join(out) + '\n'


def main(argv) -> int:
  del argv
  smoke = _SMOKE.value
  device = jax.devices()[0].device_kind
  out = _OUT.value or os.path.join(
      'benchmarks', 'results', 'accelerator_' + device.lower().replace(' ', '_') + '.jsonl')
  os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
  rows = []
  with open(out, 'w') as f:
    def emit(section: str, row: dict) -> None:
      row = {'section': section, 'device': device, 'backend': kernels.backend(), **row}
      rows.append(row)
      f.write(json.dumps(row) + '\n')
      f.flush()
      print(json.dumps(row), flush=True)

    section_check(smoke, emit)
    budget = Budget(_BUDGET.value)
    section_attention(smoke, budget, emit)
    section_norms(smoke, budget, emit)
    section_step(smoke, budget, emit)
  md = summary_markdown(rows)
  with open(os.path.splitext(out)[0] + '.md', 'w') as f:
    f.write(md)
  print(md)
  failed = [r for r in rows if r['section'] == 'check' and not r.get('ok')]
  # Smoke: every section must have produced a measurement (a broken code path fails the test).
  missing = [s for s in ('check', 'attention', 'norms', 'step')
             if not any(r['section'] == s and 'error' not in r for r in rows)]
  if failed or (smoke and (missing or any('error' in r for r in rows))):
    print(f'accelerator.py: {len(failed)} kernel check(s) failed; sections without a '
          f'measurement: {missing or "none"}', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  app.run(lambda argv: sys.exit(main(argv)))
