"""Roofline of the bf16 train step on every chip sharenet knows, and per-device memory on pods.

Command: python -m benchmarks.roofline [--out benchmarks/results/roofline.json] [--no_memory]
         (from the repository root; any machine: it lowers and compiles on the CPU, runs nothing)
Runtime: ~2 min for the step table and ~3 min for the memory dry runs on the 2-core CPU.

Step table, per model size (SIZES) and plan (PLANS), one chip's share of a data-parallel step
of 8 sequences of 2,048 tokens, bfloat16 compute, float32 parameters and AdamW state:
  xla_flops  XLA's cost analysis of the lowered step. The step is lowered with the kernels of
             a TPU (sharenet.kernels.target) except that model.kernels=xla and
             model.attention=chunked, because a Pallas call is opaque to the cost analysis; the
             chunked attention computes the causal triangle in 128-query chunks, no more than
             a FlashAttention kernel's causal blocks do, so the count is a lower bound for the
             kernel path. Layers are unrolled (model.scan_unroll = depth): the cost analysis
             counts a loop body once, and the script checks that no loop left runs more than
             once.
  xla_bytes  XLA's bytes accessed of the same module: every op's operands and results as if
             nothing were fused, an upper estimate of HBM traffic (not used for the bound).
  min_bytes  traffic no step avoids: AdamW reads and writes every stored parameter and both
             moments in float32 (24 bytes per parameter).
  per chip   peak = dense bf16 FLOP/s (sharenet/train/perf.py PEAKS), bw = HBM bytes/s;
             t_lower = max(xla_flops / peak, min_bytes / bw), no step is faster;
             t_unfused = max(xla_flops / peak, xla_bytes / bw);
             mfu_upper = model_flops / (peak * t_lower), model_flops MFU's numerator
             (models/accounting.py: applied depth, causal attention).
Memory table: the dry run (config.dry_run, sharenet/train/sharding.py `report`) of the 1B- and
8B-shaped models, untied, at remat dots_no_batch and full, on a TPU v5p-64 (32 chips: v5p
slice names count TensorCores, two per chip) and on 8 x H200, FSDP over all chips, 8 x 2,048
tokens per chip, in a subprocess with that many CPU devices. The train state per device is
exact (its shardings); the step's peak is XLA:CPU's memory analysis of the compiled CPU step
(arguments + outputs - aliases + temporaries: CPU buffer assignment, the chunked XLA attention
instead of FlashAttention), an estimate of the chip's.
Writes --out (JSON) and the tables into docs/scaling.md between its roofline markers.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks import doc_tables

from configs import default
from configs.sizes import presets
from sharenet import kernels
from sharenet.train import perf, loop, trainer
from sharenet.models import ModelConfig, accounting

_OUT = flags.DEFINE_string('out', 'benchmarks/results/roofline.json', 'JSON results')
_DOCS = flags.DEFINE_string('docs', 'docs/scaling.md', 'Markdown page whose roofline '
                            'section is rewritten ("" to leave it)')
_NO_MEMORY = flags.DEFINE_bool('no_memory', False, 'skip the memory dry runs')
_MEMORY_WORKER = flags.DEFINE_integer('memory_worker', 0, 'internal: dry runs on this many '
                                      'CPU devices, JSON on stdout')

# (name, d_model, applied layers, heads, kv heads, mlp_dim): the size presets' shapes
# (configs/sizes/presets.py: GPT-3 Small's, Medium's and Large's widths and depths, Llama 3.2 1B's
# and 3B's, Llama 3 8B's); SwiGLU, byte vocabulary (256), so the Llama shapes lack their
# 128k-token embeddings.
SIZES = tuple((name.upper(), *shape) for name, shape in presets.SHAPES.items())
# Shared plans keep the applied depth: 4 stored sets looped depth / 4 times
# (benchmarks/accelerator.py's cycle); MoR routes those loops by expert choice at the
# default capacities (R - r) / R.
PLANS = {'untied': {}, 'cycle': {'sharing.scheme': 'cycle', 'sharing.num_unique': 4},
         'mor': {'sharing.scheme': 'cycle', 'sharing.num_unique': 4,
                 'routing.kind': 'expert_choice'}}
SEQ_LEN, BATCH = 2048, 8        # per chip
REMAT = 'dots_no_batch'         # saves weight matmuls, recomputes attention (pod default)
# (name, a device_kind of it for sharenet/train/perf.py)
CHIPS = (('TPU v4', 'TPU v4'), ('TPU v5e', 'TPU v5 lite'), ('TPU v5p', 'TPU v5p'),
         ('TPU v6e', 'TPU v6 lite'), ('A100 80GB', 'NVIDIA A100-SXM4-80GB'),
         ('H100 SXM', 'NVIDIA H100 80GB HBM3'), ('H200', 'NVIDIA H200'))
# (mesh name, devices, device_kind) of the memory dry runs; FSDP over all devices.
MESHES = (('v5p-64', 32, 'TPU v5p'), ('8 x H200', 8, 'NVIDIA H200'))
MEMORY_SIZES = ('1B', '8B')
MEMORY_REMATS = (REMAT, 'full')  # full: only each layer's input is saved
ADAMW_BYTES_PER_PARAM = 24      # read + write float32 parameter, first and second moment
BEGIN, END = '<!-- roofline: begin (python -m benchmarks.roofline) -->', '<!-- roofline: end -->'


def config(size: tuple, plan: str, seq_len: int = SEQ_LEN, batch: int = BATCH):
  name, d, layers, heads, kv_heads, mlp = size
  c = default.get_config()
  m = c.model
  m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.mlp_dim = d, layers, heads, kv_heads, mlp
  m.dtype, m.remat, m.kernels, m.dense_grad = 'bfloat16', REMAT, 'xla', 'xla'
  m.attention = 'chunked'
  for key, value in PLANS[plan].items():
    section, field = key.split('.')
    m[section][field] = value
  c.train.seq_len, c.train.batch_size, c.train.eval_batch_size = seq_len, batch, batch
  return c


def trip_counts(text: str) -> list[int]:
  """The bound of every counted while loop in a StableHLO module (its cond's `i < c`)."""
  counts = []
  for m in re.finditer(r'stablehlo\.while', text):
    cond = text[m.start():m.start() + 20000]
    cond = cond[cond.find('cond {'):]
    const = re.search(r'constant dense<(\d+)> : tensor<i32>', cond[:2000])
    counts.append(int(const.group(1)) if const else -1)
  return counts


def step_costs(size: tuple, plan: str) -> dict[str, Any]:
  """XLA's FLOPs and bytes of one lowered train step, and the model's own counts."""
  c = config(size, plan)
  c.model.scan_unroll = size[2]
  with kernels.target('tpu'):
    mcfg = ModelConfig.from_experiment(c)
    exp = trainer.setup(c, mcfg)
    state = trainer.abstract_state(exp.model, exp.tx, exp.tr, exp.pz)
    batch = jax.ShapeDtypeStruct((BATCH, SEQ_LEN + 1), jnp.int32)
    lowered = jax.jit(trainer.make_train_step(exp)).lower(state, batch)
  loops = [n for n in trip_counts(lowered.as_text()) if n != 1]
  if loops:
    raise RuntimeError(f'{size[0]} {plan}: loops of {loops} iterations left; the cost '
                       f'analysis would count their bodies once')
  cost = lowered.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  tokens = BATCH * SEQ_LEN
  params = accounting.params_unique(state.params)
  return {'model': size[0], 'plan': plan, 'd_model': size[1], 'layers': size[2],
          'params_unique': params, 'params_applied': accounting.params_applied(state.params, mcfg),
          'tokens': tokens, 'model_flops': accounting.flops_per_token(mcfg, SEQ_LEN) * tokens,
          'xla_flops': float(cost['flops']), 'xla_bytes': float(cost['bytes accessed']),
          'min_bytes': float(ADAMW_BYTES_PER_PARAM * params)}


def chip_bounds(row: dict[str, Any]) -> dict[str, dict[str, float]]:
  out = {}
  for name, kind in CHIPS:
    peak, bw = perf.peak_flops(kind, 'bfloat16'), perf.hbm_bandwidth(kind)
    t_compute = row['xla_flops'] / peak
    t_lower = max(t_compute, row['min_bytes'] / bw)
    out[name] = {'peak_flops': peak, 'hbm_bytes_per_s': bw, 't_compute_s': t_compute,
                 't_lower_s': t_lower, 't_unfused_s': max(t_compute, row['xla_bytes'] / bw),
                 'mfu_upper': row['model_flops'] / (peak * t_lower)}
  return out


def memory_worker(devices: int) -> None:
  """In a process with `devices` CPU devices: the dry run of each MEMORY_SIZES model."""
  assert jax.device_count() == devices, jax.devices()
  sizes = {s[0]: s for s in SIZES}
  for name in MEMORY_SIZES:
    for remat in MEMORY_REMATS:
      c = config(sizes[name], 'untied', batch=BATCH * devices)
      c.model.remat = remat
      c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, devices, 1
      c.dry_run = True
      with contextlib.redirect_stdout(io.StringIO()):
        totals = loop.train_and_evaluate(c, os.devnull)
      print(json.dumps({'model': name, 'remat': remat, 'devices': devices, **totals}),
            flush=True)


def memory_rows() -> list[dict[str, Any]]:
  rows = []
  for mesh, devices, kind in MESHES:
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                        f' --xla_force_host_platform_device_count={devices}')
    res = subprocess.run([sys.executable, '-m', 'benchmarks.roofline',
                          f'--memory_worker={devices}'], env=env, capture_output=True, text=True)
    if res.returncode:
      raise RuntimeError(f'dry run on {devices} devices failed: {res.stderr[-2000:]}')
    for line in res.stdout.splitlines():
      if line.startswith('{'):
        row = json.loads(line)
        rows.append({**row, 'mesh': mesh, 'hbm_bytes': perf.hbm_capacity(kind)})
  return rows


