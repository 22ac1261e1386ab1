"""The nested sections of `config.model` (norm, sharing, routing, masa, recurrence) as frozen
dataclasses.

Each field is named as its key and defaults to the default config's value there
(sharenet/config/defaults.py, the one table); each section checks its own choices and ranges when it
is built. Checks that need other sections, and the values the sentinels resolve to, are the
ModelConfig's (models/config.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from sharenet.config import migrations, defaults
from sharenet.errors import ConfigError

NORMS = ('layernorm', 'rmsnorm', 'crmsnorm', 'scalenorm', 'dyt', 'none', 'lpnorm', 'powernorm',
         'unified_norm', 'online_norm')
# Norms whose statistics are carried across steps (sharenet/models/norm_stats.py)
STATS_NORMS = ('powernorm', 'unified_norm', 'online_norm')
ONLINE_ECMS = ('ac', 'ls', 'none')
PLACEMENTS = ('pre', 'post', 'peri', 'moeut')
QK_NORMS = ('none', 'rms', 'l2')
PRE_ACTIVATION_NORMS = ('none', 'layernorm', 'rmsnorm')
LORA_TARGETS = ('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out')
LORA_LAYERS = ('shared', 'all')
LORA_ZERO = ('b', 'a')      # which depth-wise LoRA factor starts at zero
ROUTINGS = ('none', 'expert_choice', 'token_choice')
ROUTERS = ('linear', 'mlp')
BALANCINGS = ('loss', 'bias')
MASA_TARGETS = ('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out')
DEPTHS = ('fixed', 'poisson_lognormal')
INJECTIONS = ('none', 'add', 'concat')
ROPE_SCALINGS = ('none', 'linear', 'llama3')
STATE_INITS = ('embed', 'zeros', 'normal')
MOE_KINDS = ('none', 'sigma_moe', 'switch')
MOE_DISPATCHES = ('auto', 'ragged_dot', 'reference')
MOE_ATTENTIONS = ('none', 'switchhead')
_DEFAULTS = defaults.default_config().model


def choice(field: str, value: Any, valid: tuple[str, ...]) -> None:
  """ConfigError unless `value` is one of `valid` (naming the new value of a renamed one)."""
  if value not in valid:
    renamed = migrations.RENAMED_VALUES.get(field, {})
    new = renamed.get(value) if isinstance(value, str) else None
    if new:
      raise ConfigError(f'{field}={value!r} was renamed: use {new[0]} ({new[1]})')
    raise ConfigError(f'{field}={value!r} is unknown; valid: {", ".join(valid)}')


def parse_targets(value: Any) -> tuple[str, ...]:
  """A comma list ('q,v') or a sequence of kernel names, as a tuple."""
  if isinstance(value, str):
    return tuple(t for t in value.replace(' ', '').split(',') if t)
  return tuple(value)


def key(path: str, parse: Callable[[Any], Any] | None = None,
        unparse: Callable[[Any], Any] | None = None) -> Any:
  """A field read from `config.model.<path>`; its default is the default config's value there."""
  value = _DEFAULTS
  for k in path.split('.'):
    value = value[k]
  default = parse(value) if parse else value
  return dataclasses.field(default=default,
                           metadata={'key': path, 'parse': parse, 'unparse': unparse})


def section(cls: type) -> Any:
  """A field holding the section `cls` of `config.model.<name>` (defaults: its own)."""
  return dataclasses.field(default_factory=cls, metadata={'key': cls.KEY, 'section': cls})


def _set(obj: Any, name: str, value: Any) -> None:
  object.__setattr__(obj, name, value)   # frozen: only __post_init__ normalises a field


