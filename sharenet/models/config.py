"""ModelConfig: the frozen, validated model hyper-parameters the modules read."""
from __future__ import annotations

import dataclasses
from typing import Any

from sharenet import sharing
from sharenet.errors import ConfigError

NORMS = ('layernorm', 'rmsnorm', 'crmsnorm', 'scalenorm', 'dyt', 'none')
PLACEMENTS = ('pre', 'post', 'peri')
QK_NORMS = ('none', 'rms', 'l2')
MLPS = ('swiglu', 'gelu')
POSITIONS = ('rope', 'learned', 'none')
LOWERINGS = ('nested', 'flat')
REMATS = ('none', 'full', 'dots', 'dots_no_batch', 'save_names', 'offload_dots', 'except_attn')
DTYPES = ('float32', 'bfloat16', 'float64')
LORA_TARGETS = ('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out')


def _choice(field: str, value: Any, valid: tuple[str, ...]) -> None:
  if value not in valid:
    raise ConfigError(f'{field}={value!r} is unknown; valid: {", ".join(valid)}')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder LM hyper-parameters (num_layers counts *applied* layers)."""
  vocab_size: int = 256
  d_model: int = 256
  num_layers: int = 8
  num_heads: int = 4
  num_kv_heads: int = 0            # 0 -> num_heads (MHA); fewer -> grouped-query attention
  mlp_dim: int = 1024
  mlp: str = 'swiglu'
  position: str = 'rope'
  rope_base: float = 10000.0
  max_len: int = 2048              # only for learned positions
  attn_scale: float = 0.0          # 0 -> 1/sqrt(head_dim); muP sets 1/head_dim
  logits_mult: float = 1.0         # forward multiplier on the logits (muP readout: 1/m)
  tie_embeddings: bool = False
  embed_init_std: float = 1.0
  norm: str = 'rmsnorm'
  norm_placement: str = 'pre'
  qk_norm: str = 'none'
  norm_eps: float = 1e-6
  dyt_alpha: float = 0.5           # DyT's initial alpha (ref. B7)
  qk_scale_init: float = 0.0       # l2 QK-norm gain init; 0 -> log2(max_len^2 - max_len) (ref. B3)
  fixnorm: bool = False            # unit-norm embedding rows, x sqrt(d) at the input (ref. B2)
  center_embedding: bool = False   # subtract the embedded vector's mean (zero-mean writer, tied)
  reader_bias: bool = False        # biases on q/k/v, MLP-in and readout (gain/bias folding, B1)
  head_dim_override: int = 0       # model.head_dim; 0 -> d_model // num_heads
  scheme: str = 'untied'
  num_unique: int = 0
  repeats: int = 0
  pattern: str = ''
  untie_norms: bool = False        # norm gains per applied layer (WideNet / Subformer)
  lora_rank: int = 0               # depth-wise LoRA (Relaxed Recursive Transformers)
  lora_targets: tuple[str, ...] = ('q', 'v')
  lora_scale: float = 1.0          # alpha / r; 1 makes full-rank SVD init exact (ref. C5.9)
  remat: str = 'dots_no_batch'
  scan_unroll: int = 1
  scan_layers: bool = True         # False: Python loop over layers (baseline; no per-layer parts)
  scan_split_transpose: bool = True  # lax.scan's split transpose for stacked sets (faster bwd)
  scan_lowering: str = 'nested'    # tied plans: nested scans | one flat scan over gathered sets
  dtype: str = 'float32'           # compute dtype; params stay float32 (float64 for x64 tests)
  param_dtype: str = 'float32'

  @property
  def head_dim(self) -> int:
    return self.head_dim_override or self.d_model // self.num_heads

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def plan(self) -> sharing.SharingPlan:
    return sharing.make_plan(self.scheme, self.num_layers, self.num_unique, self.repeats,
                             self.pattern)

  def validate(self) -> 'ModelConfig':
    """Raises ConfigError with one line naming the bad field; returns self."""
    _choice('model.norm.kind', self.norm, NORMS)
    _choice('model.norm.placement', self.norm_placement, PLACEMENTS)
    _choice('model.norm.qk_norm', self.qk_norm, QK_NORMS)
    _choice('model.mlp', self.mlp, MLPS)
    _choice('model.position', self.position, POSITIONS)
    _choice('model.remat', self.remat, REMATS)
    _choice('model.scan_lowering', self.scan_lowering, LOWERINGS)
    _choice('model.dtype', self.dtype, DTYPES)
    _choice('model.param_dtype', self.param_dtype, DTYPES)
    for t in self.lora_targets:
      _choice('model.sharing.lora_targets', t, LORA_TARGETS)
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
    if self.position == 'rope' and self.head_dim % 2:
      raise ConfigError(f'model.position=rope needs an even head_dim, got {self.head_dim}')
    if self.lora_rank < 0:
      raise ConfigError(f'model.sharing.lora_rank={self.lora_rank} must be >= 0')
    if not self.scan_layers and (self.lora_rank or self.untie_norms):
      raise ConfigError('model.scan_layers=False reuses one module per shared set, so it cannot '
                        'hold per-layer parts; valid: lora_rank=0 and untie_norms=False')
    self.plan  # raises ConfigError for impossible sharing
    return self

  @classmethod
  def from_config(cls, m: Any) -> 'ModelConfig':
    """Builds from the `config.model` ConfigDict (nested sharing / norm groups)."""
    s, n = m.sharing, m.norm
    targets = s.get('lora_targets', 'q,v')
    if isinstance(targets, str):
      targets = tuple(t for t in targets.replace(' ', '').split(',') if t)
    return cls(
        vocab_size=m.vocab_size, d_model=m.d_model, num_layers=m.num_layers,
        num_heads=m.num_heads, num_kv_heads=m.get('num_kv_heads', 0), mlp_dim=m.mlp_dim,
        mlp=m.get('mlp', 'swiglu'), position=m.get('position', 'rope'),
        rope_base=m.get('rope_base', 10000.0), max_len=m.get('max_len', 2048),
        attn_scale=m.get('attn_scale', 0.0), logits_mult=m.get('logits_mult', 1.0),
        tie_embeddings=m.get('tie_embeddings', False),
        embed_init_std=m.get('embed_init_std', 1.0),
        norm=n.kind, norm_placement=n.placement, qk_norm=n.get('qk_norm', 'none'),
        norm_eps=n.get('eps', 1e-6), dyt_alpha=n.get('dyt_alpha', 0.5),
        qk_scale_init=n.get('qk_scale_init', 0.0), fixnorm=n.get('fixnorm', False),
        center_embedding=m.get('center_embedding', False),
        reader_bias=m.get('reader_bias', False), head_dim_override=m.get('head_dim', 0),
        scheme=s.scheme, num_unique=s.get('num_unique', 0), repeats=s.get('repeats', 0),
        pattern=s.get('pattern', ''), untie_norms=s.get('untie_norms', False),
        lora_rank=s.get('lora_rank', 0), lora_targets=tuple(targets),
        lora_scale=s.get('lora_scale', 1.0), remat=m.get('remat', 'dots_no_batch'),
        scan_unroll=m.get('scan_unroll', 1), scan_layers=m.get('scan_layers', True),
        scan_split_transpose=m.get('scan_split_transpose', True),
        scan_lowering=m.get('scan_lowering', 'nested'), dtype=m.get('dtype', 'float32'),
        param_dtype=m.get('param_dtype', 'float32'),
    ).validate()
