"""Lowering for a platform this host lacks: the TPU or GPU program of a function, and what is in it.

`export(fn, args, platform)` traces `fn` with the kernels chosen for `platform`
(`sharenet.kernels.target`) and lowers it with `jax.export.export(jax.jit(fn),
platforms=[platform])`: from abstract shapes (jax.ShapeDtypeStruct), on any host, with no
compile. A kernel whose block shapes Mosaic or Triton reject fails here, as on the chip.
`kernel_calls` names the Pallas kernels in the module (Mosaic `tpu_custom_call` on TPU, Triton
calls on GPU); `f32_matmuls` lists its float32 x float32 dot_generals by op name.
tests/kernels/test_lowering.py and benchmarks/roofline.py use them (docs/scaling.md, "Lowering").
"""
from __future__ import annotations

import collections
import re
from typing import Any, Callable

import jax
from jax import export as jax_export

from sharenet import kernels
from sharenet.errors import ConfigError

PLATFORMS = ('tpu', 'cuda')
# The custom call each platform's Pallas kernels lower to.
CUSTOM_CALLS = {'tpu': 'tpu_custom_call', 'cuda': '__gpu$xla.gpu.triton'}
# The attribute naming the kernel inside that call's backend config.
_NAME = {'tpu': re.compile(r'kernel_name = "([^"]*)"'),
         'cuda': re.compile(r'(?<![\w])name = "([^"]*)"')}
_DOT = re.compile(r'stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> '
                  r'(tensor<[^>]*>) loc\((#loc\d+)\)')
_F32 = re.compile(r'[<x]f32>$')
_LOC = re.compile(r'^(#loc\d+) = loc\((.*)\)$', re.M)


def export(fn: Callable, args: tuple, platform: str, **jit_kwargs: Any) -> jax_export.Exported:
  """`fn(*args)` jitted (`jit_kwargs`: shardings, static arguments) and exported for
  `platform` (tpu | cuda), kernels chosen for it. Triton calls carry no serialization
  guarantee (jax.export docs, "Compatibility guarantees for custom calls"); the module is for
  inspection, so that check is off for them."""
  if platform not in PLATFORMS:
    raise ConfigError(f'lowering platform {platform!r} is unknown; valid: {", ".join(PLATFORMS)}')
  unsafe = [jax_export.DisabledSafetyCheck.custom_call(CUSTOM_CALLS['cuda'])]
  with kernels.target(platform):
    return jax_export.export(jax.jit(fn, **jit_kwargs), platforms=[platform],
                             disabled_checks=unsafe)(*args)


def module_text(exported: jax_export.Exported | str) -> str:
  return exported if isinstance(exported, str) else exported.mlir_module()


def kernel_calls(exported: jax_export.Exported | str, platform: str) -> collections.Counter:
  """{kernel name: custom calls} of `platform`'s Pallas kernels in the module."""
  target = f'stablehlo.custom_call @{CUSTOM_CALLS[platform]}('
  names = collections.Counter()
  for line in module_text(exported).splitlines():
    if target in line:
      found = _NAME[platform].search(line)
      names[found.group(1) if found else '?'] += 1
  return names


def _op_names(text: str) -> dict[str, str]:
  """#locN -> the name stack of its op ('jit(f)/.../dot_general'; '' where none)."""
  raw = dict(_LOC.findall(text))
  names: dict[str, str] = {}

  def name(ref: str, depth: int = 0) -> str:
    if ref not in names:
      body = raw.get(ref, '')
      quoted = re.match(r'"([^"]*)"', body)
      inner = re.match(r'callsite\((#loc\d+) at', body)
      names[ref] = (quoted.group(1) if quoted else
                    name(inner.group(1), depth + 1) if inner and depth < 50 else '')
    return names[ref]

  return {ref: name(ref) for ref in raw}


def f32_matmuls(exported: jax_export.Exported | str) -> list[tuple[str, str]]:
  """(op name, 'lhs x rhs -> out' types) of every dot_general with two float32 operands."""
  text = module_text(exported)
  names = _op_names(text)
  out = []
  for lhs, rhs, res, loc in _DOT.findall(text):
    if _F32.search(lhs) and _F32.search(rhs):
      out.append((names.get(loc, ''), f'{lhs} x {rhs} -> {res}'))
  return out
