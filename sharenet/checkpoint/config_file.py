"""A workdir's config.json: its one writer, which replaces the file whole or not at all."""
from __future__ import annotations

import json
import os
from typing import Any

NAME = 'config.json'


def path(workdir: str) -> str:
  """The path of `workdir`'s config.json."""
  return os.path.join(workdir, NAME)


def write(workdir: str, summary: dict[str, Any]) -> str:
  """Writes `summary` as `workdir`'s config.json atomically; returns the file's path.

  Serialized first, written to a temporary file in the same directory, synced, then renamed
  over config.json: a reader (a resume, eval.py) sees the old file or the new one, never a
  partial one. On any failure the old file stays and the temporary file is removed.
  """
  text = json.dumps(summary, indent=2, sort_keys=True, default=str)
  target = path(workdir)
  # Same directory, so the rename stays on one filesystem (atomic); the pid keeps two
  # processes writing the same workdir off each other's temporary file.
  tmp = f'{target}.{os.getpid()}.tmp'
  try:
    with open(tmp, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, target)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return target
