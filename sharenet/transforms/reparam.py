"""Forward reparameterizations: raw params -> effective params, applied inside the loss.

They act on the stored tree, so a shared set's pool entry is transformed once per step however
many layers apply it (reparameterize the pool before the layer loop, never inside it).
Extra trainable leaves (gains) live in the 'reparam' collection of the train state's params,
keyed by the target leaf's path; non-trainable state (power-iteration vectors) lives in
TrainState.tstate and is advanced outside the differentiated loss.

Each transform is function-preserving at init where the reference allows it: weight norm's g
and sigma-reparam's gamma start at the initial norms / top singular values, the magnitude of
scale vectors at the initial gain norm, zero-mean writers on a Pre-LN model (Jiang et al.,
arXiv:2305.14858).
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.errors import ConfigError
from sharenet.models.params import KERNEL_ROLES, NORM_ROLES, REPARAM
from sharenet.transforms.roles import Leaf

Arrays = dict[str, jax.Array]


class Reparam:
  """One reparameterization applied to every selected leaf."""
  name = ''
  kernel_only = True   # selected by the path regex among Dense kernels

  def selects(self, leaf: Leaf, pattern: re.Pattern, roles: tuple[str, ...] = ()) -> bool:
    return (leaf.role in KERNEL_ROLES and bool(pattern.search(leaf.key)) and
            (not roles or leaf.role in roles))

  def init(self, w: jax.Array, leaf: Leaf) -> tuple[Arrays, Arrays]:
    return {}, {}

  def update_state(self, w: jax.Array, extras: Arrays, state: Arrays, leaf: Leaf) -> Arrays:
    return state

  def apply(self, w: jax.Array, extras: Arrays, state: Arrays, leaf: Leaf) -> jax.Array:
    raise NotImplementedError


def _unit_sq(m: jax.Array) -> jax.Array:
  """Squared norm of each output unit's fan-in vector: (..., fan_in, fan_out) -> (..., fan_out)."""
  return jnp.sum(jnp.square(m), axis=-2)


class WeightNorm(Reparam):
  """w = g * v / ||v|| per output unit (Salimans & Kingma, arXiv:1602.07868); g starts at
  ||v_0||."""
  name = 'weight_norm'

  def init(self, w, leaf):
    return {'wn_g': jnp.sqrt(_unit_sq(leaf.as_matrix(w)))}, {}

  def apply(self, w, extras, state, leaf):
    m = leaf.as_matrix(w)
    m = m * jax.lax.rsqrt(jnp.maximum(_unit_sq(m), 1e-12))[..., None, :]
    return (m * extras['wn_g'][..., None, :]).reshape(w.shape)


class WeightStandardization(Reparam):
  """Scaled WS (NF-ResNets, arXiv:2101.08692): g * (w - mean) / (std * sqrt(fan_in)) per unit.

  The nonlinearity gain gamma_nl of NF-ResNets is 1 here: a transformer's pre-activations are
  normalised, not ReLU'd, so unit-variance fan-in weights / sqrt(fan_in) keep the default init's
  scale. g starts at 1.
  """
  name = 'weight_std'

  def init(self, w, leaf):
    return {'ws_g': jnp.ones(leaf.stack_shape + (leaf.fan_out,), w.dtype)}, {}

  def apply(self, w, extras, state, leaf):
    m = leaf.as_matrix(w)
    mu = jnp.mean(m, axis=-2, keepdims=True)
    var = jnp.mean(jnp.square(m - mu), axis=-2, keepdims=True)
    m = (m - mu) * jax.lax.rsqrt(var * leaf.fan_in + 1e-12)
    return (m * extras['ws_g'][..., None, :]).reshape(w.shape)


def power_iteration(m: jax.Array, u: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
  """Alternating power iteration on (..., I, O) matrices; u (..., O) -> (u, v) unit vectors.

  A loop, not unrolled: the init's 50 steps unrolled over every kernel made its program ~1 MB
  of HLO and ~10 s of XLA:CPU compile time.
  """
  def step(_, uv):
    u, _ = uv
    v = _normalize(jnp.einsum('...io,...o->...i', m, u))
    return _normalize(jnp.einsum('...io,...i->...o', m, v)), v

  uv = (u, jnp.zeros(m.shape[:-1], u.dtype))
  return jax.lax.fori_loop(0, steps, step, uv) if steps > 1 else step(0, uv) if steps else uv


def _normalize(x: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.square(x), -1, keepdims=True), 1e-30))


