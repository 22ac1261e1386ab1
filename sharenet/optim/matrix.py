"""Matrix optimizers (train.optimizer = muon | shampoo | kfac) beside AdamW for every other leaf.

Which leaves a matrix optimizer takes is train.matrix_roles (default the hidden kernels,
reader and writer), read from the role table (sharenet/models/params.py), never from module names;
embeddings, the readout, norm gains, biases, scalars, LoRA factors and reparam gains stay on
Adam unless named. Each taken leaf is seen as its matrix view (stack..., fan_in, fan_out): the
leading stack axes ('layers', 'repeats', 'atoms'; params.STACK_AXES) index separate matrices,
the next `num_in` axes are the fan-in, the rest the fan-out. Muon is optax's
(optax.contrib.scale_by_muon) with MuonDimensionNumbers from that view, so a stacked or
scanned kernel is orthogonalised per stored set (a vmap over the stack axes) and a DenseGeneral
kernel (embed, heads, head_dim) as the (embed, heads x head_dim) matrix it multiplies with.
Shampoo is sharenet/optim/shampoo.py, K-FAC sharenet/optim/kfac.py (its statistics: the taps of
sharenet/models/curvature.py, so it takes the tapped hidden kernels only, reader and writer).

A tied set is one stored tensor whose gradient is the sum of its uses' gradients (sharing.py),
so the orthogonalisation and the preconditioner act on the summed gradient by construction
(tests/optim/test_matrix.py shows it).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from optax import contrib
from optax.contrib import _muon

from sharenet.models import params as params_lib
from sharenet.errors import ConfigError
from sharenet.models import curvature
from sharenet.optim import kfac
from sharenet.optim.shampoo import GRAFTS, scale_by_shampoo

# scion: sharenet/optim/scion.py; kfac: sharenet/optim/kfac.py
OPTIMIZERS = ('adamw', 'muon', 'shampoo', 'scion', 'kfac')
# train.muon.scale: the factor on Muon's orthogonalised step (muon_step_scale). `shape` is
# optax.contrib.muon's (Keller Jordan's) sqrt(max(1, fan_out / fan_in)); `rms` is Moonlight's
# 0.2 sqrt(max(fan_in, fan_out)), which gives the step AdamW's update RMS (~0.2 for beta1 0.9)
# so AdamW's LR and weight decay carry over at one width (Liu et al., "Muon is Scalable for LLM
# Training", arXiv:2502.16982, section 2.2).
MUON_SCALES = ('shape', 'rms')
MOONLIGHT_RMS = 0.2
# Roles a matrix optimizer can take: leaves that are matrices (or stacks of them).
MATRIX_OPT_ROLES = ('reader', 'writer', 'readout', 'router', 'embedding', 'pos_embed', 'lora')
Path = tuple[str, ...]


def optimizer_name(t: Any) -> str:
  """train.optimizer, checked."""
  name = t.get('optimizer', 'adamw')
  if name not in OPTIMIZERS:
    raise ConfigError(f'train.optimizer={name!r} is unknown; valid: {", ".join(OPTIMIZERS)}')
  return name


def matrix_roles(t: Any) -> tuple[str, ...]:
  """train.matrix_roles, checked: a role that is not a matrix is one ConfigError line."""
  roles = tuple(r for r in str(t.get('matrix_roles', 'reader,writer')).replace(' ', '')
                .split(',') if r)
  for r in roles:
    if r not in MATRIX_OPT_ROLES:
      raise ConfigError(f'train.matrix_roles: {t.optimizer} cannot take role {r!r} (not a '
                        f'matrix); valid: {", ".join(MATRIX_OPT_ROLES)}')
  return roles


def check_settings(t: Any) -> None:
  """Bad train.optimizer / matrix_roles / shampoo settings raise one ConfigError line."""
  name = optimizer_name(t)
  if name in ('adamw', 'scion'):   # scion's settings: scion.check
    return
  roles = matrix_roles(t)
  if name == 'kfac':
    extra = [r for r in roles if r not in curvature.TAPPED_ROLES]
    if extra:
      raise ConfigError(f'train.matrix_roles: kfac cannot take {extra} (no Kronecker statistics '
                        f'there); valid: {", ".join(curvature.TAPPED_ROLES)}')
    kfac.check(t.kfac)
  if name == 'muon' and t.muon.get('scale', 'shape') not in MUON_SCALES:
    raise ConfigError(f'train.muon.scale={t.muon.scale!r} is unknown; valid: '
                      f'{", ".join(MUON_SCALES)}')
  if name == 'shampoo':
    sh = t.shampoo
    if int(sh.block_size) < 1:
      raise ConfigError(f'train.shampoo.block_size={sh.block_size} must be >= 1; valid: a '
                        f'positive integer (e.g. 128)')
    if int(sh.update_every) < 1:
      raise ConfigError(f'train.shampoo.update_every={sh.update_every} must be >= 1')
    if float(sh.eps) <= 0:
      raise ConfigError(f'train.shampoo.eps={sh.eps} must be > 0')
    if sh.get('graft', 'adam') not in GRAFTS:
      raise ConfigError(f'train.shampoo.graft={sh.graft!r} is unknown; valid: '
                        f'{", ".join(GRAFTS)}')


def matrix_dims(info: params_lib.ParamInfo) -> tuple[tuple[int, ...], int, int]:
  """(stack_shape, fan_in, fan_out) of a leaf a matrix optimizer takes; one ConfigError line
  when the leaf is not a matrix (no fan-in or no fan-out axis)."""
  n_in, n_out = info.num_in, len(info.axes) - info.num_stack - info.num_in
  if n_in < 1 or n_out < 1:
    raise ConfigError(f'parameter {info.key}: a matrix optimizer cannot take it (axes '
                      f'{info.axes}, {n_in} fan-in and {n_out} fan-out axes); valid '
                      f'train.matrix_roles: {", ".join(MATRIX_OPT_ROLES)} with a matrix view')
  return info.stack_shape, info.fan_in, info.fan_out


def muon_step_scale(fan_in: int, fan_out: int, scale: str) -> float:
  """The factor train.muon.scale puts on an orthogonalised step of a fan_in x fan_out matrix."""
  if scale == 'shape':
    return max(1.0, fan_out / fan_in) ** 0.5
  return MOONLIGHT_RMS * max(fan_in, fan_out) ** 0.5


def is_matrix_leaf(table: dict, roles: tuple[str, ...], path: Path) -> bool:
  return path in table and table[path].role in roles


def dimension_numbers(info: params_lib.ParamInfo) -> contrib.MuonDimensionNumbers:
  """Muon's reduction (fan-in) and output (fan-out) axes; stack axes are its batch axes."""
  matrix_dims(info)
  s, n_in = info.num_stack, info.num_in
  return contrib.MuonDimensionNumbers(reduction_axis=tuple(range(s, s + n_in)),
                                      output_axis=tuple(range(s + n_in, len(info.axes))))


