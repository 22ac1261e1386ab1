"""train.trainable: which parameters a run trains; the others stay frozen, bit for bit.

Values: `all` (default); `lora` (the LoRA factors, role `lora`: depth-wise LoRA of a relaxed
recursive model, LoRA on an imported one); `adapters` (every per-applied-layer part, the
`per_layer` collection: depth-wise LoRA and untied norm gains, what Relaxed Recursive
Transformers relax a shared model with); a comma list of roles (sharenet/models/params.py
ROLES, e.g. `lora,norm_in`); or else a regex searched in each leaf's '/'-joined path (e.g.
`attn/q/` trains the query projections).

A frozen leaf gets no optimizer state (the optimizer is `optax.multi_transform` of the run's
chain on the trainable leaves and `set_to_zero` on the frozen ones: no Adam moments, no decay),
and no gradient: the train step stops it before the loss (`freeze`), so XLA drops the backward
work that only fed it. The chain's per-leaf rules (muP's LR, eps and decay multipliers) look
leaves up by path, so the trainable leaves keep exactly their rules. A spec that leaves nothing
to train is one ConfigError line.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import jax
import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.errors import ConfigError
from sharenet.models import params as params_lib

MODES = ('all', 'lora', 'adapters')
PER_LAYER = 'per_layer'


def _matcher(spec: str, table: Any) -> Callable[[tuple[str, ...]], bool]:
  """Whether a leaf (by path) trains under `spec`."""
  if spec == 'lora':
    return lambda path: params_lib.role_at(table, path) == 'lora'
  if spec == 'adapters':
    return lambda path: path[0] == PER_LAYER
  items = [x.strip() for x in spec.split(',') if x.strip()]
  if items and all(x in params_lib.ROLES for x in items):
    return lambda path: params_lib.role_at(table, path) in items
  try:
    pattern = re.compile(spec)
  except re.error as e:
    raise ConfigError(f'train.trainable={spec!r} is neither {", ".join(MODES)}, a role list '
                      f'({", ".join(params_lib.ROLES)}) nor a regex ({e})') from None
  return lambda path: pattern.search('/'.join(path)) is not None


def frozen_mask(spec: str, table: Any, params: Any) -> Any:
  """A tree like `params`: True where the leaf is frozen."""
  trains = _matcher(spec, table)
  return unflatten_dict({p: not trains(p) for p in flatten_dict(params)})


def check(spec: str, table: Any, params: Any) -> None:
  """One ConfigError line unless `spec` trains some leaf (and freezes one: else it is `all`)."""
  if spec == 'all':
    return
  flat = flatten_dict(frozen_mask(spec, table, params))
  if all(flat.values()):
    raise ConfigError(f'train.trainable={spec!r} matches no parameter of this model; valid: '
                      f'{", ".join(MODES)}, roles ({", ".join(params_lib.ROLES)}) or a regex '
                      f'of paths such as {"/".join(next(iter(flat)))!r}')


def optimizer(tx: optax.GradientTransformation, spec: str,
              table: Any) -> optax.GradientTransformation:
  """`tx` on the trainable leaves, zero updates and no state on the frozen ones."""
  if spec == 'all':
    return tx
  if table is None:
    raise ConfigError(f'train.trainable={spec!r} needs the model\'s role table; valid: all')
  labels = lambda p: jax.tree.map(lambda f: 'frozen' if f else 'train',
                                  frozen_mask(spec, table, p))
  return optax.multi_transform({'train': tx, 'frozen': optax.set_to_zero()}, labels)


def freeze(spec: str, table: Any, params: Any) -> Any:
  """`params` with the frozen leaves behind a stop_gradient (the train step's loss input)."""
  if spec == 'all':
    return params
  return jax.tree.map(lambda x, f: jax.lax.stop_gradient(x) if f else x, params,
                      frozen_mask(spec, table, params))
