"""Orbax checkpoints of the train state and the grain iterator.

A resume tells corruption from a changed config: a checkpoint whose files are missing, truncated
or unreadable is moved to `corrupt_checkpoints/` (never deleted) and the previous one is tried;
a readable checkpoint whose state tree differs from the one asked for raises `StateMismatch`
and is left untouched, byte for byte.
"""
from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import shutil
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from sharenet import data


class StateMismatch(Exception):
  """A readable checkpoint whose state tree (paths, shapes, dtypes) differs from the target."""

  def __init__(self, step: int, detail: str):
    super().__init__(f'checkpoint {step}: {detail}')
    self.step, self.detail = step, detail


def manager(workdir: str, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                         enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), 'checkpoints'),
                               options=options)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_iter: Any,
         config: dict[str, Any] | None = None) -> None:
  """Saves the train state, the iterator position and (JSON) the config that wrote them."""
  args = {'state': ocp.args.StandardSave(state)}
  if data_iter is not None:
    args['data'] = data.checkpoint_save_args(data_iter)
  if config is not None:
    args['config'] = ocp.args.JsonSave(config)
  mngr.save(step, args=ocp.args.Composite(**args), force=True)



def _nest(path: tuple[Any, ...], leaf: Any) -> Any:
  for k in reversed(path):
    leaf = {k: leaf}
  return leaf


# Leaves at least this large are followed by a full garbage collection (~0.2 s each: cheap
# beside writing them, not beside writing a small leaf).
_COLLECT_BYTES = 16 << 20


def _release_freed_memory(nbytes: int) -> None:
  """Hands freed heap back to the OS: glibc otherwise keeps the per-leaf write buffers
  (tensorstore's zstd ones), and the process's RSS grows by about one leaf per leaf."""
  if nbytes >= _COLLECT_BYTES:
    gc.collect()
  try:
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):   # not glibc: nothing to trim
    pass


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def save_streamed(workdir: str, step: int, leaves: Iterable[tuple[tuple[Any, ...], Any]],
                  skeleton: dict[str, Any], config: dict[str, Any] | None = None) -> str:
  """Writes checkpoint `step` of `workdir` leaf by leaf; returns its directory.

  The checkpoint is the one `save(manager(workdir, ...), step, state, None, config)` writes
  for a state whose top-level fields are `skeleton` (e.g. {'step': ..., 'opt_state': None,
  'tstate': {}}: saved first, whole) plus the `leaves`: (path from the state's root, e.g.
  ('params', 'params', 'embed', 'embedding'), jax.Array or np.ndarray) pairs, consumed one at a
  time; every leaf's first key must be a field not in `skeleton`, and no path may repeat.
  restore_latest, restore_parts, restore_leaf, saved_signatures and saved_config read it as
  they read any other checkpoint (leaf sharding included), so the host holds one leaf (plus
  orbax's write buffers for it) instead of the whole state: `save` takes the whole tree.

  How: orbax's *experimental* v1 partial save (`orbax.checkpoint.experimental.v1.partial`,
  checked with orbax 0.12.8), the only orbax API that writes one pytree in pieces:
  `partial.save(stage, piece)` per leaf, then `partial.finalize(stage)` merges them into
  stage/state. The v0 JSON `config` item is then added, `_CHECKPOINT_METADATA`'s item
  handlers are set to the v0 handlers' names, v1's layout marker file is removed (v0 writes
  none), and the staged step directory is renamed to `checkpoints/<step>`: the commit. Any
  failure before it (a leaf that raises in the iterator included) leaves no step under
  checkpoints/; the staging directory (`workdir/.stream-<step>`) is removed either way. An
  orbax upgrade may change the experimental API:
  tests/checkpoint/test_orbax_io_streamed.py holds it.

  Multi-host: every process calls this with the same leaves (jax arrays whose addressable
  shards it holds) in the same order; orbax's partial save and finalize synchronise the
  processes themselves. Process 0 alone prepares the staging directory, writes the config
  item and metadata and renames the step, each followed by a barrier; a failure in process
  0's commit is broadcast so that every process raises. A failure on one process while the
  leaves are written leaves the others waiting in orbax's barriers, as any collective does.
  (Exercised on one process only: the tests run on one host.)
  """
  from orbax.checkpoint.experimental import v1 as ocp1
  workdir = os.path.abspath(workdir)
  root = os.path.join(workdir, 'checkpoints')
  final = os.path.join(root, str(step))
  if os.path.exists(final):
    raise FileExistsError(f'checkpoint {final} exists')
  stage_root = os.path.join(workdir, f'.stream-{step}')   # outside checkpoints/: never a step
  stage = os.path.join(stage_root, str(step))
  primary = jax.process_index() == 0
  if primary:
    shutil.rmtree(stage_root, ignore_errors=True)   # an earlier, interrupted save's
    os.makedirs(stage_root)
  _sync(f'sharenet_stream_stage_{step}')
  ctx = ocp1.Context()
  ctx.array.saving.use_zarr3 = False   # as v0's StandardSave writes (restores read either)
  fields = set(skeleton)
  seen: set[tuple[Any, ...]] = set()
  try:
    with ctx:
      ocp1.partial.save(stage, dict(skeleton))
      for path, value in leaves:
        path = tuple(path)
        if not path or path[0] in fields or path in seen:
          raise ValueError(f'save_streamed: leaf path {path} is empty, repeated or inside a '
                           f'skeleton field ({sorted(fields)})')
        seen.add(path)
        ocp1.partial.save(stage, _nest(path, value))
        nbytes = int(getattr(value, 'nbytes', 0))
        del value
        _release_freed_memory(nbytes)
      ocp1.partial.finalize(stage)   # merges the pieces into stage/state (all processes)
    error = None
    if primary:
      try:
        _commit_stage(stage, final, config)
      except Exception as e:  # noqa: BLE001 - re-raised below, on every process
        error = e
    if jax.process_count() > 1:
      failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
      if int(failed) and error is None:
        raise OSError(f'save_streamed: process 0 failed to commit checkpoint {final}')
    if error is not None:
      raise error
    _sync(f'sharenet_stream_done_{step}')   # no process returns before the step exists
  finally:
    if primary:
      shutil.rmtree(stage_root, ignore_errors=True)
  return final


