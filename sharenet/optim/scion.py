"""Scion: steps along a linear minimisation oracle (LMO) of a norm chosen per layer type.

Pethick, Xie, Erdogan, Antonakopoulos, Silveti-Falls, Cevher, "Training Deep Learning Models
with Norm-Constrained LMOs", ICML 2025, arXiv:2502.07529 (reference code LIONS-EPFL/scion,
scion.py). Per leaf, with momentum m <- (1 - a) m + a g (train.scion.momentum = a, the
reference's `momentum`):

  constrained (train.scion.constrained, the reference's default):  W <- (1 - lr) W - lr rho lmo(m)
  unconstrained:                                                   W <- W - lr rho lmo(m)

Here this stage returns rho lmo(m) (+ W when constrained); chain.make_chain's per-leaf LR
multipliers (parametrization, train.lr_groups) and the LR schedule follow, so a leaf's LR
multiplier scales its decay too, as a per-group LR does in the reference. The LMO of each leaf
is read from its role in the role table (sharenet/models/params.py), never from module names:

  role                      LMO (width-scaled: parametrization.kind=mup)   unscaled (kind=sp)
  reader, writer, router,   spectral: the matrix view orthogonalised      orthogonalised
  lora                      (Newton-Schulz, optax's) x sqrt(fan_out/fan_in)
                            (a stack of fan-in vectors, as a router's rows: each a fan_in x 1
                            matrix, the vector over its l2 norm x sqrt(1/fan_in))
  embedding, pos_embed      each row (a token's vector) over its RMS       over its l2 norm
  readout                   sign / fan_in                                  sign
  norm gains, biases,       the vector over its RMS (per stored set)       the same
  scalars, reparam gains

The width-scaled LMOs are the reference's (Spectral(normalized=True), ColNorm(transpose=True)
for the embedding, Sign(normalized=True), BiasRMS): the norms are the RMS->RMS operator norm
for hidden matrices, l1->RMS for the embedding and RMS->l_inf for the readout, under which
Pethick et al. show the step's effect on the activations does not change with width: Scion's
muP. The unscaled LMOs (the plain spectral, l2-row and max-entry norms) are its standard
parametrization: the readout's step then grows with fan_in (docs/optimizers.md).

rho is train.scion.radius, on the readout train.scion.output_radius (the reference's `scale`
per group: 50 and 3000 in its nanoGPT example, lr 2^-12).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import _muon

from sharenet.errors import ConfigError
from sharenet.models import params as params_lib
from sharenet.optim import matrix

SPECTRAL_ROLES = ('reader', 'writer', 'router', 'lora')
ROW_ROLES = ('embedding', 'pos_embed')
SIGN_ROLES = ('readout',)
VECTOR_ROLES = ('norm_in', 'norm_out', 'bias', 'scalar', 'reparam')
EPS = 1e-8   # the reference's, in each normalisation's denominator
DEFAULT_MATRIX_ROLES = 'reader,writer'


class ScionState(NamedTuple):
  momentum: Any


def check(t: Any) -> None:
  """train.scion's settings, and what Scion replaces (one ConfigError line each)."""
  s = t.scion
  if not 0.0 < float(s.momentum) <= 1.0:
    raise ConfigError(f'train.scion.momentum={s.momentum} must be in (0, 1] (the weight of the '
                      f'new gradient; 1 = no momentum)')
  if int(s.ns_steps) < 1:
    raise ConfigError(f'train.scion.ns_steps={s.ns_steps} must be >= 1')
  if float(s.radius) <= 0 or float(s.output_radius) <= 0:
    raise ConfigError(f'train.scion.radius={s.radius} and output_radius={s.output_radius} '
                      f'must be > 0')
  if str(t.matrix_roles).replace(' ', '') != DEFAULT_MATRIX_ROLES:
    raise ConfigError(f'train.matrix_roles={t.matrix_roles!r} picks the leaves of muon / '
                      f'shampoo; train.optimizer=scion takes every leaf by its role; valid: '
                      f'the default {DEFAULT_MATRIX_ROLES!r}')
  if s.constrained and t.weight_decay:
    raise ConfigError(f'train.optimizer=scion with train.scion.constrained=True decays every '
                      f'weight by its own step, and train.weight_decay={t.weight_decay} would '
                      f'add more; valid: train.weight_decay=0, or scion.constrained=False')