@dataclasses.dataclass(frozen=True)
class NormConfig:
  """`config.model.norm`: activation norms, their placement, QK-norm, FixNorm, NaP's norm."""
  KEY = 'norm'
  kind: str = key('norm.kind')
  placement: str = key('norm.placement')
  qk_norm: str = key('norm.qk_norm')
  qk_scale_init: float = key('norm.qk_scale_init')
  qk_norm_len: int = key('norm.qk_norm_len')
  dyt_alpha: float = key('norm.dyt_alpha')
  fixnorm: bool = key('norm.fixnorm')
  pre_activation: str = key('norm.pre_activation')
  eps: float = key('norm.eps')
  p: float = key('norm.p')
  stats_momentum: float = key('norm.stats_momentum')
  stats_grad_momentum: float = key('norm.stats_grad_momentum')
  stats_warmup: int = key('norm.stats_warmup')
  groups: int = key('norm.groups')
  stats_window: int = key('norm.stats_window')
  outlier_filter: bool = key('norm.outlier_filter')
  online_ecm: str = key('norm.online_ecm')

  def __post_init__(self):
    choice('model.norm.kind', self.kind, NORMS)
    choice('model.norm.online_ecm', self.online_ecm, ONLINE_ECMS)
    for name in ('stats_momentum', 'stats_grad_momentum'):
      if not 0 <= float(getattr(self, name)) < 1:
        raise ConfigError(f'model.norm.{name}={getattr(self, name)} must be in [0, 1) (an EMA '
                          f'coefficient); valid: e.g. 0.9')
    if int(self.stats_warmup) < 0 or int(self.groups) < 1 or int(self.stats_window) < 1:
      raise ConfigError(f'model.norm.stats_warmup={self.stats_warmup} must be >= 0, '
                        f'model.norm.groups={self.groups} and model.norm.stats_window='
                        f'{self.stats_window} >= 1')
    if not float(self.p) > 0:
      raise ConfigError(f'model.norm.p={self.p} must be > 0 (the Lp norm divides by the p-th '
                        f'root of the p-th absolute moment); valid: a positive float, e.g. 1 or 2')
    choice('model.norm.placement', self.placement, PLACEMENTS)
    choice('model.norm.qk_norm', self.qk_norm, QK_NORMS)
    choice('model.norm.pre_activation', self.pre_activation, PRE_ACTIVATION_NORMS)