def _commit_stage(stage: str, final: str, config: dict[str, Any] | None) -> None:
  """A finalized v1 partial save at `stage` made a v0 CheckpointManager step at `final`."""
  handlers = {'state': ocp.StandardCheckpointHandler.typestr()}
  if config is not None:
    (epath.Path(stage) / 'config').mkdir()
    ocp.JsonCheckpointHandler().save(epath.Path(stage) / 'config',
                                     args=ocp.args.JsonSave(config))
    handlers['config'] = ocp.JsonCheckpointHandler.typestr()
  meta_file = os.path.join(stage, '_CHECKPOINT_METADATA')   # v1 names its own handler
  with open(meta_file) as f:
    meta = json.load(f)
  meta['item_handlers'] = handlers
  with open(meta_file, 'w') as f:
    json.dump(meta, f)
  marker = os.path.join(stage, 'orbax.checkpoint')   # v1's layout marker; v0 writes none
  if os.path.exists(marker):
    os.remove(marker)
  os.makedirs(os.path.dirname(final), exist_ok=True)
  os.rename(stage, final)   # the commit: the step appears whole or not at all


def saved_config(mngr: ocp.CheckpointManager, step: int) -> dict[str, Any] | None:
  """The config saved with checkpoint `step`, or None (older checkpoints, unreadable)."""
  if not os.path.isdir(os.path.join(str(mngr.directory), str(step), 'config')):
    return None
  try:
    return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
  except Exception:  # noqa: BLE001 - the caller falls back to the workdir's config.json
    return None


def _state_dir(mngr: ocp.CheckpointManager, step: int) -> str:
  return os.path.join(str(mngr.directory), str(step), 'state')


