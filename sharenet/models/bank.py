"""Parameter bank: every layer's kernels generated from one learned bank of a fixed budget
(Shapeshifter Networks; Plummer, Dryden, Frost, Hoefler, Saenko, "Neural Parameter Allocation
Search", ICLR 2022, arXiv:2006.10598).

`model.bank.size` = P parameters, stored as one matrix B (d_model, C), C = P / d_model columns,
outside the layer stack. Each target kernel type p (model.bank.targets; every block kernel by
default) reads n_p columns of B: a reader's output features (q: heads x head_dim, wi: mlp_dim),
a writer's input features (o: heads x head_dim, wo: mlp_dim; B transposed). Its templates are
S_p = ceil(C / n_p) windows of n_p consecutive columns spread evenly over the bank (start
round(s (C - n_p) / (S_p - 1)); overlapping where S_p n_p > C), so every column serves every
kernel type. A stored set l forms W_p,l = sum_s c_p,l,s T_p,s with its own S_p coefficients:
the per-layer mapping, learned: SSN's weighted-average weight generation ("WAvg") over
templates cut from one parameter group holding every layer (the paper's code default,
--param_groups 1). The kernels then run through the MASA path (models/masa.py,
models/layers.py Dense with `atoms`): the templates are the atoms, the coefficients
'masa_coef'. Where the reference code (BryanPlummer/SSN, models/param_bank.py) differs: there
each layer takes its own block of K <= 8 consecutive templates at a per-layer offset (wrapping
at the bank's end), so a bank of exactly the model's size gives every layer its own weights;
here every layer mixes all templates of its kernel type (the templates are shared, the
mapping is per layer), which keeps one set of templates for the whole scan.

Budget: the bank holds exactly model.bank.size parameters (a multiple of d_model); the
mappings add sum_p S_p scalars per stored set, counted apart, as the reference code counts
only the bank. Below the model's own kernel count the templates overlap and layers share
columns (low-budget regime); above it each layer mixes more templates (high-budget regime:
capacity without inference FLOPs, since W_p,l can be formed once for serving). A bank smaller
than the widest template (n_p columns: the reference code interpolates a smaller group up to
the layer's shape instead) is refused.

Init and roles: B is a reader matrix (fan-in d_model, init std d_model^-1/2, role 'reader';
its column axis 'bank' is a width axis: C scales with width, so muP's hidden rule holds for
it), and a writer's templates are multiplied by the constant sqrt(d_model / n_p) so W_o and
W_out start at their own default std n_p^-1/2. The coefficients start as a random unit vector
(as MASA's; the reference code draws the (layers, K) coefficient matrix orthogonal, rows
orthonormal up to K layers), so every generated kernel starts at its default init's scale.
Our choices: the window placement, the writer constant and the coefficient init.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sharenet.models.config import ModelConfig
from sharenet.models.masa import atom_specs
from sharenet.models.params import param

BANK_AXIS = 'bank'   # the bank's column axis (a width axis: parametrization/rules.py WIDTH_AXES)


def columns(cfg: ModelConfig) -> int:
  """C: the bank's columns."""
  return cfg.bank.size // cfg.d_model


def window_width(shape: tuple[int, ...], role: str) -> int:
  """n_p: the columns one template of a kernel of `shape` takes (readers: the output
  features after d_model; writers: the input features before it)."""
  return math.prod(shape[1:] if role == 'reader' else shape[:-1])


def window_starts(num_columns: int, width: int) -> np.ndarray:
  """The first column of each of the ceil(C / n) templates of width n, spread evenly."""
  count = -(-num_columns // width)
  if count == 1:
    return np.zeros(1, np.int32)
  return np.round(np.arange(count) * (num_columns - width) / (count - 1)).astype(np.int32)


def templates(bank_DC: jax.Array, shape: tuple[int, ...], role: str) -> jax.Array:
  """The templates of one kernel type as atoms (S, *shape) cut from the bank (module
  docstring)."""
  D, C = bank_DC.shape
  n = window_width(shape, role)
  index_SN = window_starts(C, n)[:, None] + np.arange(n)[None, :]
  cols_SDN = jnp.moveaxis(bank_DC[:, index_SN], 1, 0)          # (S, D, n)
  if role == 'reader':
    return cols_SDN.reshape((-1,) + shape)
  scale = jnp.asarray(math.sqrt(D / n), bank_DC.dtype)         # writer: default std n^-1/2
  return (jnp.swapaxes(cols_SDN, 1, 2) * scale).reshape((-1,) + shape)


class ParameterBank(nn.Module):
  """Creates the bank and returns each target kernel's templates {kernel name: (S, shape)},
  the atoms the blocks combine with their per-set coefficients."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self) -> dict[str, jax.Array]:
    c = self.cfg
    bank = param(self, 'bank', (c.d_model, columns(c)), ('embed', BANK_AXIS), 'reader',
                 std=c.d_model ** -0.5, dtype=jnp.dtype(c.param_dtype), num_in=1)
    return {name: templates(bank, shape, role)
            for name, (shape, _, role, *_) in atom_specs(c, c.bank_kernels).items()}
