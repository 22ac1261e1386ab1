"""K-FAC on the hidden kernels, grafted to Adam's step size or not, as one optax transform.

K-FAC (Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
Curvature", arXiv:1503.05671) preconditions a dense kernel's gradient (fan_in x fan_out, x W
layout) from both sides with the Kronecker factors of its Fisher block:

    A <- d A + (1 - d) A_t,   G <- d G + (1 - d) G_t          (EMA, bias-corrected by 1 - d^t)
    direction = (A + rho_A I)^-1 M (G + rho_G I)^-1

with A_t the mean outer product of the layer's input rows and G_t that of the per-row loss
gradients at its output, this step's (the empirical Fisher: the gradients of the training
labels), read from the taps of sharenet/models/curvature.py; M is Adam's bias-corrected first
moment, as Shampoo's here (sharenet/optim/shampoo.py). A tied set's factors sum its applied
layers' statistics (curvature.statistics). The inverses are recomputed every `update_every`
steps (eigendecompositions in float32, eigenvalues clipped at 0). Each factor has its own
damping, train.kfac.damping times the parametrization's per-factor multiplier (`damping(path)`
gives (rho_A multiplier, rho_G multiplier)): the second-order muP scales them apart
(sharenet/parametrization/optimizer_rules.py).

graft='adam' (the default) scales each stored set's direction to the Frobenius norm of Adam's
update of the same set, so the step (and the LR that suits it, and Adam's muP) is Adam's while
K-FAC picks the direction; graft='none' is K-FAC's own step, the setting of Ishikawa &
Karakida's second-order muP ("On the Parameterization of Second-Order Optimization Effective
Towards the Infinite Width", arXiv:2312.12226).

The statistics reach the transform through `statistics(...)`, a context the train step
(sharenet/train/trainer.py) opens around `tx.update` while it is traced: optax's update takes
gradients, state and params only, and the factors' inputs are none of those. An update traced
outside it is one error line.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sharenet.errors import ConfigError
from sharenet.optim.shampoo import GRAFTS, MatrixDims, graft_to_adam, inverse_root, moments

_STATISTICS: list[dict] = []


@contextlib.contextmanager
def statistics(stats: dict) -> Iterator[None]:
  """K-FAC updates traced inside read this step's {kernel path: (A_t, G_t)}
  (models/curvature.statistics)."""
  _STATISTICS.append(stats)
  try:
    yield
  finally:
    _STATISTICS.pop()


def in_state(opt_state: Any) -> bool:
  """Whether an optimizer state holds K-FAC's (so its step must tap the statistics)."""
  is_kfac = lambda x: isinstance(x, KfacState)
  return any(is_kfac(x) for x in jax.tree.leaves(opt_state, is_leaf=is_kfac))


class KfacLeaf(NamedTuple):
  """One leaf's factors and inverses per stored set: (sets, fan_in, fan_in) and (sets, fan_out,
  fan_out)."""
  a: jax.Array
  g: jax.Array
  inv_a: jax.Array
  inv_g: jax.Array


class KfacState(NamedTuple):
  count: jax.Array
  mu: Any
  nu: Any
  factors: Any   # KfacLeaf per leaf


def check(k: Any) -> None:
  """Bad train.kfac settings are one ConfigError line."""
  if int(k.update_every) < 1:
    raise ConfigError(f'train.kfac.update_every={k.update_every} must be >= 1; valid: a positive '
                      f'integer (e.g. 10)')
  if float(k.damping) <= 0:
    raise ConfigError(f'train.kfac.damping={k.damping} must be > 0; valid: e.g. 1e-3')
  if not 0 <= float(k.decay) < 1:
    raise ConfigError(f'train.kfac.decay={k.decay} must be in [0, 1); valid: e.g. 0.95')
  if k.get('graft', 'adam') not in GRAFTS:
    raise ConfigError(f'train.kfac.graft={k.graft!r} is unknown; valid: {", ".join(GRAFTS)}')