def _key(entry: Any) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def leaf_signatures(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """{'/'-joined path: (shape, dtype)} of a state, an abstract state or saved metadata."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {'/'.join(_key(k) for k in path): (tuple(x.shape), str(x.dtype)) for path, x in flat}


def _saved_tree(mngr: ocp.CheckpointManager, step: int) -> Any:
  """The saved train state's metadata tree (raises if unreadable)."""
  meta = ocp.StandardCheckpointHandler().metadata(epath.Path(_state_dir(mngr, step)))
  return getattr(meta, 'tree', meta)


def saved_signatures(mngr: ocp.CheckpointManager, step: int) -> dict[str, tuple]:
  """The saved train state's leaf signatures, read from its metadata (raises if unreadable)."""
  sigs = leaf_signatures(_saved_tree(mngr, step))
  if not sigs:
    raise ValueError('the saved state has no arrays')
  return sigs


def first_difference(saved: dict[str, tuple], wanted: dict[str, tuple]) -> str | None:
  """A one-phrase description of the first leaf where two signature tables differ."""
  for path in sorted(set(saved) | set(wanted)):
    a, b = saved.get(path), wanted.get(path)
    if a == b:
      continue
    if a is None:
      return f'{path} is not in the checkpoint'
    if b is None:
      return f'{path} is in the checkpoint but not in this config\'s state'
    return f'{path} is {a[0]} {a[1]} in the checkpoint, {b[0]} {b[1]} here'
  return None


def _quarantine(mngr: ocp.CheckpointManager, step: int) -> str:
  """Moves a corrupt checkpoint aside (never deleted: no lost work) and forgets it."""
  src = os.path.join(str(mngr.directory), str(step))
  dst_root = os.path.join(os.path.dirname(str(mngr.directory)), 'corrupt_checkpoints')
  dst, n = os.path.join(dst_root, str(step)), 1
  while os.path.exists(dst):   # an earlier copy of this step stays too
    dst, n = os.path.join(dst_root, f'{step}.{n}'), n + 1
  if jax.process_index() == 0:   # one process moves; the others wait for it
    os.makedirs(dst_root, exist_ok=True)
    shutil.move(src, dst)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f'sharenet_quarantine_{step}')
  mngr.reload()
  return dst


def _files_readable(mngr: ocp.CheckpointManager, step: int) -> bool:
  """True if every array of the saved state reads back into host memory (no shardings, no
  target), i.e. the files are intact whatever made a restore fail."""
  try:
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                _saved_tree(mngr, step))
    ocp.PyTreeCheckpointer().restore(_state_dir(mngr, step), args=ocp.args.PyTreeRestore(
        restore_args=restore_args))
    return True
  except Exception:  # noqa: BLE001 - anything that stops a plain read: the files are bad
    return False


def _first_line(e: Exception) -> str:
  return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def _warn_corrupt(mngr: ocp.CheckpointManager, step: int, e: Exception) -> None:
  moved = _quarantine(mngr, step)
  logging.warning('checkpoint %d is unreadable (%s); moved to %s, trying an older one',
                  step, _first_line(e), moved)
  print(f'WARNING: checkpoint {step} is unreadable ({type(e).__name__}); moved to {moved}; '
        f'restoring the previous one', flush=True)


