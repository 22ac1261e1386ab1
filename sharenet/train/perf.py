"""Model FLOP utilisation: against the hardware peak where it is published, else a measured matmul.

Two figures, named for what they divide by:

- `mfu`: standard MFU (PaLM, arXiv:2204.02311, appendix B): model FLOP/s (train FLOPs on applied
  depth, attention included: `models.accounting.flops_per_token`; a recurrent-depth run or
  trained exits count what each step executed at its depth: sharenet/train/sampled_depth.py) over
  the
  dense peak FLOP/s of all devices for the compute dtype, from `PEAKS`. Logged only on an
  accelerator in `PEAKS`.
- `mfu_vs_matmul`: the same model FLOP/s over the FLOP/s of a large jitted jnp.dot measured in
  the same process (`matmul_peak_flops`). Logged on CPU, where no peak is published for the
  host, and on an accelerator that `PEAKS` does not know (with a one-time note).

Peaks are per chip (one jax device on every kind listed), dense (NVIDIA's datasheets print the
2:4 structured-sparsity figure as well, twice the dense one; MFU uses the dense one):
  NVIDIA H100 SXM5 / H200: bf16 989.4, TF32 494.7, fp32 (no tensor cores) 66.9 TFLOP/s
    (NVIDIA H100 Tensor Core GPU Architecture whitepaper, H100 SXM5 table; the H200 is the same
    GH100 compute with HBM3e: NVIDIA H200 datasheet).
  NVIDIA A100 (SXM4 and PCIe, 40 and 80 GB): bf16 312, TF32 156, fp32 19.5 TFLOP/s
    (NVIDIA A100 Tensor Core GPU datasheet).
  TPU v4 275, v5e 197, v5p 459, v6e (Trillium) 918 bf16 TFLOP/s per chip (Cloud TPU system
    architecture pages: cloud.google.com/tpu/docs/v4, v5e, v5p-training, v6e).

float32 models: jax's default matmul precision computes float32 dots as TF32 on NVIDIA tensor
cores and as one bfloat16 MXU pass on TPU (jax docs, "Matmul precision"), so a float32 model is
measured against the TF32 peak on GPU and the bf16 peak on TPU. Under a higher
`jax_default_matmul_precision` ('float32' / 'highest', 'tensorfloat32' / 'high') the GPU peak is
the fp32 CUDA-core figure or TF32; TPU publishes no multi-pass figure, so MFU is not logged there
(mfu_vs_matmul instead, with a note).
"""
from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
from sharenet.models import accounting, loops

TFLOPS = 1e12
# device_kind substring (lower case) -> {'bf16', 'tf32', 'fp32'} dense TFLOP/s per chip.
# Order matters: the first substring found in the device kind wins ('v5 lite' before 'v5').
PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    # (match, name, peaks)
    ('h100 80gb hbm3', 'NVIDIA H100 SXM', {'bf16': 989.4, 'tf32': 494.7, 'fp32': 66.9}),
    ('h100 sxm', 'NVIDIA H100 SXM', {'bf16': 989.4, 'tf32': 494.7, 'fp32': 66.9}),
    ('h200', 'NVIDIA H200', {'bf16': 989.4, 'tf32': 494.7, 'fp32': 66.9}),
    ('a100', 'NVIDIA A100', {'bf16': 312.0, 'tf32': 156.0, 'fp32': 19.5}),
    ('tpu v4', 'TPU v4', {'bf16': 275.0}),
    ('tpu v5 lite', 'TPU v5e', {'bf16': 197.0}),
    ('tpu v5e', 'TPU v5e', {'bf16': 197.0}),
    ('tpu v5p', 'TPU v5p', {'bf16': 459.0}),
    ('tpu v5', 'TPU v5p', {'bf16': 459.0}),
    ('tpu v6 lite', 'TPU v6e', {'bf16': 918.0}),
    ('tpu v6e', 'TPU v6e', {'bf16': 918.0}),
)


def flops_per_token_at_depth(cfg, seq_len: int, loops_run: int, train: bool = False) -> float:
  """Model FLOPs per token of `cfg` run at `loops_run` loops of its looped segment (test-time
  depth, models/loops.py Schedule): prelude + loops_run * K + coda applied layers, each costing
  what `models.accounting.flops_per_token` counts per applied layer (matmuls and causal
  attention), plus the readout. Forward only unless `train` (x3). At the trained depth it is
  accounting's figure."""
  shape = loops.looped(cfg)
  per_layer = (2 * accounting.matmul_params_per_layer(cfg) +
               2 * seq_len * cfg.num_heads * cfg.d_head)
  per_layer -= 2 * accounting.kv_params_skipped(cfg)   # kv_sharing: every loop past the first
  fwd = accounting.flops_per_token(cfg, seq_len, train=False)
  fwd += (loops_run - shape.loops) * shape.num_sets * per_layer
  return 3 * fwd if train else fwd


def known_device(device_kind: str) -> tuple[str, dict[str, float]] | None:
  """(name, dense TFLOP/s per chip by arithmetic) of a device kind in PEAKS, else None."""
  kind = device_kind.lower()
  for match, name, peaks in PEAKS:
    if match in kind:
      return name, peaks
  return None


