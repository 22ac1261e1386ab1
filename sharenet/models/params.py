"""Parameter roles: recorded once where each parameter is created, read by every consumer.

Every trainable leaf is created by `param` with its logical axes and a role; the role and the
few facts consumers need ride in the box beside the logical axes (`Param`, a flax
LogicallyPartitioned, so nn.scan's axis insertion keeps them). `table` flattens a boxed
variables tree into {path: ParamInfo}; muP multipliers (sharenet/parametrization/rules.py), decay
masks (sharenet/optim/chain.py), transform selection (sharenet/transforms), conversions and
accounting read that table and never decide a role from a module name.

Structure rides in the same box. The layer stack (models/stack.py) opens a `placed` context
around each plan segment and each block; `param` records from it, where the leaf is created:
  segment   the plan segment whose module created the leaf (None outside the layer stack)
  sets      a block leaf in 'params': the global stored set of each entry of its set axis
            (the leading 'layers' axis; one set and no such axis for the Python-loop baseline)
  uses      applied layers using each of those sets (the plan's `uses`)
  layers    a block leaf in PER_LAYER: the applied layer of each entry of its leading stack
            axes, flattened ('layers' / 'repeats', in applied order for every nesting)
  local     the leaf's path below its block: the key that names the same leaf in every
            segment and every plan (empty outside a block)
so no consumer decodes a module path, and renaming the stack's modules changes no result.

Roles:
  embedding   token table (vocab, embed)
  pos_embed   learned positions (length, embed)
  reader      kernel reading a normalised stream (q, k, v, MLP inputs); also the MASA atoms that
              form one (leading 'atoms' axis, sharenet/models/masa.py)
  writer      kernel whose output is added to the residual stream (attention out, MLP out), or
              MASA atoms forming one
  readout     the untied head kernel (embed, vocab)
  router      a router's output kernel (embed or mlp -> one logit per recursion or expert): a
              muP output weight, its fan-out finite (Mixture-of-Recursions' routers; model.moe's
              expert selectors, one row per expert on a leading 'experts' axis)
  lora        a depth-wise LoRA factor (A or B)
  norm_in     parameter of a norm on a branch input, or of a QK-norm
  norm_out    parameter of a norm on a branch output, or of the final norm
  bias        bias of a reader kernel or of the logits
  scalar      a free scalar (l2 QK-norm's logit scale; MASA coefficients, axis 'atoms')
  reparam     gains added by a reparameterization (the REPARAM collection)
  mpo         a local tensor of a matrix product operator kernel (sharenet/models/mpo.py): its
              shared central tensor or a layer's auxiliary one (decayed as matrices are; sp's
              rules only: the compatibility table refuses the width presets)
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax
from flax import struct
from flax.traverse_util import flatten_dict

from sharenet.errors import ConfigError

PER_LAYER = 'per_layer'   # collection scanned per applied layer while 'params' may be tied
REPARAM = 'reparam'       # collection of reparameterization gains (sharenet/transforms/reparam.py)
# Leading axes indexing separate matrices: scan axes, the MASA atom index (models/masa.py) and
# the expert index of model.moe's stacks (models/moe.py: each expert a matrix of its own fan-in).
STACK_AXES = ('layers', 'repeats', 'atoms', 'experts')
KERNEL_ROLES = ('reader', 'writer', 'readout')
MATRIX_ROLES = KERNEL_ROLES + ('embedding', 'pos_embed', 'lora', 'router')
ROLES = MATRIX_ROLES + ('norm_in', 'norm_out', 'bias', 'scalar', 'reparam', 'mpo')
NORM_ROLES = ('norm_in', 'norm_out')
Path = tuple[str, ...]


class Param(nn.LogicallyPartitioned):
  """Logical axes plus the leaf's role (see the module docstring); not part of the pytree."""
  role: str = struct.field(pytree_node=False, default='')
  num_in: int = struct.field(pytree_node=False, default=0)        # fan-in axes after stack axes
  init_std: float | None = struct.field(pytree_node=False, default=None)   # None: constant init
  branch: str | None = struct.field(pytree_node=False, default=None)   # 'attn' | 'mlp' in blocks
  writes: bool = struct.field(pytree_node=False, default=False)   # output joins the residual
  use: str | None = struct.field(pytree_node=False, default=None)  # 'query', 'key', 'gain', 'shift'
  segment: int | None = struct.field(pytree_node=False, default=None)   # structure: see above
  sets: tuple[int, ...] = struct.field(pytree_node=False, default=())
  uses: tuple[int, ...] = struct.field(pytree_node=False, default=())
  layers: tuple[int, ...] = struct.field(pytree_node=False, default=())
  local: tuple[str, ...] = struct.field(pytree_node=False, default=())


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the modules being created sit in the layer stack (module docstring)."""
  segment: int | None = None
  sets: tuple[int, ...] = ()
  uses: tuple[int, ...] = ()
  layers: tuple[int, ...] = ()
  block: tuple[str, ...] | None = None   # module path of the enclosing block


_PLACEMENT = contextvars.ContextVar('sharenet_placement', default=Placement())


@contextlib.contextmanager
def placed(**fields: Any):
  """Parameters created inside record these structure fields (Placement's)."""
  token = _PLACEMENT.set(dataclasses.replace(_PLACEMENT.get(), **fields))
  try:
    yield
  finally:
    _PLACEMENT.reset(token)


def _structure(module: nn.Module, name: str, collection: str) -> dict[str, Any]:
  """The structure fields of a leaf `name` that `module` creates in `collection` now."""
  p = _PLACEMENT.get()
  if p.block is None:   # outside a block: only the segment (routers)
    return dict(segment=p.segment)
  local = tuple(module.path[len(p.block):]) + (name,)
  if collection == 'params':
    return dict(segment=p.segment, sets=p.sets, uses=p.uses, local=local)
  return dict(segment=p.segment, layers=p.layers, local=local)


def param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...],
          role: str, *, std: float | None = None, init: Callable | None = None,
          collection: str = 'params', dtype: Any = None, num_in: int = 0,
          branch: str | None = None, writes: bool = False, use: str | None = None) -> jax.Array:
  """Creates a trainable variable in `collection` ('params' or PER_LAYER) with its role.

  `std` gives a normal(std) init (recorded as the SP init std); otherwise `init` is a constant
  initializer (zeros, ones, constant).
  """
  if role not in ROLES:
    raise ConfigError(f'parameter {name}: role {role!r} is unknown; valid: {", ".join(ROLES)}')
  if (std is None) == (init is None):
    raise ValueError(f'parameter {name}: give exactly one of std (normal init) or init')
  named = [a for a in axes if a is not None]
  if len(set(named)) != len(named):   # sharding maps each logical axis once (flax spmd)
    raise ValueError(f'parameter {name}: logical axes {tuple(axes)} repeat a name, which no '
                     f'sharding can place; give each dimension its own axis name')
  fn = nn.initializers.normal(std) if std is not None else init
  meta = dict(names=tuple(axes), role=role, num_in=num_in, init_std=std, branch=branch,
              writes=writes, use=use, **_structure(module, name, collection))
  boxed_init = lambda rng, *args: Param(fn(rng, *args), **meta)
  if collection == 'params':
    return module.param(name, boxed_init, shape, dtype)
  return module.variable(collection, name,
                         lambda: boxed_init(module.make_rng(PER_LAYER), shape, dtype)).value