def _g(x: float) -> str:
  return f'{x / 1e9:.1f}'


def markdown(steps: list[dict[str, Any]], memory: list[dict[str, Any]]) -> str:
  chips = [n for n, _ in CHIPS]
  lines = [
      textwrap.fill(
          f'bf16 train step, one chip\'s share of a data-parallel step: {BATCH} x {SEQ_LEN:,} '
          f'tokens, remat `{REMAT}`. TFLOP: XLA\'s count (chunked causal attention) and the '
          f'model\'s (MFU\'s numerator); GB: XLA\'s unfused bytes and AdamW\'s minimum. Per '
          f'chip: the lower bound on step time in ms; and the upper bound on MFU.', 96), '',
      '| model | plan | params (stored) | XLA TFLOP | model TFLOP | XLA GB (unfused) | min GB | '
      + ' | '.join(f'{c} ms' for c in chips) + ' | MFU bound |',
      '|---' * (7 + len(chips) + 1) + '|']
  for r in steps:
    b = r['chips']
    mfu = sorted({f'{b[c]["mfu_upper"]:.2f}' for c in chips})
    lines.append(
        f'| {r["model"]} | {r["plan"]} | {r["params_unique"] / 1e6:,.0f}M | '
        f'{r["xla_flops"] / 1e12:.1f} | {r["model_flops"] / 1e12:.1f} | {_g(r["xla_bytes"])} | '
        f'{_g(r["min_bytes"])} | ' + ' | '.join(f'{1e3 * b[c]["t_lower_s"]:.0f}' for c in chips)
        + f' | {"-".join((mfu[0], mfu[-1])) if len(mfu) > 1 else mfu[0]} |')
  if memory:
    lines += ['', textwrap.fill(
        f'Per-device memory, untied, FSDP over all chips, {BATCH} x {SEQ_LEN:,} tokens per chip '
        f'(dry run: state exact, step peak from XLA:CPU\'s memory analysis; GB = 1e9 bytes).',
        96), '',
              '| model | mesh | remat | params GB/device | train state GB/device | step peak '
              'GB/device (CPU estimate) | HBM GB/chip |', '|---|---|---|---|---|---|---|']
    for r in memory:
      lines.append(f'| {r["model"]} | {r["mesh"]} | `{r["remat"]}` | '
                   f'{_g(r["param_bytes_per_device"])} | '
                   f'{_g(r["state_bytes_per_device"])} | '
                   f'{_g(r.get("step_peak_bytes_per_device", float("nan")))} | '
                   f'{_g(r["hbm_bytes"])} |')
  return '\n'.join(lines)


