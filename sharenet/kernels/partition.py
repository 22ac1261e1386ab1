"""Pallas kernels under a device mesh: each device runs the kernel on its own shard.

XLA cannot partition a Pallas call: Mosaic refuses to lower one in a program over several
devices ("Mosaic kernels cannot be automatically partitioned. Please wrap the call in a
shard_map"), and XLA would run a Triton call on gathered, replicated operands. So under a mesh
of more than one device (sharenet.train.sharding.activate: jax.set_mesh and the logical rules) a
kernel runs inside jax.shard_map: its independent dimensions (batch rows, attention heads) split
over the mesh axes the logical rules give them, every other dimension whole on each device
(a norm reduces over D, attention over T). A dimension those axes do not divide stays whole.
Cotangents of inputs that are whole on every device (a norm's gain) are summed over the mesh
by shard_map's transpose. Without a mesh, or on one device, the kernel is called as it is.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P


def active() -> bool:
  """Whether a mesh of more than one device is set for tracing."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size > 1


def mesh_axes(logical: str | None, sizes: Sequence[int]) -> Any:
  """The mesh axes the active logical rules give `logical`, or None unless they divide every
  one of `sizes` (dimensions that must split alike, e.g. query and kv heads)."""
  if logical is None or not active():
    return None
  axes = nn.logical_to_mesh_axes((logical,))[0]
  if axes is None:
    return None
  shape = jax.sharding.get_abstract_mesh().shape
  n = math.prod(shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
  return axes if all(s % n == 0 for s in sizes) else None


def spec(logical: Sequence[str | None], shape: Sequence[int]) -> P:
  """PartitionSpec of an array of `shape` whose dimensions have the `logical` names."""
  return P(*(mesh_axes(name, (size,)) for name, size in zip(logical, shape)))


def per_shard(fn: Callable, in_specs: tuple, out_specs: Any) -> Callable:
  """`fn` run on each device's shard (jax.shard_map over the active mesh) under a mesh of more
  than one device; `fn` itself otherwise. Specs as jax.shard_map's."""
  if not active():
    return fn
  # check_vma off: pallas_call has no varying-manual-axes rule; the specs above are exact.
  return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)
