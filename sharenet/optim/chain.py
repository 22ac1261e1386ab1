"""Optax chain: [AGC] -> clipping -> Adam(W), AdamP, or Muon / Shampoo on the hidden kernels
beside Adam (train.optimizer; sharenet/optim/matrix.py) -> [post-step projection].

The peak learning rate (train.lr) is a hyperparameter in the optimizer state
(optax.inject_hyperparams; `with_peak_lr` sets it), so one jitted step can train cells at
different learning rates (sharenet/studies/lr_sweep.py): the chain is rebuilt from it each step,
exactly as for a config with that train.lr.

Decay is role-masked (train.decay_roles) by the model's role table (sharenet/models/params.py). With
a
parametrization's per-leaf multipliers (sharenet/parametrization/rules.py) the Adam part is: Adam
with
per-leaf eps -> per-leaf LR multipliers -> decoupled decay with per-leaf multipliers (not scaled
by the LR multiplier; `OptMultipliers.wd`, e.g. CompleteP's depth correction, see
sharenet/parametrization/rules.py) -> the LR schedule. With every multiplier 1 it is bit-identical
to
optax.adamw (asserted in tests/parametrization/test_rules.py).
"""
from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.config import defaults
from sharenet.errors import ConfigError
from sharenet.models import params as params_lib
from sharenet.optim import ema, guard, matrix, scion, trainable
from sharenet.transforms.project import projection
from sharenet.transforms.update import agc, scale_by_adamp

SCHEDULES = ('wsd', 'cosine', 'constant')
# train.lr_groups: layer groups by role (the norm-transfer paper's input, hidden and output
# layers, arXiv:2510.03871 section 5, and the vectors)
LR_GROUPS = {'embedding': ('embedding', 'pos_embed'),
             'hidden': ('reader', 'writer', 'router', 'lora', 'mpo'),
             'readout': ('readout',),
             'vector': ('norm_in', 'norm_out', 'bias', 'scalar', 'reparam')}
# Role groups accepted by train.decay_roles; 'matrices' = every kernel, embedding and LoRA factor.
DECAY_GROUPS = {'matrices': params_lib.MATRIX_ROLES + ('mpo',), 'norm_in': ('norm_in',),
                'norm_out': ('norm_out',), 'bias': ('bias',), 'scalar': ('scalar',),
                'reparam': ('reparam',)}