def main(argv) -> None:
  del argv
  if _MEMORY_WORKER.value:
    memory_worker(_MEMORY_WORKER.value)
    return
  steps = []
  for size in SIZES:
    for plan in PLANS:
      row = step_costs(size, plan)
      row['chips'] = chip_bounds(row)
      steps.append(row)
      print(f'{row["model"]:>5} {plan:<7} XLA {row["xla_flops"] / 1e12:7.1f} TFLOP, model '
            f'{row["model_flops"] / 1e12:7.1f} TFLOP, {_g(row["xla_bytes"])} GB unfused',
            flush=True)
  memory = [] if _NO_MEMORY.value else memory_rows()
  for r in memory:
    peak = r.get('step_peak_bytes_per_device', float('nan'))
    print(f'{r["model"]} on {r["mesh"]}, remat {r["remat"]}: state '
          f'{_g(r["state_bytes_per_device"])} GB/device, step peak {_g(peak)} GB/device',
          flush=True)
  setting = {'seq_len': SEQ_LEN, 'batch_per_chip': BATCH, 'remat': REMAT, 'dtype': 'bfloat16',
             'adamw_bytes_per_param': ADAMW_BYTES_PER_PARAM, 'jax': jax.__version__,
             'chips': {n: k for n, k in CHIPS}}
  os.makedirs(os.path.dirname(_OUT.value) or '.', exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump({'setting': setting, 'steps': steps, 'memory': memory}, f, indent=1)
  if _DOCS.value:
    doc_tables.splice(_DOCS.value, BEGIN, END, markdown(steps, memory))
  print(f'wrote {_OUT.value}' + (f' and the table in {_DOCS.value}' if _DOCS.value else ''))


if __name__ == '__main__':
  app.run(main)