def restore_latest(mngr: ocp.CheckpointManager, abstract_state: Any, data_iter: Any = None,
                   validate: Callable[[Any], None] | None = None) -> tuple[Any, int] | None:
  """Restores the newest readable checkpoint (and `data_iter` in place); None if there is none.

  An unreadable checkpoint is moved aside with a warning and the previous one is tried.
  `validate(state)` may raise to reject a restored state (for example non-finite values), which
  counts as corruption. A readable checkpoint of another state tree raises `StateMismatch`.
  `abstract_state` may be a function of the step (a run whose state tree changes during
  training: dynamic tying, sharenet/train/dynamic_tying.py).
  """
  for step in sorted(mngr.all_steps(), reverse=True):
    target = abstract_state(step) if callable(abstract_state) else abstract_state
    wanted = leaf_signatures(target)
    try:
      saved = saved_signatures(mngr, step)
    except Exception as e:  # noqa: BLE001 - metadata that cannot be read means a corrupt step
      _warn_corrupt(mngr, step, e)
      continue
    diff = first_difference(saved, wanted)
    if diff is not None:
      raise StateMismatch(step, diff)
    args = {'state': ocp.args.StandardRestore(target)}
    if data_iter is not None:
      args['data'] = data.checkpoint_restore_args(data_iter)
    try:
      state = mngr.restore(step, args=ocp.args.Composite(**args))['state']
    except Exception as e:  # noqa: BLE001 - sorted below: corrupt files or not
      if data_iter is not None and _state_restores(mngr, step, target):
        # The arrays are fine: the saved iterator position belongs to another data pipeline.
        raise StateMismatch(step, f'its data iterator state does not fit this config\'s '
                            f'pipeline ({_first_line(e)})') from None
      if _files_readable(mngr, step):
        raise   # intact files (out of memory, a sharding problem, ...): never moved aside
      _warn_corrupt(mngr, step, e)
      continue
    try:
      if validate is not None:
        validate(state)
    except Exception as e:  # noqa: BLE001 - a rejected state (non-finite values) is bad data
      _warn_corrupt(mngr, step, e)
      continue
    return state, step
  return None


def _state_restores(mngr: ocp.CheckpointManager, step: int, abstract_state: Any) -> bool:
  try:
    mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
    return True
  except Exception:  # noqa: BLE001 - any failure: not restorable
    return False


def restore_parts(mngr: ocp.CheckpointManager, step: int, parts: dict[str, Any],
                  data_iter: Any = None) -> tuple[dict[str, Any], bool]:
  """(fields, data restored): only the named fields of a saved train state (`parts`: field ->
  abstract subtree carrying shardings), and `data_iter`'s position in place when given and it
  fits. Raises StateMismatch if a part's tree differs from the checkpoint's."""
  saved = saved_signatures(mngr, step)
  for name, tree in parts.items():
    want = {f'{name}/{k}' if k else name: v for k, v in leaf_signatures(tree).items()}
    have = {k: v for k, v in saved.items() if k == name or k.startswith(name + '/')}
    diff = first_difference(have, want)
    if diff is not None:
      raise StateMismatch(step, diff)
  restore_args = ocp.checkpoint_utils.construct_restore_args(parts)
  out = ocp.PyTreeCheckpointer().restore(
      _state_dir(mngr, step), args=ocp.args.PyTreeRestore(
          item=parts, restore_args=restore_args, partial_restore=True))
  data_ok = False
  if data_iter is not None:
    try:
      mngr.restore(step, args=ocp.args.Composite(data=data.checkpoint_restore_args(data_iter)))
      data_ok = True
    except Exception:  # noqa: BLE001 - another pipeline's position: the caller starts anew
      pass
  return out, data_ok


def restore_leaf(mngr: ocp.CheckpointManager, step: int, name: str, path: tuple[str, ...],
                 abstract: Any) -> np.ndarray:
  """One leaf of the saved state's field `name` (at `path` below it; `abstract` its
  ShapeDtypeStruct) as a host array: a partial restore that reads that leaf only."""
  tree = jax.ShapeDtypeStruct(abstract.shape, abstract.dtype,
                              sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  for k in reversed(path):
    tree = {k: tree}
  parts = {name: tree}
  out = ocp.PyTreeCheckpointer().restore(
      _state_dir(mngr, step), args=ocp.args.PyTreeRestore(
          item=parts, restore_args=ocp.checkpoint_utils.construct_restore_args(parts),
          partial_restore=True))
  node = out[name]
  for k in path:
    node = node[k]
  return np.asarray(node)


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def params_finite(params: Any) -> bool:
  """Whether every parameter is finite (one jitted reduction, one scalar read): checked before
  a checkpoint is written and after one is restored."""
  return bool(_all_finite(params))
