"""Orbax checkpoints of the train state and the grain iterator, with a fall-back on corruption."""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import orbax.checkpoint as ocp

from sharenet import data


def manager(workdir: str, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                         enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), 'checkpoints'),
                               options=options)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_iter: Any) -> None:
  args = {'state': ocp.args.StandardSave(state)}
  if data_iter is not None:
    args['data'] = data.checkpoint_save_args(data_iter)
  mngr.save(step, args=ocp.args.Composite(**args), force=True)


def _quarantine(mngr: ocp.CheckpointManager, step: int) -> str:
  """Moves a bad checkpoint aside (never deleted: no lost work) and forgets it."""
  src = os.path.join(str(mngr.directory), str(step))
  dst_root = os.path.join(os.path.dirname(str(mngr.directory)), 'corrupt_checkpoints')
  os.makedirs(dst_root, exist_ok=True)
  dst = os.path.join(dst_root, str(step))
  if os.path.exists(dst):
    shutil.rmtree(dst)
  shutil.move(src, dst)
  mngr.reload()
  return dst


def restore_latest(mngr: ocp.CheckpointManager, abstract_state: Any, data_iter: Any = None,
                   validate=None) -> tuple[Any, int] | None:
  """Restores the newest readable checkpoint; a corrupt one is moved aside with a warning.

  `validate(state)` may raise to reject a restored state (for example non-finite values).
  """
  for step in sorted(mngr.all_steps(), reverse=True):
    args = {'state': ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      args['data'] = data.checkpoint_restore_args(data_iter)
    try:
      restored = mngr.restore(step, args=ocp.args.Composite(**args))
      if validate is not None:
        validate(restored['state'])
      return restored['state'], step
    except Exception as e:  # noqa: BLE001 - any read failure means this checkpoint is unusable
      moved = _quarantine(mngr, step)
      first_line = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
      logging.warning('checkpoint %d is unreadable (%s); moved to %s, trying an older one',
                      step, first_line, moved)
      print(f'WARNING: checkpoint {step} is unreadable ({type(e).__name__}); moved to {moved}; '
            f'restoring the previous one', flush=True)
  return None
