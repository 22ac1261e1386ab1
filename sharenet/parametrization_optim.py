"""The parametrizations' rules under train.optimizer = muon | shampoo (docs/optimizers.md).

`parametrization.kind=mup` means the muP of the optimizer that trains each leaf, so a study
switches optimizer with one key:

  muon     leaves on Muon (train.matrix_roles; hidden kernels only): spectral muP. Muon's step
           is an orthogonalised matrix (every singular value ~1), and the spectral condition
           for feature learning asks for a step of spectral norm ~ sqrt(fan_out / fan_in)
           (Bernstein & Newhouse, "Modular Duality in Deep Learning", arXiv:2410.21265; Pethick
           et al., "Training Deep Learning Models with Norm-Constrained LMOs" (Scion),
           arXiv:2502.07529, whose hidden-layer LMO over the RMS->RMS operator norm is that
           orthogonalised matrix x sqrt(fan_out / fan_in)). optax's scale_by_muon already
           multiplies by sqrt(max(1, fan_out / fan_in)), so the multiplier is
           sqrt(r / r0) * sqrt(max(1, r0) / max(1, r)) with r = fan_out / fan_in of the
           target and r0 of the base model: the total step is sqrt(fan_out / fan_in) x a
           width-independent constant, and 1 at base width (bit-identical to SP there). Init
           and forward multipliers are SP's (1/sqrt(fan_in) init already meets the spectral
           init condition when fan-in and fan-out grow together). Leaves on Adam keep Adam's
           muP (TP5 Table 8: embeddings, readout, norms, biases, LoRA factors).
  shampoo  our Shampoo grafts every block to Adam's update norm (sharenet/optim_shampoo.py), so
           each leaf's step has Adam's size and Adam's muP (Table 8) applies to all leaves
           unchanged: LR eta / m on the hidden kernels. That is our derivation from the
           grafting, not Ishikawa & Karakida's second-order muP ("On the Parameterization of
           Second-Order Optimization Effective Towards the Infinite Width",
           arXiv:2312.12226, Table 1: init, LR and damping exponents for ungrafted Shampoo /
           K-FAC), whose table we could not verify and do not implement (docs/optimizers.md).

parametrization.qk_lr (any kind, any optimizer) multiplies the LR of the query and key kernels
(their `use` in the role table; MASA atoms forming them too, not LoRA factors): a
parameter-dependent query/key LR as an alternative to QK-norm; 1 leaves every rule as it is.

Every other preset (mup_table3, umup, completep) is written for Adam: under muon or shampoo it
is one ConfigError line naming the valid kinds.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from sharenet.errors import ConfigError

# Presets with a rule for each optimizer (module docstring).
KINDS_FOR = {'adamw': None, 'muon': ('sp', 'mup'), 'shampoo': ('sp', 'mup')}
MUON_MUP_ROLES = ('reader', 'writer')
QK_USES = ('query', 'key')   # ParamInfo.use of the query and key kernels (models/projections.py)


def check(kind: str, optimizer: str, matrix_roles: tuple[str, ...]) -> None:
  """One ConfigError line for a preset written for another optimizer."""
  valid = KINDS_FOR.get(optimizer)
  if valid is not None and kind not in valid:
    raise ConfigError(f'parametrization.kind={kind} is written for train.optimizer=adamw; '
                      f'valid with train.optimizer={optimizer}: {", ".join(valid)}')
  extra = [r for r in matrix_roles if r not in MUON_MUP_ROLES]
  if optimizer == 'muon' and kind == 'mup' and extra:
    raise ConfigError(f'parametrization.kind=mup under train.optimizer=muon has a rule for '
                      f'hidden kernels on Muon only, not {extra}; valid train.matrix_roles: '
                      f'{", ".join(MUON_MUP_ROLES)}')


def muon_lr_mult(fan_in: int, fan_out: int, base_fan_in: int, base_fan_out: int) -> float:
  """Spectral muP's LR multiplier over optax's own shape factor (module docstring)."""
  r, r0 = fan_out / fan_in, base_fan_out / base_fan_in
  return math.sqrt(r / r0) * math.sqrt(max(1.0, r0) / max(1.0, r))


def adjust(rules: dict, target: dict, base: dict, kind: str, optimizer: str,
           matrix_roles: tuple[str, ...], qk_lr: float = 1.0) -> dict:
  """`rules` (Adam's, parametrization.LeafRule per path) for the optimizer of each leaf, with
  parametrization.qk_lr on the query and key kernels."""
  check(kind, optimizer, matrix_roles)
  out = dict(rules)
  for path, rule in rules.items():
    info, lr = target[path], rule.lr_mult
    if optimizer == 'muon' and kind == 'mup' and info.role in matrix_roles:
      b = base[path]
      lr = muon_lr_mult(info.fan_in, info.fan_out, b.fan_in, b.fan_out)
    # adamw; sp (all 1); shampoo's grafted muP is Adam's: the rule's LR as it is.
    if info.use in QK_USES and info.role == 'reader':
      lr *= qk_lr
    out[path] = rule if lr == rule.lr_mult else dataclasses.replace(rule, lr_mult=lr)
  return out


def settings_of(train: Any) -> tuple[str, tuple[str, ...]]:
  """(train.optimizer, train.matrix_roles) of a train config (adamw when it has none)."""
  if train is None:
    return 'adamw', ()
  from sharenet import optim_matrix
  name = optim_matrix.optimizer_name(train)
  return name, optim_matrix.matrix_roles(train) if name != 'adamw' else ()