class SigmaReparam(Reparam):
  """w_hat = gamma / sigma(w) * w (Zhai et al., arXiv:2303.06296), one scalar gamma per matrix.

  sigma = v^T W u with u, v from a persistent power iteration (stop-gradient; `iters` steps per
  train step, advanced outside the loss); u starts from `init_iters` power iterations and gamma
  at the matching sigma(W_0), so the model is unchanged at step 0.
  """
  name = 'sigma_reparam'

  def __init__(self, iters: int = 1, init_iters: int = 50):
    self.iters, self.init_iters = iters, init_iters

  def init(self, w, leaf):
    # Power iteration from a fixed random start rather than an SVD: LAPACK's SVD custom call
    # hung under an 8-device SPMD-partitioned init on XLA:CPU. gamma is sigma as `apply`
    # computes it from the same u, so gamma / sigma == 1 and the step-0 model is unchanged.
    m = leaf.as_matrix(w).astype(jnp.float32)
    u0 = jax.random.normal(jax.random.key(0), leaf.stack_shape + (leaf.fan_out,), jnp.float32)
    u, _ = power_iteration(m, _normalize(u0), self.init_iters)
    return {'sr_gamma': self._sigma(m, u).astype(w.dtype)}, {'sr_u': u}

  @staticmethod
  def _sigma(m: jax.Array, u: jax.Array) -> jax.Array:
    v = jax.lax.stop_gradient(_normalize(jnp.einsum('...io,...o->...i', m, u)))
    return jnp.einsum('...i,...io,...o->...', v, m, u)

  def update_state(self, w, extras, state, leaf):
    m = jax.lax.stop_gradient(leaf.as_matrix(w)).astype(jnp.float32)
    u, _ = power_iteration(m, state['sr_u'], self.iters)
    return {'sr_u': u}

  def apply(self, w, extras, state, leaf):
    m = leaf.as_matrix(w)
    sigma = self._sigma(m, jax.lax.stop_gradient(state['sr_u']).astype(m.dtype))
    scale = extras['sr_gamma'] / jnp.maximum(sigma, 1e-12)
    return (m * scale[..., None, None]).reshape(w.shape)


class ZeroMeanWriters(Reparam):
  """Writers into the residual stream produce zero-mean vectors: W - mean over 'embed'.

  Applied to attention-out / MLP-out kernels (and their LoRA B), untied embedding tables and
  learned positions. This is the training-time form of the Pre-LN == Pre-RMSNorm equivalence
  (Jiang et al., arXiv:2305.14858): a reparam, not a projection, so AdamW sees Pre-LN's
  gradients. Flax kernels are (in, out), so the mean is over the *last* axis.

  A tied table (`tied=True`) is never selected: it is also the readout, which must see the raw
  table; the model recentres the embedded vectors in its forward pass instead
  (model.center_embedding, required by Transforms).
  """
  name = 'zero_mean_writers'
  kernel_only = False

  def __init__(self, tied: bool = False):
    self.tied = tied

  def selects(self, leaf, pattern, roles=()):
    return leaf.writes and not (self.tied and leaf.role == 'embedding')

  def apply(self, w, extras, state, leaf):
    return w - jnp.mean(w, axis=leaf.embed_axis(), keepdims=True)


class ScaleVectors(Reparam):
  """Norm gains as magnitude x direction: gamma = m * u / ||u|| (our reading of the
  magnitude-direction form of Wang et al., arXiv:2605.26895), one scalar m per gain vector
  starting at ||u_0||."""
  name = 'scale_vectors'
  kernel_only = False

  def selects(self, leaf, pattern, roles=()):
    return leaf.role in NORM_ROLES and leaf.use == 'gain'

  def init(self, w, leaf):
    return {'sv_m': jnp.sqrt(jnp.sum(jnp.square(w), axis=-1))}, {}

  def apply(self, w, extras, state, leaf):
    return _normalize(w) * extras['sv_m'][..., None]


