"""Mesh, logical-axis rules, shardings of the train state, multi-host start-up, dry-run report.

Modules name every parameter and activation axis (`embed`, `heads`, `activation_batch`, ...);
`config.mesh.rules` maps those names to the mesh axes `data`, `fsdp`, `tensor`, `expert` (first
matching rule wins, a mesh axis is used once per array). The scan axes `layers` / `repeats` of
stacked and shared sets are never sharded: each device holds its slice of every unique set. The
`experts` axis of model.moe's expert stacks maps to `expert` (expert parallelism); an expert axis
that does not divide model.moe.num_experts is a ConfigError (`validate`).
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from sharenet.errors import ConfigError
from sharenet.train import batch_ramp

MESH_AXES = ('data', 'fsdp', 'tensor', 'expert')
DISTRIBUTED_ENV = 'SHARENET_DISTRIBUTED'

Rules = Sequence[tuple[str, Any]]


def maybe_initialize_distributed(distributed: bool) -> bool:
  """Calls jax.distributed.initialize() if `distributed` (config.mesh.distributed) or
  $SHARENET_DISTRIBUTED=1.

  Coordinator, process count and id come from $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES,
  $JAX_PROCESS_ID when set, else from jax's cluster auto-detection (TPU pods, SLURM, ...).
  Must run before anything touches a device.
  """
  want = bool(distributed) or os.environ.get(DISTRIBUTED_ENV) == '1'
  if not want or jax.distributed.is_initialized():
    return False
  env_int = lambda k: int(os.environ[k]) if os.environ.get(k) else None
  jax.distributed.initialize(num_processes=env_int('JAX_NUM_PROCESSES'),
                             process_id=env_int('JAX_PROCESS_ID'))
  return True


def mesh_shape(mesh_cfg: Any, num_devices: int) -> tuple[int, ...]:
  """(data, fsdp, tensor, expert) sizes; one of them may be -1 to take the remaining devices
  (a config written before mesh.expert existed has expert 1)."""
  sizes = [int(mesh_cfg[a]) if a in mesh_cfg else 1 for a in MESH_AXES]
  desc = ', '.join(f'mesh.{a}={s}' for a, s in zip(MESH_AXES, sizes))
  if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
    raise ConfigError(f'{desc}: each must be >= 1, with at most one -1 (the remaining devices)')
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ConfigError(f'{desc}: the fixed axes ({known}) do not divide the {num_devices} '
                        f'devices; valid: sizes whose product divides {num_devices}')
    sizes[sizes.index(-1)] = num_devices // known
  elif known != num_devices:
    raise ConfigError(f'{desc}: product {known} != {num_devices} devices; valid: sizes whose '
                      f'product is {num_devices}, or -1 on one axis')
  return tuple(sizes)


def rules_of(mesh_cfg: Any) -> tuple[tuple[str, Any], ...]:
  """config.mesh.rules as a tuple of (logical name, None | mesh axis | tuple of mesh axes)."""
  out = []
  for rule in mesh_cfg.rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ConfigError(f'mesh.rules entry {rule!r} must be (logical_name, mesh_axes)')
    name, axes = rule
    axes = tuple(axes) if isinstance(axes, (list, tuple)) else axes
    for a in (axes if isinstance(axes, tuple) else (axes,)):
      if a is not None and a not in MESH_AXES:
        raise ConfigError(f'mesh.rules entry {rule!r} names mesh axis {a!r}; valid: '
                          f'{", ".join(MESH_AXES)} or None')
    out.append((name, axes))
  return tuple(out)


def make_mesh(mesh_cfg: Any) -> Mesh:
  """The (data, fsdp, tensor, expert) mesh over all devices (all processes).

  jax.make_mesh orders devices for the physical topology. With several processes each must
  hold one contiguous block of batch rows (the data pipeline reads such a block); if that
  order breaks this, devices are ordered by process instead, with a note.
  """
  shape = mesh_shape(mesh_cfg, jax.device_count())
  types = (AxisType.Auto,) * len(MESH_AXES)
  mesh = jax.make_mesh(shape, MESH_AXES, axis_types=types)
  if jax.process_count() > 1 and not rows_per_process_contiguous(mesh, rules_of(mesh_cfg)):
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=types)
    if jax.process_index() == 0:
      print('sharenet: note: devices ordered by process so that each host reads one '
            'contiguous block of batch rows', flush=True)
  return mesh


def rows_per_process_contiguous(mesh: Mesh, rules: Rules,
                                process_of=lambda d: d.process_index) -> bool:
  """Whether every process's devices hold one contiguous block of rows of the batch."""
  spec = nn.logical_to_mesh_axes(('activation_batch',), rules)
  n = axis_size(mesh, spec[0])
  rows: dict[int, set[int]] = {}
  for device, idx in NamedSharding(mesh, spec).devices_indices_map((n,)).items():
    rows.setdefault(process_of(device), set()).update(range(*idx[0].indices(n)))
  return all(max(r) - min(r) + 1 == len(r) for r in rows.values())


