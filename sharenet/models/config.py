"""ModelConfig: the frozen, validated model hyper-parameters the modules read."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from sharenet import defaults, sharing
from sharenet.errors import ConfigError
from sharenet.kernels import ATTENTIONS, DENSE_GRADS, KERNELS

NORMS = ('layernorm', 'rmsnorm', 'crmsnorm', 'scalenorm', 'dyt', 'none')
PLACEMENTS = ('pre', 'post', 'peri')
QK_NORMS = ('none', 'rms', 'l2')
PRE_ACTIVATION_NORMS = ('none', 'layernorm', 'rmsnorm')
MLPS = ('swiglu', 'gelu')
POSITIONS = ('rope', 'learned', 'none')
LOWERINGS = ('nested', 'flat')
REMATS = ('none', 'full', 'dots', 'dots_no_batch', 'save_names', 'offload_dots', 'except_attn')
DTYPES = ('float32', 'bfloat16', 'float64')
LORA_TARGETS = ('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out')
LORA_LAYERS = ('shared', 'all')
LORA_ZERO = ('b', 'a')      # which depth-wise LoRA factor starts at zero
ROUTINGS = ('none', 'expert_choice', 'token_choice')
ROUTED_SCHEMES = ('cycle', 'middle_cycle')   # Mixture-of-Recursions routes these (its code too)
ROUTERS = ('linear', 'mlp')
BALANCINGS = ('loss', 'bias')
# Sub-layer sharing (docs/sublayer_sharing.md): which attention projections are one.
ATTENTION_SHARINGS = ('none', 'kv_shared', 'qk_shared', 'qkv_shared')
# The projections each sharing mode stores (kv_shared: values are the keys; qk_shared: queries
# are the keys; qkv_shared: one projection, stored as 'k').
STORED_PROJECTIONS = {'none': ('q', 'k', 'v'), 'kv_shared': ('q', 'k'),
                      'qk_shared': ('k', 'v'), 'qkv_shared': ('k',)}
MASA_TARGETS = ('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out')
_DEFAULTS = defaults.default_config().model
_TRAIN_SEQ_LEN = defaults.default_config().train.seq_len


def _choice(field: str, value: Any, valid: tuple[str, ...]) -> None:
  if value not in valid:
    new = defaults.RENAMED_VALUES.get(field, {}).get(value) if isinstance(value, str) else None
    if new:
      raise ConfigError(f'{field}={value!r} was renamed: use {new[0]} ({new[1]})')
    raise ConfigError(f'{field}={value!r} is unknown; valid: {", ".join(valid)}')


def _targets(value: Any) -> tuple[str, ...]:
  if isinstance(value, str):
    return tuple(t for t in value.replace(' ', '').split(',') if t)
  return tuple(value)


def _key(path: str, parse: Callable[[Any], Any] | None = None,
         unparse: Callable[[Any], Any] | None = None) -> Any:
  """A field read from `config.model.<path>`; its default is the default config's value there."""
  value = _DEFAULTS
  for k in path.split('.'):
    value = value[k]
  default = parse(value) if parse else value
  return dataclasses.field(default=default,
                           metadata={'key': path, 'parse': parse, 'unparse': unparse})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder LM hyper-parameters (num_layers counts *applied* layers).

  Each field names its `config.model` key (meanings in sharenet/defaults.py); that one table
  gives `from_config`, its inverse `to_config` and the defaults.
  """
  vocab_size: int = _key('vocab_size')
  d_model: int = _key('d_model')
  num_layers: int = _key('num_layers')
  num_heads: int = _key('num_heads')
  num_kv_heads: int = _key('num_kv_heads')
  mlp_dim: int = _key('mlp_dim')
  mlp: str = _key('mlp')
  position: str = _key('position')
  rope_base: float = _key('rope_base')
  max_len: int = _key('max_len')
  attn_scale: float = _key('attn_scale')
  logits_mult: float = 1.0         # set by the parametrization (muP readout: 1/m), not a key
  # Set by parametrization.kind=umup, not keys: u-muP residual rule (alpha_attn, alpha_mlp),
  # () = plain residual; umup_ops: unit-scaled attention and MLP nonlinearity
  # (sharenet/models/unit_scale.py).
  umup_residual: tuple[float, ...] = ()
  umup_ops: bool = False
  tie_embeddings: bool = _key('tie_embeddings')
  embed_init_std: float = _key('embed_init_std')
  norm: str = _key('norm.kind')
  norm_placement: str = _key('norm.placement')
  qk_norm: str = _key('norm.qk_norm')
  norm_eps: float = _key('norm.eps')
  dyt_alpha: float = _key('norm.dyt_alpha')
  qk_scale_init: float = _key('norm.qk_scale_init')
  qk_norm_len: int = _key('norm.qk_norm_len')
  fixnorm: bool = _key('norm.fixnorm')
  pre_activation_norm: str = _key('norm.pre_activation')
  center_embedding: bool = _key('center_embedding')
  reader_bias: bool = _key('reader_bias')
  head_dim_override: int = _key('head_dim')
  scheme: str = _key('sharing.scheme')
  num_unique: int = _key('sharing.num_unique')
  repeats: int = _key('sharing.repeats')
  pattern: str = _key('sharing.pattern')
  untie_norms: bool = _key('sharing.untie_norms')
  lora_rank: int = _key('sharing.lora_rank')
  lora_targets: tuple[str, ...] = _key('sharing.lora_targets', _targets, ','.join)
  lora_scale: float = _key('sharing.lora_scale')
  lora_layers: str = _key('sharing.lora_layers')
  lora_zero: str = _key('sharing.lora_zero')
  remat: str = _key('remat')
  scan_unroll: int = _key('scan_unroll')
  scan_layers: bool = _key('scan_layers')
  scan_split_transpose: bool = _key('scan_split_transpose')
  scan_lowering: str = _key('scan_lowering')
  dtype: str = _key('dtype')
  param_dtype: str = _key('param_dtype')
  kernels: str = _key('kernels')
  dense_grad: str = _key('dense_grad')
  attention: str = _key('attention')
  routing: str = _key('routing.kind')
  routing_capacity: str = _key('routing.capacity')
  routing_router: str = _key('routing.router')
  routing_alpha: float = _key('routing.alpha')
  routing_aux_loss: float = _key('routing.aux_loss')
  routing_z_loss: float = _key('routing.z_loss')
  routing_balancing: str = _key('routing.balancing')
  routing_bias_rate: float = _key('routing.bias_rate')
  routing_buckets: int = _key('routing.buckets')
  attention_sharing: str = _key('attention_sharing')
  masa_atoms: int = _key('masa.atoms')
  masa_targets: tuple[str, ...] = _key('masa.targets', _targets, ','.join)

  @property
  def head_dim(self) -> int:
    return self.head_dim_override or self.d_model // self.num_heads

  @property
  def qk_len(self) -> int:
    """L of the l2 QK-norm gain init log2(L^2 - L): the training sequence length.

    model.norm.qk_norm_len, which from_config fills from train.seq_len; still 0 only in a
    ModelConfig built without a train section (benchmarks, tests), which takes the default
    config's train.seq_len.
    """
    return self.qk_norm_len or _TRAIN_SEQ_LEN

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def values_are_keys(self) -> bool:
    """V is the key projection (kv_shared, qkv_shared): the KV cache holds K only."""
    return self.attention_sharing in ('kv_shared', 'qkv_shared')

  @property
  def projections(self) -> tuple[str, ...]:
    """The attention and MLP kernels a block stores (names of `lora_targets` / masa targets)."""
    return STORED_PROJECTIONS[self.attention_sharing] + ('o', 'mlp_in', 'mlp_out')

  @property
  def masa(self) -> tuple[str, ...]:
    """Kernels formed from shared MASA atoms (empty when model.masa.atoms = 0)."""
    return self.masa_targets if self.masa_atoms else ()

  @property
  def plan(self) -> sharing.SharingPlan:
    return sharing.make_plan(self.scheme, self.num_layers, self.num_unique, self.repeats,
                             self.pattern)

  @property
  def routed_segment(self) -> int | None:
    """Index of the plan segment whose recursions are routed (None without routing)."""
    if self.routing == 'none':
      return None
    return 1 if self.scheme == 'middle_cycle' else 0

  @property
  def recursions(self) -> int:
    """R: passes through the routed segment's K stored sets."""
    return self.plan.segments[self.routed_segment].repeats

  @property
  def capacities(self) -> tuple[float, ...]:
    """Expert choice: fraction of the sequence kept at each recursion ('' -> (R - r) / R)."""
    R = self.recursions
    if not self.routing_capacity.strip():
      return tuple((R - r) / R for r in range(R))
    try:
      return tuple(float(c) for c in self.routing_capacity.replace(' ', '').split(',') if c)
    except ValueError:
      raise ConfigError(f'model.routing.capacity={self.routing_capacity!r}: expected a comma '
                        f'list of {R} fractions, e.g. "1,0.5"') from None

  def capacity_tokens(self, seq_len: int) -> tuple[int, ...]:
    """Expert choice: k_r = max(1, int(c_r * T)) tokens kept at recursion r (the reference's
    rule, applied to the full sequence length T)."""
    return tuple(max(1, int(c * seq_len)) for c in self.capacities)

  @property
  def expert_buckets(self) -> tuple[tuple[int, ...], ...]:
    """Expert choice: the recursions grouped into the scans that run them. buckets=0: one per
    recursion (each at its own k_r); n: n contiguous groups, as even as possible with the larger
    ones last (their padded length k is the smaller), each one scan at its first k."""
    R, n = self.recursions, self.routing_buckets
    if not n:
      return tuple((r,) for r in range(R))
    sizes = [R // n + (i >= n - R % n) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return tuple(tuple(range(a, a + m)) for a, m in zip(starts, sizes))

  @property
  def alpha(self) -> float:
    """Router gate scale (model.routing.alpha; 0 -> 0.1 expert choice, 1.0 token choice)."""
    return self.routing_alpha or (0.1 if self.routing == 'expert_choice' else 1.0)

  @property
  def aux_loss_coeff(self) -> float:
    """Aux loss coefficient (model.routing.aux_loss; -1 -> 0.001 BCE, 0.1 balancing loss, 0
    under loss-free balancing, as the reference drops the loss there)."""
    if self.routing_aux_loss >= 0:
      return self.routing_aux_loss
    if self.routing == 'expert_choice':
      return 0.001
    return 0.0 if self.loss_free else 0.1

  @property
  def loss_free(self) -> bool:
    """Token choice with loss-free balancing (model.routing.balancing=bias): a non-trainable
    per-depth bias on the exit scores (models/routing.py)."""
    return self.routing == 'token_choice' and self.routing_balancing == 'bias'

  @property
  def z_loss_coeff(self) -> float:
    """Router z-loss coefficient (model.routing.z_loss; -1 -> the reference configs': 0 expert
    choice, 1e-5 token choice)."""
    if self.routing_z_loss >= 0:
      return self.routing_z_loss
    return 0.0 if self.routing == 'expert_choice' else 1e-5

  def _validate_routing(self) -> None:
    _choice('model.routing.kind', self.routing, ROUTINGS)
    if self.routing == 'none':
      return
    _choice('model.routing.router', self.routing_router, ROUTERS)
    _choice('model.routing.balancing', self.routing_balancing, BALANCINGS)
    if self.scheme not in ROUTED_SCHEMES:
      raise ConfigError(f'model.routing.kind={self.routing!r} routes the recursions of a shared '
                        f'cycle; model.sharing.scheme={self.scheme!r} has none; valid schemes: '
                        f'{", ".join(ROUTED_SCHEMES)}')
    for bad, why in (
        (self.lora_rank or self.untie_norms, 'per-layer parts (lora_rank, untie_norms) are not '
         'routed; valid: lora_rank=0, untie_norms=False'),
        (not self.scan_layers, 'it needs model.scan_layers=True'),
        (self.scan_lowering != 'nested', 'each recursion is its own scan over the K sets; '
         'valid: model.scan_lowering=nested'),
        (self.umup_residual, 'the u-muP residual rule is not routed; valid: another '
         'parametrization.kind')):
      if bad:
        raise ConfigError(f'model.routing.kind={self.routing!r}: {why}')
    caps = self.capacities
    R = self.recursions
    if self.routing == 'token_choice' and self.routing_capacity.strip():
      raise ConfigError(f'model.routing.capacity={self.routing_capacity!r}: token_choice picks '
                        f'each token\'s depth itself; valid: \'\' (capacity is expert_choice\'s)')
    if len(caps) != R or not all(0 < c <= 1 for c in caps) or \
        any(b > a for a, b in zip(caps, caps[1:])):
      raise ConfigError(f'model.routing.capacity={self.routing_capacity!r}: needs {R} fractions '
                        f'(one per recursion) in (0, 1], non-increasing; got {caps}')
    if self.routing_buckets and self.routing != 'expert_choice':
      raise ConfigError(f'model.routing.buckets={self.routing_buckets}: buckets group expert '
                        f'choice\'s recursions (token choice is one scan already); valid: 0')
    if not 0 <= self.routing_buckets <= R:
      raise ConfigError(f'model.routing.buckets={self.routing_buckets}: valid: 0 (one scan per '
                        f'recursion) or 1..{R} (R = {R} recursions)')
    if self.routing_alpha < 0:
      raise ConfigError(f'model.routing.alpha={self.routing_alpha} must be >= 0 (0: default)')
    if self.routing_aux_loss < 0 and self.routing_aux_loss != -1:
      raise ConfigError(f'model.routing.aux_loss={self.routing_aux_loss} must be >= 0, or -1 '
                        f'(the default coefficient)')
    if self.routing_z_loss < 0 and self.routing_z_loss != -1:
      raise ConfigError(f'model.routing.z_loss={self.routing_z_loss} must be >= 0, or -1 '
                        f'(the default coefficient)')
    if self.routing_balancing == 'bias' and self.routing != 'token_choice':
      raise ConfigError('model.routing.balancing=bias balances token choice\'s exit depths; '
                        'expert choice fixes its capacities; valid: loss')
    if not self.routing_bias_rate > 0:
      raise ConfigError(f'model.routing.bias_rate={self.routing_bias_rate} must be > 0')

  def validate(self) -> 'ModelConfig':
    """Raises ConfigError with one line naming the bad field; returns self."""
    _choice('model.norm.kind', self.norm, NORMS)
    _choice('model.norm.placement', self.norm_placement, PLACEMENTS)
    _choice('model.norm.qk_norm', self.qk_norm, QK_NORMS)
    _choice('model.norm.pre_activation', self.pre_activation_norm, PRE_ACTIVATION_NORMS)
    _choice('model.mlp', self.mlp, MLPS)
    _choice('model.position', self.position, POSITIONS)
    _choice('model.remat', self.remat, REMATS)
    _choice('model.scan_lowering', self.scan_lowering, LOWERINGS)
    _choice('model.dtype', self.dtype, DTYPES)
    _choice('model.param_dtype', self.param_dtype, DTYPES)
    _choice('model.kernels', self.kernels, KERNELS)
    _choice('model.dense_grad', self.dense_grad, DENSE_GRADS)
    _choice('model.attention', self.attention, ATTENTIONS)
    for t in self.lora_targets:
      _choice('model.sharing.lora_targets', t, LORA_TARGETS)
    _choice('model.sharing.lora_layers', self.lora_layers, LORA_LAYERS)
    _choice('model.attention_sharing', self.attention_sharing, ATTENTION_SHARINGS)
    for t in self.masa_targets:
      _choice('model.masa.targets', t, MASA_TARGETS)
    _choice('model.sharing.lora_zero', self.lora_zero, LORA_ZERO)
    for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'mlp_dim', 'scan_unroll'):
      if getattr(self, name) < 1:
        raise ConfigError(f'model.{name}={getattr(self, name)} must be >= 1')
    if self.head_dim_override < 0:
      raise ConfigError(f'model.head_dim={self.head_dim_override} must be >= 0')
    if self.d_model % self.num_heads and not self.head_dim_override:
      raise ConfigError(f'model.num_heads={self.num_heads} does not divide model.d_model='
                        f'{self.d_model}; valid: divisors of {self.d_model}')
    if self.num_heads % self.kv_heads:
      raise ConfigError(f'model.num_kv_heads={self.num_kv_heads} must divide model.num_heads='
                        f'{self.num_heads}')
    if self.attention_sharing in ('qk_shared', 'qkv_shared') and self.kv_heads != self.num_heads:
      raise ConfigError(f'model.attention_sharing={self.attention_sharing} makes the queries the '
                        f'keys, so it needs as many kv heads as heads; valid: num_kv_heads=0 '
                        f'(or {self.num_heads}), or attention_sharing=none|kv_shared')
    for field, targets, on in (('sharing.lora_targets', self.lora_targets, self.lora_rank),
                               ('masa.targets', self.masa_targets, self.masa_atoms)):
      missing = [t for t in targets if t not in self.projections] if on else []
      if missing:
        raise ConfigError(f'model.{field} names {",".join(missing)}, which '
                          f'model.attention_sharing={self.attention_sharing} does not store; '
                          f'valid: {",".join(self.projections)}')
    if self.masa_atoms < 0:
      raise ConfigError(f'model.masa.atoms={self.masa_atoms} must be >= 0 (0 = off)')
    if self.masa_atoms and not self.masa_targets:
      raise ConfigError(f'model.masa.atoms={self.masa_atoms} with no model.masa.targets; valid: '
                        f'a comma list of {",".join(MASA_TARGETS)}')
    if self.position == 'rope' and self.head_dim % 2:
      raise ConfigError(f'model.position=rope needs an even head_dim, got {self.head_dim}')
    if self.qk_norm == 'l2' and not self.qk_scale_init and self.qk_len < 2:
      raise ConfigError(f'model.norm.qk_norm_len={self.qk_norm_len}: the l2 QK-norm gain starts '
                        f'at log2(L^2 - L) with L the training sequence length; valid: L >= 2 '
                        f'(0 in a config means train.seq_len) or model.norm.qk_scale_init > 0')
    if self.lora_rank < 0:
      raise ConfigError(f'model.sharing.lora_rank={self.lora_rank} must be >= 0')
    if not self.scan_layers and (self.lora_rank or self.untie_norms):
      raise ConfigError('model.scan_layers=False reuses one module per shared set, so it cannot '
                        'hold per-layer parts; valid: lora_rank=0 and untie_norms=False')
    plan = self.plan  # raises ConfigError for impossible sharing
    if self.lora_rank and self.lora_layers == 'shared' and \
        not any(s.shared for s in plan.segments):
      raise ConfigError(f'model.sharing.lora_rank={self.lora_rank} with lora_layers=shared puts '
                        f'LoRA on shared layers only, and scheme {self.scheme!r} shares none; '
                        f'valid: lora_layers=all or lora_rank=0')
    self._validate_routing()
    return self

  def segment_cfg(self, seg: sharing.Segment) -> 'ModelConfig':
    """The config a plan segment's blocks are built with: without depth-wise LoRA where
    lora_layers='shared' and the segment shares no set (Relaxed Recursive Transformers,
    arXiv:2410.20672, relax only the looped layers; the unique first / last layers of middle
    schemes get none)."""
    if self.lora_rank and self.lora_layers == 'shared' and not seg.shared:
      return dataclasses.replace(self, lora_rank=0)
    return self

  @classmethod
  def from_config(cls, m: Any, seq_len: int | None = None) -> 'ModelConfig':
    """Builds from the `config.model` ConfigDict (every key; old workdirs: defaults.complete).

    `seq_len` (the config's train.seq_len) fills model.norm.qk_norm_len=0 (see `qk_len`).
    """
    kw = {}
    for f in dataclasses.fields(cls):
      if 'key' not in f.metadata:
        continue
      value = m
      for k in f.metadata['key'].split('.'):
        if k not in value:
          raise ConfigError(f'model.{f.metadata["key"]} is missing; valid: a config built on '
                            f'configs/default.py (sharenet.defaults.complete fills old ones)')
        value = value[k]
      kw[f.name] = f.metadata['parse'](value) if f.metadata['parse'] else value
    if not kw.get('qk_norm_len') and seq_len:
      kw['qk_norm_len'] = int(seq_len)
    return cls(**kw).validate()

  def to_config(self) -> dict[str, Any]:
    """The `config.model` section (nested dict) that `from_config` reads back as `self`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(self):
      if 'key' not in f.metadata:
        continue
      *groups, leaf = f.metadata['key'].split('.')
      node = out
      for g in groups:
        node = node.setdefault(g, {})
      value = getattr(self, f.name)
      node[leaf] = f.metadata['unparse'](value) if f.metadata['unparse'] else value
    return out
