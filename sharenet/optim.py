"""Optax chain: [AGC] -> clipping -> AdamW or AdamP (role-masked decay) -> [projection]."""
from __future__ import annotations

from typing import Any

import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.errors import ConfigError
from sharenet.transforms import roles as roles_lib

SCHEDULES = ('wsd', 'cosine', 'constant')
# Role groups accepted by train.decay_roles; 'matrices' = every kernel, embedding and LoRA factor.
DECAY_GROUPS = {'matrices': roles_lib.MATRIX_ROLES, 'norm_in': ('norm_in',),
                'norm_out': ('norm_out',), 'bias': ('bias',), 'scalar': ('scalar',),
                'reparam': ('reparam',)}


def lr_schedule(t: Any) -> optax.Schedule:
  """Linear warmup, then constant / cosine / warmup-stable-decay (linear cooldown)."""
  if t.schedule not in SCHEDULES:
    raise ConfigError(f'train.schedule={t.schedule!r} is unknown; valid: {", ".join(SCHEDULES)}')
  peak, floor = t.lr, t.lr * t.min_lr_ratio
  warmup = min(t.warmup_steps, t.steps)
  if t.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(t.steps, warmup + 1), floor)
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  if t.schedule == 'constant':
    return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
  decay = max(1, int(t.decay_fraction * t.steps))
  stable = max(t.steps - decay, warmup)
  return optax.join_schedules(
      [warm, optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
      [warmup, stable])


def decay_roles(t: Any) -> tuple[str, ...]:
  """Leaf roles that get weight decay (train.decay_roles, a comma list of DECAY_GROUPS)."""
  groups = [g for g in str(t.get('decay_roles', 'matrices')).replace(' ', '').split(',') if g]
  out = []
  for g in groups:
    if g not in DECAY_GROUPS:
      raise ConfigError(f'train.decay_roles: {g!r} is unknown; valid: {", ".join(DECAY_GROUPS)}')
    out += DECAY_GROUPS[g]
  return tuple(out)


def decay_mask(params: Any, roles: tuple[str, ...] = roles_lib.MATRIX_ROLES) -> Any:
  """True for leaves whose role (sharenet.transforms.roles.role_of) is in `roles`.

  The default decays matrices only (kernels, embeddings, LoRA factors), never norm gains or
  biases; input- vs output-side norm gains are separate roles (reference B16, pitfall C5.6).
  """
  flat = flatten_dict(params)
  return unflatten_dict({k: roles_lib.role_of(k) in roles for k in flat})


def make_optimizer(t: Any, transforms: Any = None) -> optax.GradientTransformation:
  """The train config's optimizer (plus `transforms`' update / projection parts).

  Its learning rate is reported by `lr_schedule(t)`.
  """
  roles = decay_roles(t)
  mask = lambda p: decay_mask(p, roles)
  updates = transforms.updates if transforms is not None else ()
  parts = []
  if 'agc' in updates:
    from sharenet.transforms.update import agc
    parts.append(agc(transforms.agc_clip, transforms.agc_eps, transforms.infos))
  if t.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(t.grad_clip))
  if 'adamp' in updates:
    from sharenet.transforms.update import scale_by_adamp
    parts += [scale_by_adamp(t.b1, t.b2, t.eps, t.weight_decay, mask, transforms.infos,
                             transforms.adamp_delta, transforms.adamp_wd_ratio),
              optax.scale_by_learning_rate(lr_schedule(t))]
  else:
    parts.append(optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                             weight_decay=t.weight_decay, mask=mask))
  if transforms is not None and transforms.projection != 'none':
    from sharenet.transforms.project import projection
    parts.append(projection(transforms.projection, transforms.infos))
  return optax.chain(*parts)