class WeightConditioning(Reparam):
  """W~ = g E W with E = diag(rho / ||w_i||) over the output units' fan-in rows w_i and
  rho = sqrt(mean_i ||w_i||^2) (Saratchandran et al., "Weight Conditioning for Smooth
  Optimization of Neural Networks", arXiv:2409.03424): a diagonal preconditioner that
  narrows the spread of W's singular values, one learnable scalar g per matrix (init 1).

  Our reading, not checked against the paper's section 3: the abstract fixes only "a
  normalization of weight matrices that narrows the gap between the smallest and largest
  singular values", motivated by preconditioning; we take row equilibration, the diagonal
  scaling that is within sqrt(fan_out) of the best one for the condition number (van der
  Sluis, 1969), normalised to keep W's Frobenius norm so the init scale (and muP's) is kept.
  Unlike weight_norm the unit norms are tied to one value, not learned per unit. It is the
  identity on a matrix whose units already have equal norms (and idempotent).
  """
  name = 'weight_conditioning'

  def init(self, w, leaf):
    return {'wcond_g': jnp.ones(leaf.stack_shape, w.dtype)}, {}

  def apply(self, w, extras, state, leaf):
    m = leaf.as_matrix(w)
    sq = jnp.maximum(_unit_sq(m), 1e-30)                     # (..., fan_out)
    rho = jnp.sqrt(jnp.mean(sq, axis=-1, keepdims=True))
    scale = rho * jax.lax.rsqrt(sq) * extras['wcond_g'][..., None]
    return (m * scale[..., None, :]).reshape(w.shape)


class Compander(Reparam):
  """w~ = sign(w) s (|w| / s)^gamma elementwise (a weight compander in the sense of Cakaj et al.,
  "Weight Compander: A Simple Weight Reparameterization for Regularization", arXiv:2306.16993),
  with learnable scalars s and gamma per matrix.

  The paper's function "restricts the magnitude of the weights while forcing them away from
  zero" and has learnable hyperparameters; its exact form is not restated here (our reading):
  a power-law compander, which for gamma < 1 lifts weights below s towards it and compresses
  those above, scale-free because s starts at the matrix's RMS (so muP's init scale is kept).
  gamma = 1 is the identity for every s; gamma starts at transforms.compander_gamma. |w| is
  floored at 1e-6 s so the gradient (infinite at 0 for gamma < 1) stays finite.
  """
  name = 'compander'

  def __init__(self, gamma: float = 0.5):
    if not gamma > 0:
      raise ConfigError(f'transforms.compander_gamma={gamma} must be > 0 (1 = identity; valid: '
                        f'a positive float, the paper\'s companding regime is < 1)')
    self.gamma = gamma

  def init(self, w, leaf):
    m = leaf.as_matrix(w)
    rms = jnp.sqrt(jnp.mean(jnp.square(m), axis=(-2, -1)))
    return {'wc_s': rms, 'wc_gamma': jnp.full(leaf.stack_shape, self.gamma, w.dtype)}, {}

  def apply(self, w, extras, state, leaf):
    m = leaf.as_matrix(w)
    s = extras['wc_s'][..., None, None]
    a = jnp.maximum(jnp.abs(m), 1e-6 * s) / s
    return (jnp.sign(m) * s * a ** extras['wc_gamma'][..., None, None]).reshape(w.shape)


REPARAMS = ('zero_mean_writers', 'weight_std', 'weight_norm', 'sigma_reparam', 'scale_vectors',
            'weight_conditioning', 'compander')


