"""The `config.parametrization` group (Settings) and the model-level scalars it sets.

The scalars a parametrization puts on the model itself (sharenet/parametrization/rules.py's module
docstring has the presets): the attention logits' multiplier, the readout logits' multiplier
(muP: 1/m_d), and under u-muP the residual rule's alphas and the unit-scaled ops
(models/unit_scale.py). ModelConfig resolves them once from its keys and its `parametrization`
(`scalars`), so the model a config describes is the model that trains; the per-leaf rules
(init, forward, LR, WD, eps multipliers) are sharenet.parametrization.rules's.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from sharenet.config import defaults
from sharenet.errors import ConfigError
from sharenet.models import unit_scale

KINDS = ('sp', 'mup', 'mup_table3', 'umup', 'completep')
LOOP_RULES = ('none', 'inv_R', 'inv_sqrt_R')
WD_MODES = ('auto', 'lr_coupled', 'independent')   # auto: independent for umup, else lr_coupled
UNTIEABLE = ('mup_table3', 'umup')           # one tensor cannot carry two roles
_DEFAULTS = defaults.default_config().parametrization


@dataclasses.dataclass(frozen=True)
class Settings:
  """The `config.parametrization` group (field = key; meanings in sharenet/config/defaults.py)."""
  kind: str = _DEFAULTS.kind
  base_d_model: int = _DEFAULTS.base_d_model      # 0 -> d_model (multipliers 1)
  base_num_heads: int = _DEFAULTS.base_num_heads  # 0 -> num_heads (head_dim scales with width)
  base_depth: int = _DEFAULTS.base_depth          # unique sets of the depth proxy; 0 -> same
  depth_alpha: float = _DEFAULTS.depth_alpha      # completep alpha (0.5: Depth-muP branch rule)
  loop_rule: str = _DEFAULTS.loop_rule
  wd_mode: str = _DEFAULTS.wd_mode
  residual_mult: float = _DEFAULTS.residual_mult              # umup tau rule
  residual_attn_ratio: float = _DEFAULTS.residual_attn_ratio  # umup tau rule
  readout_zero_init: bool = _DEFAULTS.readout_zero_init
  query_zero_init: bool = _DEFAULTS.query_zero_init
  qk_lr: float = _DEFAULTS.qk_lr                  # LR multiplier on the query and key kernels

  def validate(self) -> 'Settings':
    for field, value, valid in (('kind', self.kind, KINDS), ('loop_rule', self.loop_rule,
                                 LOOP_RULES), ('wd_mode', self.wd_mode, WD_MODES)):
      if value not in valid:
        raise ConfigError(f'parametrization.{field}={value!r} is unknown; valid: '
                          f'{", ".join(valid)}')
    for field in ('residual_mult', 'residual_attn_ratio', 'qk_lr'):
      if not getattr(self, field) > 0:
        raise ConfigError(f'parametrization.{field}={getattr(self, field)} must be > 0')
    for field in ('base_d_model', 'base_num_heads', 'base_depth'):
      if getattr(self, field) < 0:
        raise ConfigError(f'parametrization.{field}={getattr(self, field)} must be >= 0 '
                          f'(0 = same as the model)')
    return self

  @classmethod
  def from_config(cls, p: Any) -> 'Settings':
    """From a `config.parametrization` group; keys it lacks take the defaults."""
    p = defaults.fill('parametrization', p)
    return cls(**{f.name: p[f.name] for f in dataclasses.fields(cls)}).validate()

  @property
  def independent_wd(self) -> bool:
    """wd_mode resolved: 'auto' is independent for umup (u-muP's default), lr_coupled else."""
    if self.wd_mode == 'auto':
      return self.kind == 'umup'
    return self.wd_mode == 'independent'


def base_widths(cfg: Any) -> tuple[int, int]:
  """(d0, h0): d_model and num_heads of the base-width (proxy) model."""
  s = cfg.parametrization
  return s.base_d_model or cfg.d_model, s.base_num_heads or cfg.num_heads


def scalars(cfg: Any, d_head: int) -> dict[str, Any]:
  """The model-level scalars of `cfg`'s parametrization (ModelConfig's resolved fields):
  attn_mult, logits_mult, umup_residual (() = plain residual) and umup_ops. `d_head` is
  cfg's resolved head dim; the base model's follows the same rule (model.head_dim, 0 -> d0/h0).
  """
  s = cfg.parametrization
  d0, h0 = base_widths(cfg)
  m_d = cfg.d_model / d0
  if s.kind == 'sp':
    attn = cfg.attn_scale or d_head ** -0.5
  elif s.kind == 'umup':
    attn = 1.0 / d_head                     # mult / d_head with mult 1 (u-muP)
  else:
    # 1/d_head written as alpha/d_head, alpha = sqrt(dh0): SP at base (microsoft/mup README's 8/d)
    dh0 = cfg.head_dim or d0 // h0
    attn = dh0 ** -0.5 * (dh0 / d_head)
  umup = s.kind == 'umup'
  return dict(
      attn_mult=attn,
      logits_mult=1.0 / m_d if s.kind in ('mup', 'completep') else 1.0,  # MuReadout output_mult/m
      umup_residual=unit_scale.residual_alphas(s.residual_mult, s.residual_attn_ratio)
      if umup else (),
      umup_ops=umup)


def check(cfg: Any) -> None:
  """ConfigError for a parametrization setting out of range. Settings that refuse a model
  feature are the compatibility table's (config/compat.py), checked where ModelConfig is built."""
  cfg.parametrization.validate()


def base_config(cfg: Any) -> Any:
  """The base-width (proxy) model: d_model, mlp_dim and heads scaled together; depth kept."""
  d0, h0 = base_widths(cfg)
  if (cfg.mlp_dim * d0) % cfg.d_model or (cfg.kv_heads * h0) % cfg.num_heads:
    raise ConfigError(f'parametrization.base_d_model={d0}: mlp_dim {cfg.mlp_dim} x {d0} / '
                      f'd_model {cfg.d_model} (and kv heads) must be integers; valid: base widths '
                      f'dividing the model evenly')
  kv0 = cfg.kv_heads * h0 // cfg.num_heads
  e = cfg.moe.expert_dim   # experts are hidden matrices: their width scales with mlp_dim's
  if (e * d0) % cfg.d_model:
    raise ConfigError(f'parametrization.base_d_model={d0}: model.moe.expert_dim {e} x {d0} / '
                      f'd_model {cfg.d_model} must be an integer; valid: base widths dividing '
                      f'the model evenly')
  if (cfg.embed_dim * d0) % cfg.d_model:   # a factorized table's width scales with d_model
    raise ConfigError(f'model.embed_dim={cfg.embed_dim} at the base width {d0}: embed_dim x '
                      f'{d0} / d_model {cfg.d_model} must be an integer (E scales with the '
                      f'width); valid: an embed_dim the base width divides evenly')
  columns = cfg.bank.size // cfg.d_model   # the bank's columns scale with the width
  if (columns * d0) % cfg.d_model:
    raise ConfigError(f'model.bank.size={cfg.bank.size} at the base width {d0}: its '
                      f'{columns} columns x {d0} / d_model {cfg.d_model} must be an integer '
                      f'(the columns scale with the width); valid: a bank the base width '
                      f'divides evenly')
  try:
    return cfg.derive(d_model=d0, num_heads=h0, num_kv_heads=kv0 if cfg.num_kv_heads else 0,
                      mlp_dim=cfg.mlp_dim * d0 // cfg.d_model,
                      embed_dim=cfg.embed_dim * d0 // cfg.d_model,
                      moe={'expert_dim': e * d0 // cfg.d_model},
                      bank={'size': d0 * (columns * d0 // cfg.d_model)})
  except ConfigError as e:
    raise ConfigError(f'parametrization base model (base_d_model={d0}, base_num_heads={h0}): '
                      f'{e}') from None
