"""One tensor between the Hugging Face layout and sharenet's (hf_arch.Entry kinds).

A torch nn.Linear weight is (out, in) and computes x W^T; a sharenet Dense kernel is
(in..., out...) and computes x W, with heads as their own axes (q: (D, H, Dh), o: (H, Dh, D)).
GPT-2's Conv1D weight is already (in, out). Both directions are reshapes and transposes, exact.
"""
from __future__ import annotations

import math

import numpy as np

from sharenet.interop.hf_arch import Entry


def hf_shape(e: Entry, sn_shape: tuple[int, ...]) -> tuple[int, ...]:
  """The Hugging Face tensor's shape (the whole tensor, all parts) for sharenet shape
  `sn_shape` (one layer's)."""
  n = e.part[1] if e.part else 1
  if e.kind in ('linear', 'conv1d'):
    fan_in, fan_out = math.prod(sn_shape[:e.n_in]), math.prod(sn_shape[e.n_in:])
    return (fan_out, fan_in) if e.kind == 'linear' else (fan_in, fan_out * n)
  if e.kind == 'vector':
    return (math.prod(sn_shape) * n,)
  return tuple(sn_shape)


def to_sharenet(e: Entry, w: np.ndarray, sn_shape: tuple[int, ...]) -> np.ndarray:
  """The Hugging Face tensor `w` as the sharenet parameter of shape `sn_shape` (one layer's)."""
  if e.kind == 'linear':
    w = w.T
  if e.part is not None:
    j, n = e.part
    size = w.shape[-1] // n
    w = w[..., j * size:(j + 1) * size]
  w = w.reshape(sn_shape)
  return w + np.asarray(e.offset, w.dtype) if e.offset else w


def to_hf(e: Entry, parts: list[np.ndarray]) -> np.ndarray:
  """The Hugging Face tensor from its sharenet parameters (one per part, in order)."""
  out = []
  for a in parts:
    a = a - np.asarray(e.offset, a.dtype) if e.offset else a
    if e.kind in ('linear', 'conv1d'):
      a = a.reshape(math.prod(a.shape[:e.n_in]), -1)
    elif e.kind == 'vector':
      a = a.reshape(-1)
    out.append(a)
  w = out[0] if len(out) == 1 else np.concatenate(out, axis=-1)
  return np.ascontiguousarray(w.T) if e.kind == 'linear' else w