def _keys(path) -> tuple[str, ...]:
  return tuple(getattr(k, 'key', getattr(k, 'name', str(k))) for k in path)


def scale_by_kfac(dims: Callable[[Any], Any], update_every: int, damping: float, decay: float,
                  b1: float, b2: float, adam_eps: Callable[[tuple], float],
                  graft: str = 'adam',
                  damping_mults: Callable[[tuple], tuple[float, float]] = lambda p: (1.0, 1.0)
                  ) -> optax.GradientTransformation:
  """K-FAC (module docstring). `dims(params)` maps the params tree to each leaf's MatrixDims;
  `adam_eps(path)` is the graft's per-leaf Adam eps; `damping_mults(path)` multiplies `damping`
  for A and for G."""
  if graft not in GRAFTS:
    raise ValueError(f'graft={graft!r}; valid: {", ".join(GRAFTS)}')

  def init_leaf(p, d: MatrixDims):
    del p
    n, fi, fo = math.prod(d[0]), d[1], d[2]
    za, zg = jnp.zeros((n, fi, fi), jnp.float32), jnp.zeros((n, fo, fo), jnp.float32)
    return KfacLeaf(za, zg, za, zg)

  def init_fn(params):
    return KfacState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params),
                     optax.tree.zeros_like(params),
                     jax.tree.map(init_leaf, params, dims(params)))

  def update_fn(updates, state, params=None):
    del params
    if not _STATISTICS:
      raise ConfigError('train.optimizer=kfac: the update was traced without the step\'s '
                        'Kronecker statistics; valid: sharenet.train.trainer.train_step (it '
                        'reads them from the taps, sharenet/models/curvature.py)')
    stats = _STATISTICS[-1]
    mu, nu, count, mu_hat, nu_hat = moments(updates, state.mu, state.nu, state.count, b1, b2,
                                            graft)
    refresh = (state.count % update_every) == 0
    correction = 1.0 - decay ** count.astype(jnp.float32)

    def leaf(path, g, m, v, d, f):
      keys = _keys(path)
      if keys not in stats:
        raise ConfigError(f'train.optimizer=kfac: parameter {"/".join(keys)} has no Kronecker '
                          f'statistics (no taps: sharenet/models/curvature.py); valid: '
                          f'train.matrix_roles of tapped Dense kernels (reader, writer)')
      n, fi, fo = math.prod(d[0]), d[1], d[2]
      a_t, g_t = stats[keys]
      a = decay * f.a + (1 - decay) * a_t.reshape(n, fi, fi)
      gg = decay * f.g + (1 - decay) * g_t.reshape(n, fo, fo)
      mult_a, mult_g = damping_mults(keys)
      inv_a, inv_g = jax.lax.cond(
          refresh, lambda: (inverse_root(a / correction, damping * mult_a, p=1),
                            inverse_root(gg / correction, damping * mult_g, p=1)),
          lambda: (f.inv_a, f.inv_g))
      m_NIO = m.astype(jnp.float32).reshape(n, fi, fo)
      dir_NIO = jnp.einsum('nij,njo,nop->nip', inv_a, m_NIO, inv_g)
      if graft == 'adam':
        adam_NIO = (m / (jnp.sqrt(v) + adam_eps(keys))).astype(jnp.float32).reshape(n, fi, fo)
        dir_NIO = graft_to_adam(dir_NIO, adam_NIO)
      return dir_NIO.reshape(g.shape).astype(g.dtype), KfacLeaf(a, gg, inv_a, inv_g)

    pairs = jax.tree_util.tree_map_with_path(leaf, updates, mu_hat, nu_hat, dims(updates),
                                             state.factors)
    new_updates = jax.tree.map(lambda _, o: o[0], updates, pairs)
    new_factors = jax.tree.map(lambda _, o: o[1], updates, pairs)
    return new_updates, KfacState(count, mu, nu, new_factors)

  return optax.GradientTransformation(init_fn, update_fn)