@dataclasses.dataclass(frozen=True)
class SharingConfig:
  """`config.model.sharing`: the plan's keys (checked by sharing.make_plan) and depth-wise LoRA.

  lora_targets is a tuple (a comma list is read as one)."""
  KEY = 'sharing'
  scheme: str = key('sharing.scheme')
  num_unique: int = key('sharing.num_unique')
  repeats: int = key('sharing.repeats')
  pattern: str = key('sharing.pattern')
  untie_norms: bool = key('sharing.untie_norms')
  lora_rank: int = key('sharing.lora_rank')
  lora_targets: tuple[str, ...] = key('sharing.lora_targets', parse_targets, ','.join)
  lora_scale: float = key('sharing.lora_scale')
  lora_layers: str = key('sharing.lora_layers')
  lora_zero: str = key('sharing.lora_zero')

  def __post_init__(self):
    _set(self, 'lora_targets', parse_targets(self.lora_targets))
    for t in self.lora_targets:
      choice('model.sharing.lora_targets', t, LORA_TARGETS)
    choice('model.sharing.lora_layers', self.lora_layers, LORA_LAYERS)
    choice('model.sharing.lora_zero', self.lora_zero, LORA_ZERO)
    if self.lora_rank < 0:
      raise ConfigError(f'model.sharing.lora_rank={self.lora_rank} must be >= 0')


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
  """`config.model.routing`: Mixture-of-Recursions (docs/routing.md). The keys besides `kind`
  are checked only when routed; what their sentinels resolve to is the ModelConfig's."""
  KEY = 'routing'
  kind: str = key('routing.kind')
  capacity: str = key('routing.capacity')
  router: str = key('routing.router')
  alpha: float = key('routing.alpha')
  aux_loss: float = key('routing.aux_loss')
  z_loss: float = key('routing.z_loss')
  buckets: int = key('routing.buckets')
  balancing: str = key('routing.balancing')
  bias_rate: float = key('routing.bias_rate')

  def __post_init__(self):
    choice('model.routing.kind', self.kind, ROUTINGS)
    if self.kind == 'none':
      return
    choice('model.routing.router', self.router, ROUTERS)
    choice('model.routing.balancing', self.balancing, BALANCINGS)
    if self.kind == 'token_choice' and self.capacity.strip():
      raise ConfigError(f'model.routing.capacity={self.capacity!r}: token_choice picks '
                        f'each token\'s depth itself; valid: \'\' (capacity is expert_choice\'s)')
    if self.buckets and self.kind != 'expert_choice':
      raise ConfigError(f'model.routing.buckets={self.buckets}: buckets group expert '
                        f'choice\'s recursions (token choice is one scan already); valid: 0')
    if self.alpha < 0:
      raise ConfigError(f'model.routing.alpha={self.alpha} must be >= 0 (0: default)')
    for name in ('aux_loss', 'z_loss'):
      value = getattr(self, name)
      if value < 0 and value != -1:
        raise ConfigError(f'model.routing.{name}={value} must be >= 0, or -1 (the default '
                          f'coefficient)')
    if self.balancing == 'bias' and self.kind != 'token_choice':
      raise ConfigError('model.routing.balancing=bias balances token choice\'s exit depths; '
                        'expert choice fixes its capacities; valid: loss')
    if not self.bias_rate > 0:
      raise ConfigError(f'model.routing.bias_rate={self.bias_rate} must be > 0')


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
  """`config.model.rope_scaling`: RoPE's frequencies for a longer context (models/positions.py).
  kind linear divides every frequency by `factor` (position interpolation, arXiv:2306.15595);
  llama3 divides only the low ones, keeps the high ones and interpolates between them (Llama
  3.1's rope_type llama3, as Hugging Face transformers computes it); none: unscaled."""
  KEY = 'rope_scaling'
  kind: str = key('rope_scaling.kind')
  factor: float = key('rope_scaling.factor', float)
  low_freq_factor: float = key('rope_scaling.low_freq_factor', float)
  high_freq_factor: float = key('rope_scaling.high_freq_factor', float)
  original_max_len: int = key('rope_scaling.original_max_len')

  def __post_init__(self):
    choice('model.rope_scaling.kind', self.kind, ROPE_SCALINGS)
    if self.kind == 'none':
      return
    if not self.factor >= 1:
      raise ConfigError(f'model.rope_scaling.factor={self.factor} must be >= 1 (the context '
                        f'is stretched, not shrunk)')
    if self.kind == 'llama3':
      if not 0 < self.low_freq_factor < self.high_freq_factor:
        raise ConfigError(f'model.rope_scaling: low_freq_factor={self.low_freq_factor} and '
                          f'high_freq_factor={self.high_freq_factor}; valid: 0 < low < high')
      if self.original_max_len < 1:
        raise ConfigError(f'model.rope_scaling.original_max_len={self.original_max_len} must '
                          f'be >= 1 (the context the model was trained at)')


def _kernel_targets(section: Any, name: str, switch: str) -> None:
  """A kernel-target section's targets read as a tuple and checked: each a kernel type, and
  some named when its `switch` (a count: atoms, size, cores) is on."""
  _set(section, 'targets', parse_targets(section.targets))
  for t in section.targets:
    choice(f'model.{name}.targets', t, MASA_TARGETS)
  on = getattr(section, switch)
  if on and not section.targets:
    raise ConfigError(f'model.{name}.{switch}={on} with no model.{name}.targets; valid: a '
                      f'comma list of {",".join(MASA_TARGETS)}')


@dataclasses.dataclass(frozen=True)
class MasaConfig:
  """`config.model.masa`: MASA, matrix atom sharing (arXiv:2508.04581). targets is a tuple (a
  comma list is read as one)."""
  KEY = 'masa'
  atoms: int = key('masa.atoms')
  targets: tuple[str, ...] = key('masa.targets', parse_targets, ','.join)

  def __post_init__(self):
    if self.atoms < 0:
      raise ConfigError(f'model.masa.atoms={self.atoms} must be >= 0 (0 = off)')
    _kernel_targets(self, 'masa', 'atoms')


