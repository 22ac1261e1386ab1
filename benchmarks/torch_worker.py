"""Drives benchmarks/torch_reference.py --worker (PyTorch in its own interpreter) over stdin /
stdout, for peer_compare.py and step_profile.py. Imports neither torch nor jax."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'torch_reference.py')


class TorchWorker:
  """benchmarks/torch_reference.py --worker, driven over stdin / stdout."""

  def __init__(self, python: str, d_model: int, layers: int, seq_len: int, batch: int,
               threads: int):
    args = [python, REFERENCE, '--worker', f'--d_model={d_model}', f'--layers={layers}',
            f'--heads={max(1, d_model // 64)}', f'--mlp_dim={3 * d_model}',
            f'--seq_len={seq_len}', f'--batch={batch}', f'--threads={threads}']
    self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.header = self._read()

  def _read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f'the PyTorch reference exited (code {self.proc.wait()}); run '
                         f'{REFERENCE} by hand to see why')
    return json.loads(line)

  def ask(self, command: str) -> dict:
    self.proc.stdin.write(command + '\n')
    self.proc.stdin.flush()
    return self._read()

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.stdin.write('quit\n')
      self.proc.stdin.flush()
      self.proc.wait(timeout=60)


def torch_python(option: str) -> str | None:
  """The interpreter to run the reference with, or None if it cannot import torch."""
  python = option or sys.executable
  ok = subprocess.run([python, '-c', 'import torch'], capture_output=True).returncode == 0
  if not ok and option:
    raise SystemExit(f'error: config.torch_python={option!r} cannot import torch; valid: an '
                     f'interpreter with torch installed (e.g. a separate virtual environment)')
  return python if ok else None