def axis_size(mesh: Mesh, axes: Any) -> int:
  if axes is None:
    return 1
  return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def validate(run: Any, num_devices: int) -> None:
  """Mesh sizes, rules and batch divisibility of `run` (train/experiment.py's resolved
  sections: mesh, model, train) over `num_devices`, before anything is compiled."""
  shape = dict(zip(MESH_AXES, mesh_shape(run.mesh, num_devices)))
  rules = rules_of(run.mesh)
  batch_axes = nn.logical_to_mesh_axes(('activation_batch',), rules)[0]
  n = math.prod(shape[a] for a in (batch_axes if isinstance(batch_axes, tuple)
                                   else (batch_axes,)) if a is not None)
  moe = run.model.moe
  stacks = [   # every 'experts' stack: FFN, SwitchHead, LoRA experts
      (key, e) for key, e, on in (('num_experts', moe.num_experts, moe.kind != 'none'),
                                  ('attention_experts', moe.attention_experts,
                                   moe.attention != 'none'),
                                  ('lora_experts', moe.lora_experts, moe.lora_experts > 0)) if on]
  for key, e in stacks:
    if e % shape['expert']:
      raise ConfigError(f'mesh.expert={shape["expert"]} does not divide model.moe.{key}={e}; '
                        f'valid: mesh.expert among the divisors '
                        f'{[d for d in range(1, e + 1) if e % d == 0]}')
  t = run.train
  ramp = batch_ramp.parse(t.batch_ramp, t.batch_size, t.steps)
  for name, rows in (('train.batch_size / train.grad_accum', t.batch_size // t.grad_accum),
                     ('train.eval_batch_size', t.eval_batch_size),
                     *((f'train.batch_ramp batch {b} / train.grad_accum', b / t.grad_accum)
                       for b in (ramp.batches() if ramp else ()))):
    if rows % n:
      raise ConfigError(f'{name}={rows} is not divisible by the {n} batch shards (mesh axes '
                        f'{batch_axes}); valid: a multiple of {n}')


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules) -> Iterator[None]:
  """Mesh and logical rules for tracing: makes nn.with_logical_constraint take effect."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def _path_str(path: tuple) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))))
                  for k in path)


def param_specs(logical: Any, abstract_params: Any, mesh: Mesh, rules: Rules,
                notes: list[str] | None = None) -> Any:
  """Mesh PartitionSpec per parameter; a dim the mesh axes don't divide is replicated (noted)."""

  def one(path, names, x):
    spec = list(nn.logical_to_mesh_axes(tuple(names), rules))
    spec += [None] * (x.ndim - len(spec))
    for i, axes in enumerate(spec):
      size = axis_size(mesh, axes)
      if x.shape[i] % size:
        if notes is not None:
          notes.append(f'{_path_str(path)}: dim {i} ({names[i]}={x.shape[i]}) is not divisible '
                       f'by mesh {axes} ({size}); replicated on that dim')
        spec[i] = None
    return P(*spec)

  return jax.tree_util.tree_map_with_path(one, logical, abstract_params,
                                          is_leaf=lambda x: isinstance(x, P))


def state_shardings(abstract_state: Any, param_spec_tree: Any, mesh: Mesh) -> Any:
  """NamedShardings for TrainState(step, params, opt_state, tstate).

  Optimizer leaves that mirror a parameter (Adam moments, anything whose key path ends with a
  parameter's path and has its shape) take that parameter's sharding; the rest (counts,
  scalars) and the transforms' state (small power-iteration vectors) are replicated.
  """
  flat_params = jax.tree_util.tree_flatten_with_path(abstract_state.params)[0]
  flat_specs = jax.tree.leaves(param_spec_tree, is_leaf=lambda x: isinstance(x, P))
  by_path = {tuple(path): (x.shape, spec) for (path, x), spec in zip(flat_params, flat_specs)}
  depths = sorted({len(p) for p in by_path}, reverse=True)

  def opt_leaf(path, x):
    for d in depths:
      hit = by_path.get(tuple(path[-d:])) if len(path) >= d else None
      if hit is not None and hit[0] == getattr(x, 'shape', None):
        return NamedSharding(mesh, hit[1])
    return NamedSharding(mesh, P())

  params = jax.tree.map(lambda s: NamedSharding(mesh, s), param_spec_tree,
                        is_leaf=lambda x: isinstance(x, P))
  opt = jax.tree_util.tree_map_with_path(opt_leaf, abstract_state.opt_state)
  tstate = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract_state.tstate)
  return abstract_state.replace(step=NamedSharding(mesh, P()), params=params, opt_state=opt,
                                tstate=tstate)


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying shardings: the restore target under the current mesh."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings)