@dataclasses.dataclass(frozen=True)
class BankConfig:
  """`config.model.bank`: the parameter bank of Shapeshifter Networks (arXiv:2006.10598;
  models/bank.py). targets is a tuple (a comma list is read as one). What needs d_model (the
  size a multiple of it, at least the largest template) is the ModelConfig's check."""
  KEY = 'bank'
  size: int = key('bank.size')
  targets: tuple[str, ...] = key('bank.targets', parse_targets, ','.join)

  def __post_init__(self):
    if self.size < 0:
      raise ConfigError(f'model.bank.size={self.size} must be >= 0 (0 = off)')
    _kernel_targets(self, 'bank', 'size')


@dataclasses.dataclass(frozen=True)
class MpoConfig:
  """`config.model.mpo`: matrix product operator kernels with the central tensor shared across
  layers (MPOBERT; models/mpo.py). targets is a tuple (a comma list is read as one). The bond's
  cap against the kernels' full bonds is the ModelConfig's check."""
  KEY = 'mpo'
  cores: int = key('mpo.cores')
  bond: int = key('mpo.bond')
  targets: tuple[str, ...] = key('mpo.targets', parse_targets, ','.join)

  def __post_init__(self):
    if self.cores == 1 or self.cores < 0:
      raise ConfigError(f'model.mpo.cores={self.cores}: a chain of one tensor is the matrix '
                        f'itself; valid: 0 (off) or >= 2')
    if self.bond < 0:
      raise ConfigError(f'model.mpo.bond={self.bond} must be >= 0 (0 = full)')
    _kernel_targets(self, 'mpo', 'cores')