@dataclasses.dataclass(frozen=True)
class ParamInfo:
  """One row of the table: a trainable leaf's path (collection first), axes, shape and role."""
  path: Path
  axes: tuple
  shape: tuple[int, ...]
  role: str
  num_in: int = 1
  init_std: float | None = None
  branch: str | None = None
  writes: bool = False
  use: str | None = None
  segment: int | None = None
  sets: tuple[int, ...] = ()
  uses: tuple[int, ...] = ()
  layers: tuple[int, ...] = ()
  local: tuple[str, ...] = ()
  dtype: Any = None   # the initialised array's dtype (None in hand-built tables)

  @property
  def key(self) -> str:
    return '/'.join(self.path)

  @property
  def num_stack(self) -> int:
    n = 0
    while n < len(self.axes) and self.axes[n] in STACK_AXES:
      n += 1
    return n

  @property
  def stack_shape(self) -> tuple[int, ...]:
    return self.shape[:self.num_stack]

  @property
  def fan_in(self) -> int:
    return math.prod(self.shape[self.num_stack:self.num_stack + self.num_in])

  @property
  def fan_out(self) -> int:
    return math.prod(self.shape[self.num_stack + self.num_in:])

  @property
  def module(self) -> Path:
    """Path of the module that created the leaf."""
    return self.path[:-1]

  def as_matrix(self, w: jax.Array) -> jax.Array:
    """(stack..., fan_in, fan_out) view of a kernel."""
    return w.reshape(self.stack_shape + (self.fan_in, self.fan_out))

  @property
  def in_block(self) -> bool:
    """A parameter of a block of the layer stack (tied across its set's uses, or per layer)."""
    return bool(self.local)

  @property
  def applications(self) -> int:
    """Applied layers one stored entry of this leaf serves (1 outside the blocks and per layer;
    the largest where a plan applies its sets unequally often)."""
    return max(self.uses, default=1)

  @property
  def num_layer_axes(self) -> int:
    """Leading axes that index stored sets ('params') or applied layers (PER_LAYER)."""
    n = 0
    while n < len(self.axes) and self.axes[n] in ('layers', 'repeats'):
      n += 1
    return n

  def embed_axis(self) -> int | None:
    """Position of the 'embed' axis (the residual-stream width), if any."""
    return self.axes.index('embed') if 'embed' in self.axes else None


def table(boxed: Any) -> dict[Path, ParamInfo]:
  """{path: ParamInfo} of a boxed variables tree ({collection: ...}, e.g. under eval_shape)."""
  out = {}
  for path, box in flatten_dict(boxed).items():
    if not isinstance(box, Param):
      raise ConfigError(f'parameter {"/".join(path)} has no role; create it with '
                        f'sharenet.models.params.param')
    out[path] = ParamInfo(path, tuple(box.names), tuple(box.value.shape), box.role, box.num_in,
                          box.init_std, box.branch, box.writes, box.use, box.segment, box.sets,
                          box.uses, box.layers, box.local, box.value.dtype)
  return out


def role_at(infos: dict[Path, ParamInfo], path: Path) -> str:
  """Role of a trainable leaf: the table's, or 'reparam' for the REPARAM collection."""
  if path in infos:
    return infos[path].role
  if path[0] == REPARAM:
    return 'reparam'
  raise ConfigError(f'parameter {"/".join(path)} is not in the model\'s role table; valid: '
                    f'leaves of the model the table was built from, or of {REPARAM!r}')