def replicated_like(tree: Any) -> Any:
  """A fully replicated sharding over all devices for every leaf of `tree`."""
  rep = NamedSharding(jax.make_mesh((jax.device_count(),), ('data',),
                                    axis_types=(AxisType.Auto,)), P())
  return jax.tree.map(lambda _: rep, tree)


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
  return NamedSharding(mesh, nn.logical_to_mesh_axes(('activation_batch', None), rules))


def process_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
  """(shard index, shard count) of the contiguous batch rows this process's devices hold."""
  slices = {(s[0].start or 0, global_shape[0] if s[0].stop is None else s[0].stop)
            for s in sharding.addressable_devices_indices_map(global_shape).values()}
  lo, hi = min(a for a, _ in slices), max(b for _, b in slices)
  rows = hi - lo
  if sum(b - a for a, b in slices) != rows or global_shape[0] % rows or lo % rows:
    raise ConfigError(f'the batch rows of process {jax.process_index()} are not one contiguous '
                      f'block ({sorted(slices)}); put the process-spanning mesh axes on '
                      f'mesh.data / mesh.fsdp')
  return lo // rows, global_shape[0] // rows


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
  return math.prod(shape) * np.dtype(dtype).itemsize


def report(abstract_state: Any, shardings: Any, logical: Any, compiled: Any,
           notes: Sequence[str] = ()) -> dict[str, float]:
  """Prints the per-parameter sharding table and the compiled step's memory; returns totals."""
  flat = jax.tree_util.tree_flatten_with_path(abstract_state.params)[0]
  specs = jax.tree.leaves(shardings.params)
  names = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P))
  rows = []
  total, per_device = 0, 0
  for (path, x), s, n in zip(flat, specs, names):
    local = _nbytes(s.shard_shape(x.shape), x.dtype)
    total += _nbytes(x.shape, x.dtype)
    per_device += local
    rows.append((_path_str(path), str(tuple(x.shape)), str(tuple(n)), str(s.spec), str(local)))
  state_dev = sum(_nbytes(s.shard_shape(x.shape), x.dtype) for x, s in
                  zip(jax.tree.leaves(abstract_state), jax.tree.leaves(shardings)))
  header = ('param', 'shape', 'logical axes', 'sharding', 'bytes/device')
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  fmt = lambda r: '  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
  mesh = specs[0].mesh
  lines = [f'dry run: mesh {dict(mesh.shape)} over {mesh.size} devices '
           f'({jax.process_count()} processes)', fmt(header)] + [fmt(r) for r in rows]
  lines += [f'note: {n}' for n in notes]
  lines.append(f'params: {total:,} bytes total, {per_device:,} bytes/device '
               f'({per_device / total:.4f} of the total)')
  lines.append(f'train state (params + optimizer): {state_dev:,} bytes/device')
  out = {'param_bytes_total': float(total), 'param_bytes_per_device': float(per_device),
         'state_bytes_per_device': float(state_dev)}
  mem = compiled.memory_analysis()
  if mem is not None:
    fields = ('argument_size_in_bytes', 'output_size_in_bytes', 'alias_size_in_bytes',
              'temp_size_in_bytes', 'generated_code_size_in_bytes')
    got = {f: int(getattr(mem, f)) for f in fields if hasattr(mem, f)}
    peak = (got.get('argument_size_in_bytes', 0) + got.get('output_size_in_bytes', 0)
            - got.get('alias_size_in_bytes', 0) + got.get('temp_size_in_bytes', 0))
    lines.append('compiled train step, per device: ' +
                 ', '.join(f'{k.replace("_size_in_bytes", "")} {v:,}' for k, v in got.items()) +
                 f'; estimated peak {peak:,} bytes')
    out['step_peak_bytes_per_device'] = float(peak)
  else:
    lines.append('compiled train step: this backend reports no memory analysis')
  if jax.process_index() == 0:
    print('\n'.join(lines), flush=True)
  return out