class ReparamChain:
  """The configured reparameterizations, composed left to right on the effective tree."""

  def __init__(self, names: Sequence[str], infos: dict[tuple, Leaf], paths_regex: str = 'kernel$',
               sigma_iters: int = 1, roles: Sequence[str] = (), tied_embeddings: bool = False,
               compander_gamma: float = 0.5):
    for n in names:
      if n not in REPARAMS:
        raise ConfigError(f'transforms.reparam: {n!r} is unknown; valid: {", ".join(REPARAMS)}')
    if len(set(names)) != len(names):
      raise ConfigError(f'transforms.reparam lists a transform twice: {",".join(names)}')
    try:
      pattern = re.compile(paths_regex)
    except re.error as e:
      raise ConfigError(f'transforms.reparam_paths={paths_regex!r} is not a regex: {e}') from e
    for r in roles:
      if r not in KERNEL_ROLES:
        raise ConfigError(f'transforms.reparam_roles: {r!r} is unknown; valid: '
                          f'{", ".join(KERNEL_ROLES)}')
    make = {'zero_mean_writers': lambda: ZeroMeanWriters(tied_embeddings),
            'weight_std': WeightStandardization,
            'weight_norm': WeightNorm, 'sigma_reparam': lambda: SigmaReparam(sigma_iters),
            'scale_vectors': ScaleVectors, 'weight_conditioning': WeightConditioning,
            'compander': lambda: Compander(compander_gamma)}
    self.steps = [make[n]() for n in names]
    self.infos = infos
    # (transform index, leaf) pairs in application order.
    self.targets = [(i, leaf) for i, r in enumerate(self.steps) for leaf in infos.values()
                    if r.selects(leaf, pattern, tuple(roles))]
    for i, r in enumerate(self.steps):
      if not any(j == i for j, _ in self.targets):
        raise ConfigError(f'transforms.reparam={r.name} selects no parameter (reparam_paths='
                          f'{paths_regex!r}, reparam_roles={",".join(roles)!r}); valid: a '
                          f'regex matching some kernel path')

  def __bool__(self) -> bool:
    return bool(self.steps)

  def _key(self, i: int, leaf: Leaf) -> tuple[str, ...]:
    return (REPARAM,) + leaf.path + (self.steps[i].name,)

  def init(self, variables: Any) -> tuple[dict, dict]:
    """(extras, state): extras = {'reparam': ...} to merge into the trainable tree."""
    flat = dict(flatten_dict(variables))
    extras, state = {}, {}
    for i, leaf in self.targets:
      r = self.steps[i]
      e, s = r.init(flat[leaf.path], leaf)
      extras.update({self._key(i, leaf) + (k,): v for k, v in e.items()})
      state.update({self._key(i, leaf) + (k,): v for k, v in s.items()})
      flat[leaf.path] = r.apply(flat[leaf.path], e, s, leaf)
    return unflatten_dict(extras), unflatten_dict(state)

  def _walk(self, variables: Any, tstate: Any, fn) -> dict:
    flat = dict(flatten_dict({k: v for k, v in variables.items() if k != REPARAM}))
    extras = flatten_dict(variables.get(REPARAM, {}))
    state = flatten_dict(tstate or {})
    for i, leaf in self.targets:
      key = self._key(i, leaf)[1:]
      e = {p[-1]: v for p, v in extras.items() if p[:-1] == key}
      s = {p[-1]: v for p, v in state.items() if p[:-1] == (REPARAM,) + key}
      fn(i, leaf, flat, e, s)
    return flat

  def update_state(self, variables: Any, tstate: Any) -> Any:
    """Advances non-trainable state (power iterations) on the current effective weights."""
    new = {}

    def fn(i, leaf, flat, e, s):
      r = self.steps[i]
      s2 = r.update_state(flat[leaf.path], e, s, leaf)
      new.update({self._key(i, leaf) + (k,): v for k, v in s2.items()})
      flat[leaf.path] = r.apply(flat[leaf.path], e, s2, leaf)

    self._walk(variables, tstate, fn)
    return unflatten_dict(new) if new else tstate

  def apply(self, variables: Any, tstate: Any) -> Any:
    """Effective model variables (the 'reparam' collection consumed)."""
    if not self.steps:
      return variables

    def fn(i, leaf, flat, e, s):
      flat[leaf.path] = self.steps[i].apply(flat[leaf.path], e, s, leaf)

    return unflatten_dict(self._walk(variables, tstate, fn))