def lmo_kind(info: params_lib.ParamInfo) -> str:
  """'spectral' | 'rows' | 'sign' | 'vector' for a leaf of the role table; one ConfigError line
  for a role Scion has no LMO for (MPO tensors)."""
  for kind, roles in (('spectral', SPECTRAL_ROLES), ('rows', ROW_ROLES), ('sign', SIGN_ROLES),
                      ('vector', VECTOR_ROLES)):
    if info.role in roles:
      return kind
  raise ConfigError(f'train.optimizer=scion has no LMO for {info.key} (role {info.role!r}); '
                    f'valid roles: {", ".join(SPECTRAL_ROLES + ROW_ROLES + SIGN_ROLES + VECTOR_ROLES)}')


def _rms(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  return jnp.sqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True))


def lmo(info: params_lib.ParamInfo, g: jax.Array, scaled: bool, ns_steps: int = 5) -> jax.Array:
  """The LMO direction of one leaf's momentum `g` (module docstring; without rho). Leading
  stack axes (stored sets, loops, atoms) are separate matrices / vectors."""
  kind, s = lmo_kind(info), info.num_stack
  g = g.astype(jnp.float32)
  if kind == 'spectral' and len(info.axes) == s + info.num_in:
    # a stack of fan-in vectors (a router's row per expert or recursion): each is a
    # fan_in x 1 matrix, whose orthogonalisation is the vector over its l2 norm
    axes = tuple(range(s, g.ndim))
    o = g / (jnp.sqrt(jnp.sum(jnp.square(g), axis=axes, keepdims=True)) + EPS)
    return o * math.sqrt(1 / math.prod(g.shape[s:])) if scaled else o
  if kind == 'spectral':
    _, fan_in, fan_out = matrix.matrix_dims(info)
    coeffs = jnp.asarray(_muon._DEFAULT_NS_COEFFS)
    o = _muon.orthogonalize_via_newton_schulz(g, coeffs, ns_steps, eps=EPS,
                                              dimension_numbers=matrix.dimension_numbers(info))
    return o * math.sqrt(fan_out / fan_in) if scaled else o
  if kind == 'rows':   # (stack..., rows, width...): each row over its RMS (l2 norm unscaled)
    axes = tuple(range(s + 1, g.ndim))
    norm = _rms(g, axes) if scaled else jnp.sqrt(jnp.sum(jnp.square(g), axis=axes, keepdims=True))
    return g / (norm + EPS)
  if kind == 'sign':
    _, fan_in, _ = matrix.matrix_dims(info)
    return jnp.sign(g) / fan_in if scaled else jnp.sign(g)
  axes = tuple(range(s, g.ndim))
  return g / (_rms(g, axes) + EPS) if axes else jnp.sign(g)   # a scalar's RMS is |g|


def scale_by_scion(settings: Any, table: dict, scaled: bool) -> optax.GradientTransformation:
  """Momentum, then rho x the LMO of each leaf (+ the weights when constrained): the direction
  stage of chain.make_chain under train.optimizer=scion (`settings`: train.scion; `table`: the
  role table, reparam gains included; `scaled`: the width-scaled LMOs, parametrization mup)."""
  a = float(settings.momentum)
  rho, rho_out = float(settings.radius), float(settings.output_radius)
  steps, constrained = int(settings.ns_steps), bool(settings.constrained)
  for info in table.values():
    lmo_kind(info)   # a leaf without an LMO: one line now, not at the first step

  def init_fn(params):
    return ScionState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

  def update_fn(updates, state, params=None):
    if constrained and params is None:
      raise ValueError('constrained Scion needs the params in its update')
    m = jax.tree.map(lambda mu, g: (1 - a) * mu + a * g.astype(jnp.float32), state.momentum,
                     updates)

    def leaf(path, mu, p):
      info = table.get(matrix._keys(path))
      if info is None:   # a transform's gain (reparam collection): a vector, over its RMS
        params_lib.role_at(table, matrix._keys(path))   # one line if it is not one
        d = mu / (_rms(mu, tuple(range(mu.ndim))) + EPS) * rho if mu.ndim else jnp.sign(mu) * rho
      else:
        d = lmo(info, mu, scaled, steps) * (rho_out if info.role in SIGN_ROLES else rho)
      if constrained:
        d = d + p.astype(jnp.float32)
      return d.astype(p.dtype)
    out = jax.tree_util.tree_map_with_path(leaf, m, params if params is not None else m)
    return out, ScionState(m)

  return optax.GradientTransformation(init_fn, update_fn)