def lr_schedule(t: Any, peak: Any = None) -> optax.Schedule:
  """Linear warmup, then constant / cosine / warmup-stable-decay (linear cooldown).

  `peak` (default train.lr) may be a traced scalar: the optimizer's injected peak LR.
  """
  if t.schedule not in SCHEDULES:
    raise ConfigError(f'train.schedule={t.schedule!r} is unknown; valid: {", ".join(SCHEDULES)}')
  peak = t.lr if peak is None else peak
  floor = peak * t.min_lr_ratio
  warmup = min(t.warmup_steps, t.steps)
  if t.schedule == 'cosine':
    # optax.warmup_cosine_decay_schedule, written out: it branches on the peak's value.
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup),
         optax.cosine_decay_schedule(peak, max(t.steps, warmup + 1) - warmup, t.min_lr_ratio)],
        [warmup])
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  if t.schedule == 'constant':
    return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
  decay = max(1, int(t.decay_fraction * t.steps))
  stable = max(t.steps - decay, warmup)
  return optax.join_schedules(
      [warm, optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
      [warmup, stable])


def lr_groups(t: Any, table: dict | None) -> dict[str, float]:
  """train.lr_groups as {role: LR multiplier}, checked against the role table `table`: an
  unknown group, a bad multiplier or a group naming no parameter of the model is one line."""
  spec = str(t.get('lr_groups', '') or '').replace(' ', '')
  if not spec:
    return {}
  valid = f'valid: GROUP:MULT,... with GROUP in {", ".join(LR_GROUPS)}, e.g. readout:2,hidden:0.5'
  out = {}
  for item in spec.split(','):
    name, _, mult = item.partition(':')
    try:
      value = float(mult)
    except ValueError:
      raise ConfigError(f'train.lr_groups={spec!r}: {item!r} is not GROUP:MULT; {valid}') from None
    if name not in LR_GROUPS or value <= 0:
      raise ConfigError(f'train.lr_groups={spec!r}: {item!r} names no group or a multiplier '
                        f'<= 0; {valid}')
    roles = set(LR_GROUPS[name])
    if table is not None and not any(i.role in roles for i in table.values()):
      raise ConfigError(f'train.lr_groups={spec!r}: group {name!r} names no parameter of this '
                        f'model (roles {", ".join(LR_GROUPS[name])}); valid: groups of its '
                        f'roles, e.g. readout needs model.tie_embeddings=False')
    out.update({r: value for r in LR_GROUPS[name]})
  return out


def decay_roles(t: Any) -> tuple[str, ...]:
  """Leaf roles that get weight decay (train.decay_roles, a comma list of DECAY_GROUPS)."""
  groups = [g for g in str(defaults.fill('train', t).decay_roles).replace(' ', '').split(',') if g]
  out = []
  for g in groups:
    if g not in DECAY_GROUPS:
      raise ConfigError(f'train.decay_roles: {g!r} is unknown; valid: {", ".join(DECAY_GROUPS)}')
    out += DECAY_GROUPS[g]
  return tuple(out)


def decay_mask(params: Any, table: dict, roles: tuple[str, ...] = params_lib.MATRIX_ROLES) -> Any:
  """True for leaves whose role in `table` (models.param_table, reparam gains too) is in `roles`.

  The default decays matrices only (kernels, embeddings, LoRA factors), never norm gains or
  biases; input- vs output-side norm gains are separate roles (the scale-vectors study,
  arXiv:2605.26895, decays them apart).
  """
  flat = flatten_dict(params)
  return unflatten_dict({k: params_lib.role_at(table, k) in roles for k in flat})


def scale_by_adam_tree_eps(b1: float, b2: float, eps: Any) -> optax.GradientTransformation:
  """optax.scale_by_adam with a per-leaf eps (same ops, so one eps everywhere == optax's).

  `eps(path)` gives a leaf's eps from its path (collection first).
  """

  def init_fn(params):
    mu = optax.tree.zeros_like(params)
    nu = optax.tree.zeros_like(params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    count_inc = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
    nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
    updates = jax.tree_util.tree_map_with_path(
        lambda path, m, v: m / (jnp.sqrt(v + 0.0) + eps(_keys(path))), mu_hat, nu_hat)
    return updates, optax.ScaleByAdamState(count=count_inc, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def scale_and_decay(lr_mult: Any, wd: Any) -> optax.GradientTransformation:
  """u <- lr_mult * u + wd * p per leaf (`lr_mult(path)`, `wd(path)`): the decay is not scaled
  by the LR multiplier."""

  def update_fn(updates, state, params):
    def leaf(path, u, p):
      k, w = lr_mult(_keys(path)), wd(_keys(path))
      u = u if k == 1.0 else jnp.asarray(k, u.dtype) * u
      return u if isinstance(w, float) and w == 0.0 else u + w * p   # w may be traced
    return jax.tree_util.tree_map_with_path(leaf, updates, params), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def _keys(path) -> tuple[str, ...]:
  return tuple(getattr(k, 'key', getattr(k, 'name', str(k))) for k in path)


def make_optimizer(t: Any, transforms: Any = None, multipliers: Any = None,
                   table: dict | None = None) -> optax.GradientTransformation:
  """The train config's optimizer (`make_chain`, with train.ema's average, inside the bad-step
  guard of train.skip_nonfinite / spike_factor) with its peak LR injected into its state."""
  def chain(peak_lr: Any = None) -> optax.GradientTransformation:
    inner = make_chain(t, transforms, multipliers, table, peak_lr)
    if ema.decay(t):   # the weights' average (sharenet/optim/ema.py), inside the guard
      inner = ema.track_ema(inner, ema.decay(t))
    if not guard.enabled(t):
      return inner
    return guard.skip_bad_steps(inner, bool(t.skip_nonfinite), float(t.spike_factor),
                                int(t.spike_window))   # sharenet/optim/guard.py

  chain()   # built once now, so that a bad config raises here rather than at init
  # float32 whatever the params' dtype: the LR must not round to a bf16 value.
  return optax.inject_hyperparams(chain, hyperparam_dtype=jnp.float32)(peak_lr=t.lr)


# rules.OptMultipliers' fields with every multiplier 1 (that module imports models).
_NO_MULTIPLIERS = types.SimpleNamespace(lr=None, eps=None, independent_wd=False, wd=None,
                                        damping=None, scion_scaled=False)

# Optimizer states whose `count` drives the LR schedule (not Adam's bias correction).
_SCHEDULE_STATES = ('ScaleByScheduleState', 'InjectStatefulHyperparamsState',
                    'InjectHyperparamsState')


def at_step(opt_state: Any, step: Any) -> Any:
  """A fresh `opt_state` whose LR schedule continues from `step` (moments stay fresh)."""
  def walk(node):
    if isinstance(node, tuple) and hasattr(node, '_fields'):   # an optax state NamedTuple
      fields = {f: walk(getattr(node, f)) for f in node._fields}
      if type(node).__name__ in _SCHEDULE_STATES:
        fields['count'] = jnp.asarray(step, jnp.asarray(node.count).dtype)
      return type(node)(**fields)
    if isinstance(node, (tuple, list)):
      return type(node)(walk(x) for x in node)
    if isinstance(node, dict):
      return {k: walk(v) for k, v in node.items()}
    return node
  return walk(opt_state)


def with_peak_lr(opt_state: Any, lr: Any) -> Any:
  """`opt_state` of `make_optimizer` continuing as if train.lr were `lr`."""
  hp = opt_state.hyperparams
  return opt_state._replace(hyperparams={**hp, 'peak_lr': jnp.asarray(lr, hp['peak_lr'].dtype)})


def make_chain(t: Any, transforms: Any = None, multipliers: Any = None,
               table: dict | None = None, peak_lr: Any = None) -> optax.GradientTransformation:
  """The optimizer at peak LR `peak_lr` (default train.lr); its LR is `lr_schedule(t, peak_lr)`.

  `transforms` (sharenet.transforms.Transforms) adds AGC / AdamP / a post-step projection;
  `multipliers` (rules.OptMultipliers) adds per-leaf LR / eps / WD multipliers. Decay
  is `lr(t) * weight_decay * wd_mult * p` (lr-coupled, independent of the per-leaf LR
  multiplier), or with `independent_wd` `(lr(t) / lr_peak) * weight_decay * wd_mult * p`, on
  the leaves whose role train.decay_roles names; roles come from `table` (models.param_table)
  or else `transforms.infos`, one of which is needed when weight_decay > 0. Leaves the
  parametrization does not know (transform gains) get multiplier 1.
  """
  roles = decay_roles(t)
  if table is None and transforms is not None:
    table = transforms.infos
  if table is None and t.weight_decay:
    raise ConfigError('make_optimizer: train.weight_decay > 0 needs the model\'s role table '
                      '(table=models.param_table(cfg) or transforms=); valid: weight_decay=0')
  if table is None:   # weight_decay == 0: nothing decays
    mask = lambda p: jax.tree.map(lambda _: False, p)
  else:
    mask = lambda p: decay_mask(p, table, roles)
  updates = transforms.updates if transforms is not None else ()
  parts = []
  if 'agc' in updates:
    parts.append(agc(transforms.agc_clip, transforms.agc_eps, transforms.infos))
  if t.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(t.grad_clip))
  if 'adamp' in updates:   # beside adamw and sp only (config/compat.py)
    parts += [scale_by_adamp(t.b1, t.b2, t.eps, t.weight_decay, mask, transforms.infos,
                             transforms.adamp_delta, transforms.adamp_wd_ratio),
              optax.scale_by_learning_rate(lr_schedule(t, peak_lr))]
  elif multipliers is None and matrix.optimizer_name(t) == 'adamw' and not lr_groups(t, table):
    parts.append(optax.adamw(lr_schedule(t, peak_lr), b1=t.b1, b2=t.b2, eps=t.eps,
                             weight_decay=t.weight_decay, mask=mask))
  else:
    parts += _multiplied(t, multipliers, table, roles, peak_lr)
  if transforms is not None and transforms.projection != 'none':
    parts.append(projection(transforms.projection, transforms.infos))
  # train.trainable: the chain on the trainable leaves only (sharenet/optim/trainable.py)
  return trainable.optimizer(optax.chain(*parts), getattr(t, 'trainable', 'all'), table)


def _multiplied(t: Any, multipliers: Any, table: dict | None, roles: tuple[str, ...],
                peak_lr: Any) -> list[optax.GradientTransformation]:
  """Direction (Adam, or train.optimizer's matrix optimizer beside Adam) -> per-leaf LR
  multipliers and decay -> the LR schedule (make_chain's docstring)."""
  if multipliers is None:   # SP: every multiplier 1
    multipliers = _NO_MULTIPLIERS
  wd = t.weight_decay / (t.lr if peak_lr is None else peak_lr) if multipliers.independent_wd \
      else t.weight_decay
  flat_lr = {} if multipliers.lr is None else flatten_dict(multipliers.lr)
  flat_eps = {} if multipliers.eps is None else flatten_dict(multipliers.eps)
  flat_wd = {} if multipliers.wd is None else flatten_dict(multipliers.wd)
  flat_damping = {} if multipliers.damping is None else flatten_dict(multipliers.damping)
  decayed = lambda path: table is not None and params_lib.role_at(table, path) in roles
  # The role mask alone decides which leaves decay; the multiplier only how strongly.
  wd_of = lambda path: wd * flat_wd.get(path, 1.0) if decayed(path) else 0.0
  eps_of = lambda path: t.eps * flat_eps.get(path, 1.0)
  groups = lr_groups(t, table)   # train.lr_groups: a multiplier per role, over the preset's
  if groups and table is None:
    raise ConfigError('train.lr_groups needs the model\'s role table (table=models.param_table('
                      'cfg) or transforms=)')
  lr_of = lambda path: flat_lr.get(path, 1.0) * (
      groups.get(params_lib.role_at(table, path), 1.0) if groups else 1.0)
  direction = scale_by_adam_tree_eps(t.b1, t.b2, eps_of)
  if matrix.optimizer_name(t) == 'scion':   # every leaf on its LMO (sharenet/optim/scion.py)
    if table is None:
      raise ConfigError('train.optimizer=scion needs the model\'s role table (table=models.'
                        'param_table(cfg) or transforms=)')
    scion.check(t)
    direction = scion.scale_by_scion(t.scion, table, multipliers.scion_scaled)
  elif matrix.optimizer_name(t) != 'adamw':
    if table is None:
      raise ConfigError(f'train.optimizer={t.optimizer} needs the model\'s role table '
                        f'(table=models.param_table(cfg) or transforms=); valid: adamw without')
    direction = matrix.matrix_transform(t, table, direction, eps_of,
                                              lambda path: flat_damping.get(path, 1.0))
  return [direction, scale_and_decay(lr_of, wd_of),
          optax.scale_by_learning_rate(lr_schedule(t, peak_lr))]