def _keys(path) -> Path:
  return tuple(getattr(k, 'key', getattr(k, 'name', str(k))) for k in path)


def _per_leaf(table: dict, fn: Callable) -> Callable[[Any], Any]:
  """params tree (masked or not) -> tree of fn(ParamInfo) per leaf."""
  return lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, _: fn(table[_keys(path)]), tree)


def matrix_transform(t: Any, table: dict, adam: optax.GradientTransformation,
                     eps: Callable[[Path], float],
                     damping: Callable[[Path], float] = lambda path: 1.0
                     ) -> optax.GradientTransformation:
  """The direction stage: muon, shampoo or kfac on the matrix_roles leaves, `adam` on the
  others; `eps(path)` is Adam's eps (Shampoo's and K-FAC's graft too), `damping(path)`
  multiplies Shampoo's damping, or K-FAC's (a pair: its A and G factors').

  Per-leaf LR / decay multipliers and the schedule follow it in chain.make_chain, the same for
  both parts.
  """
  name, roles = optimizer_name(t), matrix_roles(t)
  check_settings(t)
  for info in table.values():
    if info.role in roles:
      matrix_dims(info)   # raises for a leaf the optimizer cannot take
  if name == 'muon':
    mu, dims = t.muon, _per_leaf(table, dimension_numbers)
    # optax.contrib.muon's own matrix part: orthogonalised momentum, then (scale=shape) its
    # shape factor sqrt(max(1, fan_out / fan_in)) (scale_by_shape is not exported; optax 0.2.8
    # builds muon from it). Its Adam part differs from ours (Nesterov), so only the matrix part
    # is reused.
    if mu.get('scale', 'shape') == 'shape':
      step_scale = _muon.scale_by_shape(weight_dimension_numbers=dims)
    else:
      factors = _per_leaf(table, lambda info: muon_step_scale(
          info.fan_in, info.fan_out, mu.scale))
      step_scale = optax.GradientTransformation(
          lambda params: optax.EmptyState(),
          lambda updates, state, params=None: (jax.tree.map(
              lambda u, f: u * jnp.asarray(f, u.dtype), updates, factors(updates)),
              state))
    matrix = optax.chain(
        contrib.scale_by_muon(ns_steps=int(mu.ns_steps), beta=float(mu.momentum),
                              weight_dimension_numbers=dims),
        step_scale)
  elif name == 'kfac':
    k = t.kfac
    def pair(path):   # K-FAC's muP gives (rho_A, rho_G) multipliers; a plain 1.0 is both
      v = damping(path)
      return tuple(v) if isinstance(v, tuple) else (v, v)
    matrix = kfac.scale_by_kfac(_per_leaf(table, matrix_dims), int(k.update_every),
                                float(k.damping), float(k.decay), t.b1, t.b2, eps,
                                k.get('graft', 'adam'), pair)
  else:
    sh = t.shampoo
    matrix = scale_by_shampoo(_per_leaf(table, matrix_dims), int(sh.block_size),
                              int(sh.update_every), float(sh.eps), t.b1, t.b2, eps,
                              sh.get('graft', 'adam'), damping)

  def labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: 'matrix' if is_matrix_leaf(table, roles, _keys(path)) else 'adam',
        params)
  return optax.multi_transform({'matrix': matrix, 'adam': adam}, labels)
