"""Pallas kernels for the hot paths, each beside a pure-jnp reference with the same signature.

One switch picks the implementation: `model.kernels = auto | xla | pallas`.

  auto    Pallas on GPU / TPU where the shapes allow, the XLA reference otherwise (no Pallas on
          a CPU).
  xla     always the reference.
  pallas  always the kernel; on a CPU it runs in Pallas interpret mode (slow: for tests).

A shape a kernel cannot take falls back to the reference with a one-line note on stderr (once per
kernel and reason), under `auto` and `pallas` alike: never silently.

`model.attention = auto | xla | chunked | cudnn | pallas` picks the attention back-end on its own;
`auto` follows `model.kernels` on GPU / TPU and is the chunked XLA attention on a CPU.
`model.dense_grad = auto | xla | rows` picks how dense layers form weight gradients (rows on a
CPU). See docs/scaling.md and docs/performance.md "CPU speed against PyTorch eager".

Every choice above follows `backend()`: the host's default backend, or the platform set by
`target(platform)` around tracing, so that a CPU machine can lower the TPU or GPU program
(`jax.export.export(..., platforms=[...])`, sharenet/kernels/lowering.py).
"""
from __future__ import annotations

import sys

import jax

from sharenet.errors import ConfigError

KERNELS = ('auto', 'xla', 'pallas')
DENSE_GRADS = ('auto', 'xla', 'rows')
ATTENTIONS = ('auto', 'xla', 'chunked', 'cudnn', 'pallas')
ACCELERATORS = ('gpu', 'tpu')
# target() names -> backend() names (jax.export calls NVIDIA and AMD GPUs cuda and rocm).
TARGETS = {'cpu': 'cpu', 'gpu': 'gpu', 'cuda': 'gpu', 'rocm': 'gpu', 'tpu': 'tpu'}

# A jit cache key: a function traced under one target is retraced under another.
_target = jax.make_user_context(None)

_noted: set[tuple[str, str]] = set()


def target(platform: str | None):
  """Context manager: choose kernels for `platform` (cpu | gpu | tpu, or jax.export's cuda |
  rocm) instead of the host's backend while tracing; None restores the host's."""
  if platform is not None and platform not in TARGETS:
    raise ConfigError(f'target platform {platform!r} is unknown; valid: {", ".join(TARGETS)}')
  return _target(None if platform is None else TARGETS[platform])


def backend() -> str:
  """The platform kernels are chosen for: cpu | gpu | tpu (`target`'s, else the host's)."""
  return _target.value or jax.default_backend()


def use_pallas(kernels: str) -> bool:
  """Whether `model.kernels` asks for the Pallas kernel on this backend (before shape checks)."""
  if kernels not in KERNELS:
    raise ConfigError(f'model.kernels={kernels!r} is unknown; valid: {", ".join(KERNELS)}')
  return kernels == 'pallas' or (kernels == 'auto' and backend() in ACCELERATORS)


def rows_weight_grad(dense_grad: str) -> bool:
  """Whether `model.dense_grad` asks for the flattened-rows weight gradient (layers.matmul_rows):
  `rows`, or `auto` on a CPU, where XLA:CPU otherwise transposes the cotangent in a slow fusion."""
  if dense_grad not in DENSE_GRADS:
    raise ConfigError(f'model.dense_grad={dense_grad!r} is unknown; valid: {", ".join(DENSE_GRADS)}')
  return dense_grad == 'rows' or (dense_grad == 'auto' and backend() == 'cpu')


def interpret() -> bool:
  """Pallas interpret mode: the only way a kernel runs on a CPU."""
  return backend() not in ACCELERATORS


def attention_backend(attention: str, kernels: str) -> str:
  """The attention implementation to use: xla | chunked | cudnn | pallas.

  auto: Pallas where model.kernels selects it (GPU / TPU), the chunked XLA attention on a CPU
  (kernels/attention.py; the same function, faster on XLA:CPU), plain XLA otherwise."""
  if attention not in ATTENTIONS:
    raise ConfigError(f'model.attention={attention!r} is unknown; valid: {", ".join(ATTENTIONS)}')
  if attention == 'auto':
    if use_pallas(kernels):
      return 'pallas'
    return 'chunked' if backend() == 'cpu' else 'xla'
  if attention == 'cudnn' and backend() != 'gpu':
    raise ConfigError(f'model.attention=cudnn needs an NVIDIA GPU (this backend is {backend()}); '
                      f'valid here: auto, xla, chunked, pallas')
  return attention


def note_fallback(kernel: str, reason: str) -> None:
  """One line on stderr, once per (kernel, reason): the reference runs instead of the kernel."""
  if (kernel, reason) not in _noted:
    _noted.add((kernel, reason))
    print(f'sharenet: {kernel} kernel cannot take {reason}; using the XLA reference',
          file=sys.stderr, flush=True)
