"""The parametrizations' rules under train.optimizer = muon | shampoo | kfac | scion
(docs/optimizers.md).

`parametrization.kind=mup` means the muP of the optimizer that trains each leaf, so a study
switches optimizer with one key:

  muon     leaves on Muon (train.matrix_roles; hidden kernels only): spectral muP. Muon's step
           is an orthogonalised matrix (every singular value ~1), and the spectral condition
           for feature learning asks for a step of spectral norm ~ sqrt(fan_out / fan_in)
           (Bernstein & Newhouse, "Modular Duality in Deep Learning", arXiv:2410.21265; Pethick
           et al., "Training Deep Learning Models with Norm-Constrained LMOs" (Scion),
           arXiv:2502.07529, whose hidden-layer LMO over the RMS->RMS operator norm is that
           orthogonalised matrix x sqrt(fan_out / fan_in)). The multiplier divides out the
           step scale train.muon.scale already applies (matrix.MUON_SCALES): `shape`,
           optax's sqrt(max(1, fan_out / fan_in)), or `rms`, Moonlight's
           0.2 sqrt(max(fan_in, fan_out)) (Liu et al., "Muon is Scalable for LLM Training",
           arXiv:2502.16982, section 2.2: the update RMS of AdamW, so AdamW's LR carries over
           at one width). It is sqrt(r / r0) * s(base) / s(target) with r = fan_out / fan_in
           and s the step scale, of the target and of the base model: the total step is
           sqrt(fan_out / fan_in) x a width-independent constant, and 1 at base width
           (bit-identical to SP there). Under `shape` a kernel whose fan-in and fan-out grow
           together keeps its LR; under `rms` its LR falls as 1/sqrt(width). Init
           and forward multipliers are SP's (1/sqrt(fan_in) init already meets the spectral
           init condition when fan-in and fan-out grow together). Leaves on Adam keep Adam's
           muP (TP5 Table 8: embeddings, readout, norms, biases, LoRA factors).
  shampoo  train.shampoo.graft=adam (the default) grafts every block to Adam's update norm
           (sharenet/optim/shampoo.py), so each leaf's step has Adam's size and Adam's muP
           (Table 8) applies to all leaves unchanged: LR eta / m on the hidden kernels (our
           derivation from the grafting).
           train.shampoo.graft=none is vanilla Shampoo, whose muP is Ishikawa & Karakida's
           second-order muP ("On the Parameterization of Second-Order Optimization Effective
           Towards the Infinite Width", arXiv:2312.12226, ICLR 2024), extended to blocking by
           Qiu et al. ("Hyperparameter Transfer Enables Consistent Gains of Matrix-Preconditioned
           Optimizers Across Scales", arXiv:2512.05620, Table 1 and section 3.1, which says it
           reproduces Ishikawa & Karakida). For (L + eps I)^-e_L G (R + eps I)^-e_R,
           e = e_L + e_R, on blocks of b_in x b_out (n_in x n_out of them), the muP LR is
           eta ~ (fan_out / fan_in)^(1 - e) (n_in n_out)^-e, and the damping must scale as the
           statistics' eigenvalue, eps ~ b_in b_out / fan_out^2 (= fan_in / fan_out unblocked).
           Shampoo's e_L = e_R = 1/4 (e = 1/2): each Shampoo leaf's LR and damping multipliers
           are those quantities at the target over the base model's (shampoo_mults), so a
           hidden kernel whose fan-in and fan-out grow together keeps its LR while it is one
           block, and its LR falls as 1/width once the blocks are fixed (train.shampoo.
           block_size below the width), as Adam's does. Init and forward multipliers are SP's
           (Qiu et al.: the init is optimizer-independent; the first author's code
           riverstone496/classmup, utils/set_mup.py, has init exponents b = (1/2, 1/2, 1) and
           Shampoo's LR exponents c = (-1/2, 0, 1/2) for input, hidden and output layers). As
           under Muon only hidden kernels may be on Shampoo under this preset (the paper's first
           and last layer rows need its readout init, which Adam's Table 8 leaves here
           replace); Adam's leaves keep Adam's muP.
  kfac     train.kfac.graft=adam (the default): as grafted Shampoo, each stored set's step has
           Adam's size, so Adam's muP applies unchanged. train.kfac.graft=none is K-FAC's own
           step (A + rho_A I)^-1 M (G + rho_G I)^-1 (sharenet/optim/kfac.py), whose second-order
           muP (Ishikawa & Karakida, arXiv:2312.12226) keeps the hidden kernels' LR constant in
           width (LR exponent c = 0) and scales each factor's damping as its eigenvalues: A (the
           input rows' second moment) grows with fan_in and G (the output gradients') shrinks
           with fan_out under muP, so rho_A ~ fan_in and rho_G ~ 1 / fan_out
           (kfac_damping_mults; the first author's code, riverstone496/classmup,
           utils/damping.py and utils/set_mup.py: dA = -1, dB = 1, c = 0; the paper's own table
           was not read). Init and forward multipliers are SP's on the hidden kernels; only
           they may be on K-FAC (its statistics are theirs), and Adam's leaves keep Adam's muP.

  scion    every leaf takes its role's LMO (sharenet/optim/scion.py). Scion's muP is its
           width-scaled LMOs (Pethick et al., arXiv:2502.07529: spectral x sqrt(fan_out /
           fan_in), rows over their RMS, sign / fan_in), which set the step of each layer's
           effective weights; muP's init and forward multipliers (Table 8) stay, and each
           leaf's LR multiplier undoes its forward multiplier (1 / fwd_mult; the readout also
           1 / the model's logits multiplier, m_d), so the effective weights take the LMO's
           step. `sp` under scion is the unscaled LMOs with every multiplier 1 (the readout's
           step then grows with fan_in).

parametrization.qk_lr (any kind, any optimizer) multiplies the LR of the query and key kernels
(their `use` in the role table; MASA atoms forming them too, not LoRA factors): a
parameter-dependent query/key LR as an alternative to QK-norm; 1 leaves every rule as it is.

Every other preset (mup_table3, umup, completep) is written for Adam: under muon, shampoo,
kfac or scion it is one ConfigError line naming the valid kinds.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from sharenet.errors import ConfigError
from sharenet.optim import matrix
from sharenet.optim.matrix import muon_step_scale

# Presets with a rule for each optimizer (module docstring).
MUON_MUP_ROLES = ('reader', 'writer')   # hidden kernels: the roles muon / vanilla shampoo muP take
QK_USES = ('query', 'key')   # ParamInfo.use of the query and key kernels (models/projections.py)


class OptSettings(NamedTuple):
  """What the rules read of a train config (settings_of)."""
  optimizer: str = 'adamw'
  matrix_roles: tuple[str, ...] = ()
  graft: str = 'adam'          # train.shampoo.graft (train.kfac.graft under kfac)
  block_size: int = 128        # train.shampoo.block_size
  muon_scale: str = 'shape'    # train.muon.scale


def check(kind: str, settings: OptSettings) -> None:
  """One ConfigError line for matrix roles that muP has no rule for under a spectral optimizer
  (which parametrizations an optimizer takes is the compatibility table's, config/compat.py)."""
  optimizer, matrix_roles, graft = settings.optimizer, settings.matrix_roles, settings.graft
  extra = [r for r in matrix_roles if r not in MUON_MUP_ROLES]
  spectral = optimizer == 'muon' or (optimizer in ('shampoo', 'kfac') and graft == 'none')
  if spectral and kind == 'mup' and extra:
    what = {'muon': 'Muon', 'shampoo': 'vanilla Shampoo (train.shampoo.graft=none)',
            'kfac': 'K-FAC (train.kfac.graft=none)'}[optimizer]
    raise ConfigError(f'parametrization.kind=mup under train.optimizer={optimizer} has a rule '
                      f'for hidden kernels on {what} only, not {extra}; valid '
                      f'train.matrix_roles: {", ".join(MUON_MUP_ROLES)}')


def muon_lr_mult(fan_in: int, fan_out: int, base_fan_in: int, base_fan_out: int,
                 scale: str = 'shape') -> float:
  """Spectral muP's LR multiplier over the step scale train.muon.scale applies (module
  docstring)."""
  r, r0 = fan_out / fan_in, base_fan_out / base_fan_in
  return (math.sqrt(r / r0) * muon_step_scale(base_fan_in, base_fan_out, scale)
          / muon_step_scale(fan_in, fan_out, scale))


def _shampoo_scales(fan_in: int, fan_out: int, block_size: int) -> tuple[float, float]:
  """(LR, damping) scales of vanilla Shampoo's muP for one matrix (module docstring):
  (fan_out / fan_in)^(1/2) (n_in n_out)^(-1/2) and b_in b_out / fan_out^2."""
  b_in, b_out = min(block_size, fan_in), min(block_size, fan_out)
  n_in, n_out = -(-fan_in // b_in), -(-fan_out // b_out)
  return math.sqrt(fan_out / fan_in / (n_in * n_out)), b_in * b_out / fan_out ** 2


def shampoo_mults(fan_in: int, fan_out: int, base_fan_in: int, base_fan_out: int,
                  block_size: int) -> tuple[float, float]:
  """(LR, damping) multipliers of vanilla Shampoo's second-order muP: the target matrix's
  scales over the base model's."""
  lr, damping = _shampoo_scales(fan_in, fan_out, block_size)
  lr0, damping0 = _shampoo_scales(base_fan_in, base_fan_out, block_size)
  return lr / lr0, damping / damping0


def kfac_damping_mults(fan_in: int, fan_out: int, base_fan_in: int,
                       base_fan_out: int) -> tuple[float, float]:
  """(rho_A, rho_G) multipliers of K-FAC's second-order muP (module docstring): fan_in over
  the base's, and the base's fan_out over the target's."""
  return fan_in / base_fan_in, base_fan_out / fan_out


def adjust(rules: dict, target: dict, base: dict, kind: str, settings: OptSettings,
           qk_lr: float = 1.0, logits_mult: float = 1.0) -> dict:
  """`rules` (Adam's, rules.LeafRule per path) for the optimizer of each leaf, with
  parametrization.qk_lr on the query and key kernels (`logits_mult`: the model's readout
  multiplier, which Scion's muP undoes on the readout's step)."""
  check(kind, settings)
  optimizer, matrix_roles, graft = settings.optimizer, settings.matrix_roles, settings.graft
  out = dict(rules)
  for path, rule in rules.items():
    info, lr, damping = target[path], rule.lr_mult, rule.damping_mult
    on_matrix = kind == 'mup' and info.role in matrix_roles
    if optimizer == 'scion':   # the LMO sets the effective weights' step (module docstring)
      lr = 1.0 / rule.fwd_mult / (logits_mult if info.role == 'readout' else 1.0) \
          if kind == 'mup' and rule.fwd_mult else 1.0
    elif optimizer == 'muon' and on_matrix:
      b = base[path]
      lr = muon_lr_mult(info.fan_in, info.fan_out, b.fan_in, b.fan_out, settings.muon_scale)
    elif optimizer == 'shampoo' and graft == 'none' and on_matrix:
      b = base[path]
      lr, damping = shampoo_mults(info.fan_in, info.fan_out, b.fan_in, b.fan_out,
                                  settings.block_size)
    elif optimizer == 'kfac' and graft == 'none' and on_matrix:   # LR constant in width
      b, lr = base[path], 1.0
      damping = kfac_damping_mults(info.fan_in, info.fan_out, b.fan_in, b.fan_out)
      damping = 1.0 if damping == (1.0, 1.0) else damping   # base width: exactly sp's
    # adamw; sp (all 1); grafted Shampoo's and K-FAC's muP is Adam's: the rule's LR as it is.
    if info.use in QK_USES and info.role == 'reader':
      lr *= qk_lr
    if (lr, damping) != (rule.lr_mult, rule.damping_mult):
      rule = dataclasses.replace(rule, lr_mult=lr, damping_mult=damping)
    out[path] = rule
  return out


def settings_of(train: Any) -> OptSettings:
  """The optimizer settings the rules read of a train config (adamw when it has none)."""
  if train is None:
    return OptSettings()
  name = matrix.optimizer_name(train)
  if name == 'adamw':
    return OptSettings()
  if name == 'scion':
    return OptSettings(name)
  roles = matrix.matrix_roles(train)
  if name == 'muon':
    return OptSettings(name, roles, muon_scale=train.muon.get('scale', 'shape'))
  if name == 'kfac':
    return OptSettings(name, roles, train.kfac.get('graft', 'adam'))
  sh = train.shampoo
  return OptSettings(name, roles, sh.get('graft', 'adam'), int(sh.block_size))