@dataclasses.dataclass(frozen=True)
class RecurrenceConfig:
  """`config.model.recurrence`: recurrent depth over the plan's looped segment
  (docs/loops.md; Geiping et al., arXiv:2502.05171). What needs the plan (a looped segment,
  backprop against the depth, per-layer parts) is the ModelConfig's check."""
  KEY = 'recurrence'
  depth: str = key('recurrence.depth')
  mean: float = key('recurrence.mean', float)
  backprop: int = key('recurrence.backprop')
  injection: str = key('recurrence.injection')
  init: str = key('recurrence.init')
  ode_step: bool = key('recurrence.ode_step')

  def __post_init__(self):
    _set(self, 'mean', float(self.mean))
    choice('model.recurrence.depth', self.depth, DEPTHS)
    choice('model.recurrence.injection', self.injection, INJECTIONS)
    choice('model.recurrence.init', self.init, STATE_INITS)
    if self.mean != 0 and self.mean < 1:
      raise ConfigError(f'model.recurrence.mean={self.mean}: a depth below 1 loop; valid: '
                        f'>= 1, or 0 (the plan\'s loops R)')
    if self.depth == 'fixed' and self.mean != int(self.mean):
      raise ConfigError(f'model.recurrence.mean={self.mean}: a fixed depth is a whole number '
                        f'of loops; valid: an integer >= 1, or depth=poisson_lognormal')
    if self.backprop < 0:
      raise ConfigError(f'model.recurrence.backprop={self.backprop}; valid: 0 (every loop) or '
                        f'k >= 1 (the last k loops carry gradient)')
    if self.depth == 'poisson_lognormal' and not self.backprop:
      raise ConfigError('model.recurrence.depth=poisson_lognormal needs backprop=k >= 1 (the '
                        'loops with gradient, one compiled program for every depth); valid: '
                        'backprop between 1 and mean')
    if self.injection == 'none' and self.init != 'embed':
      raise ConfigError(f'model.recurrence.init={self.init!r} with injection=none: the input '
                        f'would never reach the loops; valid: init=embed, or injection=add|concat')

  @property
  def is_default(self) -> bool:
    """The plan's loops, all with gradient, no injection: the model without recurrence."""
    return (self.depth, self.mean, self.backprop, self.injection, self.init,
            self.ode_step) == ('fixed', 0.0, 0, 'none', 'embed', False)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """`config.model.moe`: experts inside the blocks (docs/experts.md). The feed-forward keys are
  checked only with kind != none, the attention keys only with attention=switchhead
  (models/switchhead.py), lora_experts (Mixture of LoRAs, models/lora_experts.py) with the
  model's LoRA keys (models/expert_checks.py). What needs the rest of the model
  (mlp_dim, the MLP's LoRA / MASA targets, the mesh) is the ModelConfig's or sharding's."""
  KEY = 'moe'
  kind: str = key('moe.kind')
  num_experts: int = key('moe.num_experts')
  top_k: int = key('moe.top_k')
  expert_dim: int = key('moe.expert_dim')
  router_per_layer: bool = key('moe.router_per_layer', bool)
  entropy_reg: float = key('moe.entropy_reg', float)
  balance_loss: float = key('moe.balance_loss', float)
  capacity_factor: float = key('moe.capacity_factor', float)
  dispatch: str = key('moe.dispatch')
  attention: str = key('moe.attention')
  attention_experts: int = key('moe.attention_experts')
  attention_top_k: int = key('moe.attention_top_k')
  attention_entropy_reg: float = key('moe.attention_entropy_reg', float)
  lora_experts: int = key('moe.lora_experts')

  def __post_init__(self):
    choice('model.moe.kind', self.kind, MOE_KINDS)
    choice('model.moe.attention', self.attention, MOE_ATTENTIONS)
    if self.kind != 'none' or self.attention != 'none':
      choice('model.moe.dispatch', self.dispatch, MOE_DISPATCHES)
    if self.attention != 'none' and not 1 <= self.attention_top_k <= self.attention_experts:
      raise ConfigError(f'model.moe.attention_top_k={self.attention_top_k} with '
                        f'attention_experts={self.attention_experts}; valid: attention_experts '
                        f'>= 1 and attention_top_k in 1..{max(self.attention_experts, 1)}')
    if self.attention_entropy_reg < 0:
      raise ConfigError(f'model.moe.attention_entropy_reg={self.attention_entropy_reg} must be '
                        f'>= 0 (0 = off)')
    if self.lora_experts < 0:
      raise ConfigError(f'model.moe.lora_experts={self.lora_experts} must be >= 0 (0 = off)')
    if self.kind == 'none':
      if self.router_per_layer:
        raise ConfigError('model.moe.router_per_layer=True gives the experts\' selector one '
                          'copy per applied layer, and model.moe.kind=none has no experts; '
                          f'valid: model.moe.kind in {", ".join(k for k in MOE_KINDS if k != "none")}')
      return
    if self.num_experts < 1:
      raise ConfigError(f'model.moe.num_experts={self.num_experts} must be >= 1')
    if not 0 <= self.top_k <= self.num_experts:
      raise ConfigError(f'model.moe.top_k={self.top_k} with num_experts={self.num_experts}; '
                        f'valid: 1..{self.num_experts}, or 0 (the kind\'s default)')
    if self.kind == 'switch' and self.top_k not in (0, 1):
      raise ConfigError(f'model.moe.top_k={self.top_k}: switch routes each token to one '
                        f'expert; valid: 0 or 1 (sigma_moe for top-k)')
    if self.expert_dim < 0:
      raise ConfigError(f'model.moe.expert_dim={self.expert_dim} must be >= 0 (0: mlp_dim // '
                        f'top_k)')
    for name in ('entropy_reg', 'balance_loss'):
      if getattr(self, name) < 0:
        raise ConfigError(f'model.moe.{name}={getattr(self, name)} must be >= 0 (0 = off)')
    if not self.capacity_factor > 0:
      raise ConfigError(f'model.moe.capacity_factor={self.capacity_factor} must be > 0')

  @property
  def aux(self) -> bool:
    """Whether the forward pass collects an aux loss (models/lm.py sows it as MOE): the
    feed-forward experts' entropy / balancing loss, or SwitchHead's selection entropy (with
    more than one attention expert and attention_entropy_reg > 0)."""
    return self.kind != 'none' or (self.attention == 'switchhead' and self.attention_experts > 1
                                   and self.attention_entropy_reg > 0)

  @property
  def k(self) -> int:
    """Experts each token runs (top_k, 0 -> the kind's: switch 1, sigma_moe 2 capped at
    num_experts)."""
    return self.top_k or (1 if self.kind == 'switch' else min(2, self.num_experts))


SECTIONS = (NormConfig, SharingConfig, RoutingConfig, MasaConfig, BankConfig, MpoConfig,
            RecurrenceConfig, MoeConfig, RopeScalingConfig)