def matmul_arithmetic(device_kind: str, dtype: str, precision: str | None = None) -> str:
  """The arithmetic a `dtype` matmul runs in on this device: 'bf16' | 'tf32' | 'fp32'.

  bfloat16 operands: 'bf16'. float32 operands follow `precision`
  (jax_default_matmul_precision; None = jax's default): TPU's default is one bf16 pass, NVIDIA's
  TF32 (jax docs, "Matmul precision"); 'tensorfloat32' / 'high' -> TF32; 'float32' / 'highest'
  -> fp32.
  """
  if jnp.dtype(dtype) == jnp.bfloat16:
    return 'bf16'
  p = (precision or 'default').lower()
  if p in ('float32', 'highest', 'f32_f32_f32'):
    return 'fp32'
  if p in ('tensorfloat32', 'high', 'tf32_tf32_f32'):
    return 'tf32'
  if p in ('bfloat16', 'fastest', 'bf16_bf16_f32'):
    return 'bf16'
  return 'bf16' if 'tpu' in device_kind.lower() else 'tf32'


def peak_flops(device_kind: str, dtype: str, precision: str | None = None) -> float | None:
  """Dense peak FLOP/s of one chip of `device_kind` for `dtype` matmuls, or None if unknown."""
  known = known_device(device_kind)
  if known is None:
    return None
  tflops = known[1].get(matmul_arithmetic(device_kind, dtype, precision))
  return None if tflops is None else tflops * TFLOPS


class Reference(NamedTuple):
  """What model FLOP/s are divided by: the metric `name`, the FLOP/s, and a note (or None)."""
  name: str      # 'mfu' (hardware peak) | 'mfu_vs_matmul' (measured jnp.dot)
  flops: float   # FLOP/s of all devices ('mfu') or of the measured matmul ('mfu_vs_matmul')
  note: str | None


def mfu_reference(dtype: str = 'float32') -> Reference:
  """The MFU denominator for a model computing in `dtype` on this process's devices."""
  device = jax.devices()[0]
  kind = device.device_kind
  precision = jax.config.jax_default_matmul_precision
  peak = peak_flops(kind, dtype, precision)
  if peak is not None:
    return Reference('mfu', peak * jax.device_count(), None)
  matmul = matmul_peak_flops(dtype=dtype)
  if device.platform == 'cpu':
    return Reference('mfu_vs_matmul', matmul, None)
  why = ('no published peak for this device' if known_device(kind) is None else
         f'no published peak for {matmul_arithmetic(kind, dtype, precision)} matmuls')
  return Reference('mfu_vs_matmul', matmul,
                   f'{kind!r}: {why}; logging mfu_vs_matmul (model FLOP/s over a measured '
                   f'{dtype} jnp.dot) instead of mfu')


# device_kind substring (lower case) -> HBM bandwidth in bytes/s per chip, for memory-bound
# kernels (benchmarks/accelerator.py reports the fused norms as a fraction of it). First match
# wins. NVIDIA H200 datasheet (4.8 TB/s), H100 SXM5 whitepaper table (3.35 TB/s), A100
# datasheet (40 GB: 1,555 GB/s; 80 GB SXM4: 2,039 GB/s; 80 GB PCIe: 1,935 GB/s); Cloud TPU
# system architecture pages (v4 1,200 GB/s, v5e 819 GB/s, v5p 2,765 GB/s, v6e 1,640 GB/s).
HBM_BYTES_PER_S: tuple[tuple[str, float], ...] = (
    ('h200', 4.8e12), ('h100 80gb hbm3', 3.35e12), ('h100 sxm', 3.35e12),
    ('a100-sxm4-80gb', 2.039e12), ('a100 80gb pcie', 1.935e12), ('a100', 1.555e12),
    ('tpu v4', 1.2e12), ('tpu v5 lite', 0.819e12), ('tpu v5e', 0.819e12),
    ('tpu v5p', 2.765e12), ('tpu v5', 2.765e12), ('tpu v6 lite', 1.64e12),
    ('tpu v6e', 1.64e12),
)


def hbm_bandwidth(device_kind: str) -> float | None:
  """Peak HBM bytes/s of one chip of `device_kind`, or None where none is published (CPU)."""
  kind = device_kind.lower()
  return next((bw for match, bw in HBM_BYTES_PER_S if match in kind), None)


# device_kind substring (lower case) -> HBM capacity in bytes per chip (what a dry run's
# per-device memory must fit). First match wins. NVIDIA H200 datasheet (141 GB), H100 SXM5
# whitepaper table (80 GB), A100 datasheet (40 / 80 GB); Cloud TPU system architecture pages
# (v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB).
HBM_CAPACITY_BYTES: tuple[tuple[str, float], ...] = (
    ('h200', 141e9), ('h100 80gb hbm3', 80e9), ('h100 sxm', 80e9), ('a100-sxm4-80gb', 80e9),
    ('a100 80gb pcie', 80e9), ('a100', 40e9), ('tpu v4', 32 * 2**30),
    ('tpu v5 lite', 16 * 2**30), ('tpu v5e', 16 * 2**30), ('tpu v5p', 95 * 2**30),
    ('tpu v5', 95 * 2**30), ('tpu v6 lite', 32 * 2**30), ('tpu v6e', 32 * 2**30),
)


def hbm_capacity(device_kind: str) -> float | None:
  """HBM bytes of one chip of `device_kind`, or None where not listed (CPU)."""
  kind = device_kind.lower()
  return next((b for match, b in HBM_CAPACITY_BYTES if match in kind), None)


@functools.lru_cache(maxsize=None)
def matmul_peak_flops(n: int | None = None, dtype: str = 'float32', repeats: int = 5) -> float:
  """Best-of-`repeats` FLOP/s of an (n, n) @ (n, n) jitted matmul on the default device.

  Measured once per process and arguments (the device does not change under a process).
  n defaults to 1024 on CPU (BLAS is at its peak there; 2048 costs 8x the time at every run's
  start) and 2048 on accelerators (a smaller matmul is launch-bound).
  """
  if n is None:
    n = 1024 if jax.devices()[0].platform == 'cpu' else 2048
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  f = jax.jit(jnp.dot)
  f(a, b).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best
