"""Normalization methods as parameter transforms (papers in docs/references.md).

Five kinds behind one config section (`config.transforms`):
  activation norms   model.norm.* (sharenet/models/norms.py): chosen by name, not here;
  reparam            raw -> effective params inside the loss (reparam.py);
  project            post-step projection, last in the optax chain (project.py);
  update             optax transforms reading params: AGC, AdamP (update.py);
  convert            one-shot function-preserving conversions (norms: convert.py; untied ->
                     recursive: recursive.py; CLI: the top-level convert.py), and DirectShare
                     head sharing, not function-preserving (head_share.py).
"""
from __future__ import annotations

from typing import Any

from sharenet.config import defaults
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM
from sharenet.transforms import project as project_lib
from sharenet.transforms.reparam import REPARAMS, ReparamChain
from sharenet.transforms.roles import ROLES, Leaf, leaf_infos
from sharenet.transforms.update import UPDATES


def _names(value: str) -> tuple[str, ...]:
  return tuple(n for n in str(value or '').replace(' ', '').split(',') if n and n != 'none')


class Transforms:
  """The configured reparams / projection / update transforms for one model."""

  def __init__(self, tcfg: Any, model: DecoderLM):
    """`tcfg`: the `config.transforms` group (dict or ConfigDict); missing keys take defaults."""
    t = defaults.fill('transforms', tcfg)
    self.infos: dict[tuple, Leaf] = leaf_infos(model)
    self.reparam = ReparamChain(_names(t.reparam), self.infos, t.reparam_paths,
                                int(t.sigma_iters), _names(t.reparam_roles),
                                tied_embeddings=model.cfg.tie_embeddings,
                                compander_gamma=float(t.compander_gamma))
    self.projection = t.project or 'none'
    if self.projection not in project_lib.PROJECTIONS:
      raise ConfigError(f'transforms.project={self.projection!r} is unknown; valid: '
                        f'{", ".join(project_lib.PROJECTIONS)}')
    self.updates = _names(t.updates)
    for u in self.updates:
      if u not in UPDATES:
        raise ConfigError(f'transforms.updates: {u!r} is unknown; valid: {", ".join(UPDATES)}')
    self.agc_clip = float(t.agc_clip)
    self.agc_eps = float(t.agc_eps)
    self.adamp_delta = float(t.adamp_delta)
    self.adamp_wd_ratio = float(t.adamp_wd_ratio)
    cfg = model.cfg
    if self.projection == 'nap' and cfg.norm.pre_activation == 'none':
      raise ConfigError('transforms.project=nap (Normalize-and-Project) needs a norm before the '
                        'MLP nonlinearity; valid: model.norm.pre_activation=layernorm or rmsnorm '
                        '(or transforms.project=norm_project for the projection alone)')

  @property
  def reparam_names(self) -> tuple[str, ...]:
    return tuple(r.name for r in self.reparam.steps)

  @property
  def init_is_identity(self) -> bool:
    """Whether `init` returns the variables unchanged and an empty tstate."""
    return self.projection != 'ngpt' and not self.reparam

  def init(self, variables: Any) -> tuple[Any, Any]:
    """Trainable tree (+ 'reparam' extras, projected if a projection is set) and tstate."""
    if self.projection == 'ngpt':   # nGPT normalises the matrices at the start too
      variables = project_lib.project('ngpt', variables, self.infos)
    if not self.reparam:
      return variables, {}
    extras, tstate = self.reparam.init(variables)
    return {**variables, **extras}, tstate

  def effective(self, variables: Any, tstate: Any) -> Any:
    """Model variables the forward pass uses."""
    return self.reparam.apply(variables, tstate)

  def update_state(self, variables: Any, tstate: Any) -> Any:
    if not self.reparam:
      return tstate
    # Other entries of tstate (loss-free balancing's routing.BALANCE) pass through unchanged.
    return {**tstate, **self.reparam.update_state(variables, tstate)}


__all__ = ['Transforms', 'REPARAMS', 'ROLES', 'UPDATES']
