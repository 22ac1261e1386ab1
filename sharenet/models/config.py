"""ModelConfig: the frozen, validated model hyper-parameters the modules read.

One field per `config.model` key, named as the key, with the nested groups as nested frozen
dataclasses (models/sections.py): `cfg.d_model`, `cfg.head_dim`, `cfg.norm.kind`,
`cfg.sharing.scheme`, `cfg.routing.capacity`, `cfg.masa.atoms`. Defaults are the default
config's (sharenet/config/defaults.py); `from_config` and `to_config` read and write that section.

What the keys' sentinels stand for, and the model-level scalars of the parametrization
(`parametrization`, the `config.parametrization` group; models/scaling.py), are resolved once
when a ModelConfig is built, into fields that are not keys (`d_head`, `kv_heads`, `qk_len`,
`plan`, `capacities`, `router_alpha`, `aux_loss_coeff`, `z_loss_coeff`, `attn_mult`,
`logits_mult`, `umup_residual`, ...). A config derived from another (`derive`: the muP base
width, an untied or converted model, a segment's blocks) changes keys and resolves them again.
`from_experiment(config)` is the model a whole experiment config trains.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

from sharenet.config import defaults
from sharenet.models import sharing
from sharenet.config import compat
from sharenet.errors import ConfigError
from sharenet.kernels import ATTENTIONS, DENSE_GRADS, KERNELS
from sharenet.models import expert_checks, looped_config, scaling
from sharenet.models import mpo as mpo_lib
from sharenet.models.sections import (BankConfig, MasaConfig, MoeConfig, MpoConfig, NormConfig,
                                      RecurrenceConfig, RopeScalingConfig, RoutingConfig,
                                      SharingConfig, choice, key, section)

MLPS = ('swiglu', 'geglu', 'gelu', 'selu')   # selu: Klambauer et al., arXiv:1706.02515
PROJ_BIASES = ('none', 'qkv', 'all')   # model.proj_bias: which block projections carry biases
POSITIONS = ('rope', 'learned', 'none')
LOWERINGS = ('nested', 'flat')
REMATS = ('none', 'full', 'dots', 'dots_no_batch', 'save_names', 'offload_dots', 'except_attn')
DTYPES = ('float32', 'bfloat16', 'float64')
# Sub-layer sharing (docs/sharing.md): which attention projections are one.
ATTENTION_SHARINGS = ('none', 'kv_shared', 'qk_shared', 'qkv_shared', 'cem')
# model.embed_projection: how factorized embeddings reach d_model (models/embeddings.py)
EMBED_PROJECTIONS = ('linear', 'self_attentive')
# The projections each sharing mode stores (kv_shared: values are the keys; qk_shared: queries
# are the keys; qkv_shared: one projection, stored as 'k'; cem: values are the keys and the
# output projection is the queries' transposed, models/projections.py).
STORED_PROJECTIONS = {'none': ('q', 'k', 'v'), 'kv_shared': ('q', 'k'),
                      'qk_shared': ('k', 'v'), 'qkv_shared': ('k',), 'cem': ('q', 'k')}
# KV across loops (Mixture-of-Recursions' recursive KV sharing, docs/loops.md).
KV_SHARINGS = ('none', 'first')
_TRAIN_SEQ_LEN = defaults.default_config().train.seq_len


def _resolved() -> Any:
  """A field resolved from the keys when the config is built (not a key, not compared)."""
  return dataclasses.field(init=False, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder LM hyper-parameters (num_layers counts *applied* layers; module docstring)."""
  vocab_size: int = key('vocab_size')
  d_model: int = key('d_model')
  num_layers: int = key('num_layers')
  num_heads: int = key('num_heads')
  num_kv_heads: int = key('num_kv_heads')       # 0 -> num_heads (kv_heads)
  mlp_dim: int = key('mlp_dim')
  mlp: str = key('mlp')
  mlp_tied: bool = key('mlp_tied')
  position: str = key('position')
  rope_base: float = key('rope_base')
  max_len: int = key('max_len')
  attention_window: int = key('attention_window')   # 0 = none; > 0: max_len, seq_len <= it
  attn_scale: float = key('attn_scale')         # 0 -> 1/sqrt(d_head) (attn_mult)
  attn_softcap: float = key('attn_softcap')     # 0 = off; cap * tanh(logits / cap)
  logit_softcap: float = key('logit_softcap')   # 0 = off; on the output logits
  tie_embeddings: bool = key('tie_embeddings')
  embed_init_std: float = key('embed_init_std')
  head_dim: int = key('head_dim')               # 0 -> d_model // num_heads (d_head)
  reader_bias: bool = key('reader_bias')
  proj_bias: str = key('proj_bias')             # none | qkv | all (bias_on)
  embed_scale: float = key('embed_scale')
  center_embedding: bool = key('center_embedding')
  embed_dim: int = key('embed_dim')             # 0 = off; < d_model (models/embeddings.py)
  embed_projection: str = key('embed_projection')
  remat: str = key('remat')
  scan_unroll: int = key('scan_unroll')
  scan_layers: bool = key('scan_layers')
  scan_split_transpose: bool = key('scan_split_transpose')
  scan_lowering: str = key('scan_lowering')
  dtype: str = key('dtype')
  kernels: str = key('kernels')
  attention: str = key('attention')
  dense_grad: str = key('dense_grad')
  param_dtype: str = key('param_dtype')
  attention_sharing: str = key('attention_sharing')
  kv_sharing: str = key('kv_sharing')
  loop_slices: str = key('loop_slices')
  masa: MasaConfig = section(MasaConfig)
  bank: BankConfig = section(BankConfig)
  mpo: MpoConfig = section(MpoConfig)
  sharing: SharingConfig = section(SharingConfig)
  routing: RoutingConfig = section(RoutingConfig)
  norm: NormConfig = section(NormConfig)
  recurrence: RecurrenceConfig = section(RecurrenceConfig)
  moe: MoeConfig = section(MoeConfig)
  rope_scaling: RopeScalingConfig = section(RopeScalingConfig)
  # Not a model key: the config.parametrization group, whose model-level scalars are resolved
  # below (the per-leaf rules are sharenet.parametrization.rules's).
  parametrization: scaling.Settings = dataclasses.field(default_factory=scaling.Settings)

  # ---- resolved when built (`_resolve`) ------------------------------------------------------
  d_head: int = _resolved()                     # head_dim, 0 -> d_model // num_heads
  kv_heads: int = _resolved()                   # num_kv_heads, 0 -> num_heads
  qk_len: int = _resolved()       # norm.qk_norm_len, 0 -> the default config's train.seq_len
  values_are_keys: bool = _resolved()   # V is the key projection: the KV cache holds K only
  projections: tuple[str, ...] = _resolved()    # attention and MLP kernels a block stores
  atom_kernels: tuple[str, ...] = _resolved()   # kernels built from MASA atoms (() = off)
  bank_kernels: tuple[str, ...] = _resolved()   # kernels generated from the bank (() = off)
  mpo_kernels: tuple[str, ...] = _resolved()    # kernels built as MPOs (() = off)
  plan: sharing.SharingPlan = _resolved()
  routed_segment: int | None = _resolved()      # plan segment whose recursions are routed
  recursions: int = _resolved()                 # R of the routed segment (0 without routing)
  capacities: tuple[float, ...] = _resolved()   # expert choice: routing.capacity, '' -> (R-r)/R
  expert_buckets: tuple[tuple[int, ...], ...] = _resolved()   # expert choice: scans' recursions
  router_alpha: float = _resolved()             # routing.alpha, 0 -> 0.1 expert, 1.0 token
  aux_loss_coeff: float = _resolved()           # routing.aux_loss, -1 -> the reference's
  z_loss_coeff: float = _resolved()             # routing.z_loss, -1 -> the reference's
  loss_free: bool = _resolved()                 # token choice with routing.balancing=bias
  attn_mult: float = _resolved()                # attention logits' multiplier (models/scaling)
  logits_mult: float = _resolved()              # readout logits' multiplier (muP: 1/m_d)
  umup_residual: tuple[float, ...] = _resolved()   # u-muP (alpha_attn, alpha_mlp); () = plain
  umup_ops: bool = _resolved()                  # u-muP unit-scaled attention and nonlinearity
  recurrent_segment: int | None = _resolved()   # plan segment model.recurrence loops (None: off)
  depth_mean: float = _resolved()               # recurrence.mean, 0 -> the plan's R
  grad_loops: int = _resolved()                 # loops with gradient per step (backprop, 0 ->
                                                # the fixed depth)
  kv_segment: int | None = _resolved()          # plan segment whose later loops read the first
                                                # loop's keys and values (None: kv_sharing=none)
  # model.loop_slices (models/attention.py): the slice lengths a sliced attention takes, and
  # per applied layer the index of its own in (0, *slice_lens) (0: full attention)
  slice_lens: tuple[int, ...] = _resolved()
  slice_branch: tuple[int, ...] = _resolved()
  moe_top_k: int = _resolved()                  # moe.top_k, 0 -> the kind's (0 without experts)
  moe_expert_dim: int = _resolved()             # moe.expert_dim, 0 -> mlp_dim // top_k

  def __post_init__(self):
    for f in dataclasses.fields(self):   # a section given as a dict of its keys (others default)
      sub = f.metadata.get('section')
      if sub is not None and isinstance(getattr(self, f.name), dict):
        object.__setattr__(self, f.name, sub(**getattr(self, f.name)))
    if isinstance(self.parametrization, dict):
      object.__setattr__(self, 'parametrization', scaling.Settings(**self.parametrization))
    for name, value in _resolve(self):
      object.__setattr__(self, name, value)

  def bias_on(self, kernel: str) -> bool:
    """Whether block kernel `kernel` (q, k, v, o, mlp_in, mlp_out) carries a bias: the readers
    under model.reader_bias (written by conversions), q, k, v under proj_bias=qkv (Qwen2), all
    six under proj_bias=all (GPT-2)."""
    return (self.proj_bias == 'all' or (self.proj_bias == 'qkv' and kernel in ('q', 'k', 'v')) or
            (self.reader_bias and kernel not in ('o', 'mlp_out')))

  def derive(self, **changes: Any) -> 'ModelConfig':
    """This config with `changes` to its keys, every resolved value resolved again.

    A section's change is a dict of its keys (the others kept) or a whole section; e.g.
    `cfg.derive(d_model=64, sharing={'scheme': 'cycle', 'num_unique': 2})`.
    """
    names = {f.name: f for f in dataclasses.fields(self) if f.init}
    for name, value in changes.items():
      if name not in names:
        raise ConfigError(f'model.{name} is unknown; valid: {", ".join(names)}')
      current = getattr(self, name)
      if isinstance(value, dict) and dataclasses.is_dataclass(current):
        changes[name] = dataclasses.replace(current, **value)
    return dataclasses.replace(self, **changes)

  def mpo_args(self, target: str) -> dict[str, int]:
    """Dense's MPO fields for a kernel of `target` (q, k, v, o, mlp_in, mlp_out): the chain's
    cores and bond cap where model.mpo targets it (models/mpo.py), else none."""
    if target not in self.mpo_kernels:
      return {}
    return dict(mpo_cores=self.mpo.cores, mpo_bond=self.mpo.bond)

  def segment_cfg(self, seg: sharing.Segment) -> 'ModelConfig':
    """The config a plan segment's blocks are built with: without depth-wise LoRA where
    lora_layers='shared' and the segment shares no set (Relaxed Recursive Transformers,
    arXiv:2410.20672, relax only the looped layers; the unique first / last layers of middle
    schemes get none)."""
    s = self.sharing
    if s.lora_rank and s.lora_layers == 'shared' and not seg.shared:
      return self.derive(sharing={'lora_rank': 0}, moe={'lora_experts': 0})
    return self

  def capacity_tokens(self, seq_len: int) -> tuple[int, ...]:
    """Expert choice: k_r = max(1, int(c_r * T)) tokens kept at recursion r (the reference's
    rule, applied to the full sequence length T)."""
    return tuple(max(1, int(c * seq_len)) for c in self.capacities)

  @classmethod
  def from_config(cls, m: Any, seq_len: int | None = None,
                  parametrization: Any = None) -> 'ModelConfig':
    """Builds from the `config.model` ConfigDict (every key; old workdirs: defaults.complete).

    `seq_len` (the config's train.seq_len) fills model.norm.qk_norm_len=0 (see `qk_len`);
    `parametrization` (a `config.parametrization` group or Settings; None: sp) sets the
    model-level scalars. A whole experiment config: `from_experiment`.
    """
    kw = _read(cls, m)
    if not kw['norm'].qk_norm_len and seq_len:
      kw['norm'] = dataclasses.replace(kw['norm'], qk_norm_len=int(seq_len))
    if parametrization is not None:
      kw['parametrization'] = (parametrization if isinstance(parametrization, scaling.Settings)
                               else scaling.Settings.from_config(parametrization))
    return cls(**kw)

  @classmethod
  def from_experiment(cls, config: Any) -> 'ModelConfig':
    """The model an experiment config trains: its model section, train.seq_len and
    parametrization (the train loop, eval, generation and conversions all build it here)."""
    return cls.from_config(config.model, config.train.seq_len, config.parametrization)

  def to_config(self) -> dict[str, Any]:
    """The `config.model` section (nested dict) that `from_config` reads back as `self`."""
    return _write(self)

  def table_config(self, plan: sharing.SharingPlan | None = None) -> dict[str, Any]:
    """The model's keys as the compatibility table reads an experiment config (`table_view`):
    its `model` and `parametrization` groups (features of other groups are off); `plan`,
    default the resolved one."""
    return table_view({'model': self.to_config(),
                       'parametrization': dataclasses.asdict(self.parametrization)},
                      plan if plan is not None else getattr(self, 'plan', None))


def table_view(config: Any, plan: sharing.SharingPlan | None = None) -> dict[str, Any]:
  """An experiment config (a ConfigDict or dict) as the compatibility table reads it: a plain
  dict, with model.recurrence.mean 0 read as the loops of the plan's looped segment (`plan`, or
  the one the sharing keys make), infinite without exactly one (a plan with no loop to run)."""
  raw = copy.deepcopy(config.to_dict() if hasattr(config, 'to_dict') else dict(config))
  model = raw.get('model') or {}
  rec = model.get('recurrence')
  if rec is None or rec.get('mean'):
    return raw
  if plan is None:
    s = model.get('sharing') or {}
    try:
      plan = sharing.make_plan(s.get('scheme', 'untied'), model['num_layers'],
                               s.get('num_unique', 0), s.get('repeats', 0), s.get('pattern', ''))
    except (ConfigError, KeyError, TypeError, ValueError):   # the plan's own checks come later
      return raw
  looped = [s for s in plan.segments if s.order == 'cycle' and s.repeats > 1]
  rec['mean'] = float(looped[0].repeats) if len(looped) == 1 else math.inf
  return raw


def _read(cls: type, node: Any, prefix: str = 'model.') -> dict[str, Any]:
  """The keyword arguments of `cls` from the config section `node` (sections built)."""
  kw = {}
  for f in dataclasses.fields(cls):
    if 'key' not in f.metadata:
      continue
    name = f.metadata['key'].split('.')[-1]
    if name not in node:
      raise ConfigError(f'{prefix}{name} is missing; valid: a config built on '
                        f'configs/default.py (sharenet.config.defaults.complete fills old ones)')
    value = node[name]
    sub = f.metadata.get('section')
    if sub is not None:
      kw[f.name] = sub(**_read(sub, value, f'{prefix}{name}.'))
    else:
      kw[f.name] = f.metadata['parse'](value) if f.metadata['parse'] else value
  return kw


def _write(obj: Any) -> dict[str, Any]:
  """The config section (nested dict) of a ModelConfig or one of its sections."""
  out = {}
  for f in dataclasses.fields(obj):
    if 'key' not in f.metadata:
      continue
    value = getattr(obj, f.name)
    if f.metadata.get('section') is not None:
      value = _write(value)
    elif f.metadata['unparse']:
      value = f.metadata['unparse'](value)
    out[f.name] = value
  return out


def _resolve(c: ModelConfig) -> list[tuple[str, Any]]:
  """(field, value) of every resolved field of `c`, checking the keys on the way: each
  section checked itself when built; here the top-level keys, then what needs several."""
  _check_keys(c)
  s = c.sharing
  plan = sharing.make_plan(s.scheme, c.num_layers, s.num_unique, s.repeats, s.pattern)
  compat.check(c.table_config(plan))   # refused feature pairs: the table's line, first
  d_head = c.head_dim or c.d_model // c.num_heads
  out = dict(d_head=d_head, kv_heads=c.num_kv_heads or c.num_heads,
             qk_len=c.norm.qk_norm_len or _TRAIN_SEQ_LEN,
             values_are_keys=c.attention_sharing in ('kv_shared', 'qkv_shared', 'cem'),
             projections=STORED_PROJECTIONS[c.attention_sharing] + (
                 () if c.attention_sharing == 'cem' else ('o',)) + ('mlp_in',) + (
                 () if c.mlp_tied else ('mlp_out',)),
             atom_kernels=c.masa.targets if c.masa.atoms else (),
             bank_kernels=c.bank.targets if c.bank.size else (),
             mpo_kernels=c.mpo.targets if c.mpo.cores else ())
  _check_shapes(c, out)
  out['plan'] = plan
  if s.lora_rank and s.lora_layers == 'shared' and \
      not any(seg.shared for seg in out['plan'].segments):
    raise ConfigError(f'model.sharing.lora_rank={s.lora_rank} with lora_layers=shared puts '
                      f'LoRA on shared layers only, and scheme {s.scheme!r} shares none; '
                      f'valid: lora_layers=all or lora_rank=0')
  scaling.check(c)
  out.update(scaling.scalars(c, d_head))
  out.update(looped_config.resolve_routing(c, out['plan']))
  out.update(looped_config.resolve_recurrence(c, out['plan'], out['umup_residual']))
  out['kv_segment'] = looped_config.kv_segment(c, out['plan'])
  out.update(looped_config.resolve_slices(c, out['plan'], out['qk_len']))
  expert_checks.check(c)   # SwitchHead, Mixture of LoRAs
  out.update(_resolve_moe(c))
  return list(out.items())


def _resolve_moe(c: ModelConfig) -> dict[str, Any]:
  """model.moe's resolved sizes (docs/experts.md), checking what the experts replace: the dense
  MLP's LoRA / MASA targets and its pre-activation norms have no expert counterpart."""
  mo = c.moe
  if mo.kind == 'none':
    return dict(moe_top_k=0, moe_expert_dim=0)
  k = mo.k
  what = f'model.moe.kind={mo.kind!r}'
  for field, targets in expert_checks.kernel_targets(c):
    mlp = [t for t in targets if t.startswith('mlp')]
    if mlp:
      raise ConfigError(f'{what} replaces the dense MLP that model.{field} names '
                        f'({",".join(mlp)}); valid: targets among q,k,v,o')
  if c.parametrization.kind == 'umup':
    raise ConfigError(f'{what}: u-muP\'s unit-scaled ops have no expert rule (the experts\' '
                      f'gates and ReLU are not unit scaled); valid: parametrization.kind sp, '
                      f'mup, mup_table3 or completep')
  if c.mlp not in ('swiglu', 'gelu'):
    raise ConfigError(f'{what}: the experts are ReLU (sigma_moe, MoEUT\'s) or take model.mlp '
                      f'swiglu / gelu (switch); model.mlp={c.mlp!r} has no expert form; valid: '
                      f'model.mlp swiglu or gelu')
  if c.norm.pre_activation != 'none':
    raise ConfigError(f'{what}: model.norm.pre_activation={c.norm.pre_activation!r} norms the '
                      f'dense MLP\'s hidden units, which experts do not have; valid: none')
  dim = mo.expert_dim or c.mlp_dim // k
  if dim < 1:
    raise ConfigError(f'{what}: expert_dim 0 -> mlp_dim // top_k = {c.mlp_dim} // {k} = 0; '
                      f'valid: expert_dim >= 1 or mlp_dim >= top_k')
  return dict(moe_top_k=k, moe_expert_dim=dim)


def _check_keys(c: ModelConfig) -> None:
  """The top-level keys' choices and ranges."""
  for field, valid in (('mlp', MLPS), ('proj_bias', PROJ_BIASES), ('position', POSITIONS),
                       ('remat', REMATS), ('scan_lowering', LOWERINGS), ('dtype', DTYPES),
                       ('param_dtype', DTYPES),
                       ('kernels', KERNELS), ('dense_grad', DENSE_GRADS),
                       ('attention', ATTENTIONS), ('attention_sharing', ATTENTION_SHARINGS),
                       ('kv_sharing', KV_SHARINGS)):
    choice(f'model.{field}', getattr(c, field), valid)
  for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'mlp_dim', 'scan_unroll'):
    if getattr(c, name) < 1:
      raise ConfigError(f'model.{name}={getattr(c, name)} must be >= 1')
  for name in ('attn_softcap', 'logit_softcap'):
    if not getattr(c, name) >= 0:
      raise ConfigError(f'model.{name}={getattr(c, name)} must be >= 0 (0 = off; > 0: logits '
                        f'-> cap * tanh(logits / cap))')
  if c.head_dim < 0:
    raise ConfigError(f'model.head_dim={c.head_dim} must be >= 0')
  if c.attention_window < 0 or c.max_len > c.attention_window > 0:
    raise ConfigError(f'model.attention_window={c.attention_window} with model.max_len='
                      f'{c.max_len}: sliding-window attention is modelled only within its '
                      f'window (where it equals full attention); valid: 0, or >= model.max_len')
  choice('model.embed_projection', c.embed_projection, EMBED_PROJECTIONS)
  if not 0 <= c.embed_dim < c.d_model:
    raise ConfigError(f'model.embed_dim={c.embed_dim}: factorized embeddings need 0 < embed_dim '
                      f'< d_model={c.d_model}; valid: 0 (off) or 1..{c.d_model - 1}')
  if c.d_model % c.num_heads and not c.head_dim:
    raise ConfigError(f'model.num_heads={c.num_heads} does not divide model.d_model='
                      f'{c.d_model}; valid: divisors of {c.d_model}')


def _check_shapes(c: ModelConfig, r: dict[str, Any]) -> None:
  """Heads, stored projections and head-dim rules, given the resolved dims `r`."""
  if c.num_heads % r['kv_heads']:
    raise ConfigError(f'model.num_kv_heads={c.num_kv_heads} must divide model.num_heads='
                      f'{c.num_heads}')
  stored = r['projections']
  tied = ('q',) * (c.attention_sharing == 'cem') + ('mlp_in',) * c.mlp_tied
  for field, targets in expert_checks.kernel_targets(c):
    missing = [t for t in targets if t not in stored]
    if missing:
      raise ConfigError(f'model.{field} names {",".join(missing)}, which this model does not '
                        f'store (attention_sharing={c.attention_sharing}, mlp_tied='
                        f'{c.mlp_tied}); valid: {",".join(stored)}')
    read = [t for t in targets if t in tied and field != 'sharing.lora_targets']
    if read:
      raise ConfigError(f'model.{field} names {",".join(read)}, whose plain kernel a tied '
                        f'transpose reads (CEM: attention_sharing=cem, mlp_tied); valid: '
                        f'{",".join(t for t in stored if t not in tied)}')
  if c.embed_dim and c.embed_projection == 'self_attentive' and (
      c.embed_dim % r['d_head'] or r['d_head'] % 2):
    raise ConfigError(f'model.embed_dim={c.embed_dim}: the self-attentive embedding attends '
                      f'with heads of head_dim {r["d_head"]} (even, rotary); valid: a multiple '
                      f'of {r["d_head"]}, or model.embed_projection=linear')
  if c.bank.size:
    _check_bank(c, r)
  if c.mpo.cores and c.mpo.bond:
    _check_mpo_bond(c, r)
  if c.position == 'rope' and r['d_head'] % 2:
    raise ConfigError(f'model.position=rope needs an even head_dim, got {r["d_head"]}')
  if c.norm.qk_norm == 'l2' and not c.norm.qk_scale_init and r['qk_len'] < 2:
    raise ConfigError(f'model.norm.qk_norm_len={c.norm.qk_norm_len}: the l2 QK-norm gain starts '
                      f'at log2(L^2 - L) with L the training sequence length; valid: L >= 2 '
                      f'(0 in a config means train.seq_len) or model.norm.qk_scale_init > 0')


def _check_bank(c: ModelConfig, r: dict[str, Any]) -> None:
  """model.bank.size: whole columns of d_model, and at least the widest template (the columns
  one target kernel reads: models/bank.py)."""
  D, size = c.d_model, c.bank.size
  if size % D:
    raise ConfigError(f'model.bank.size={size} is not a multiple of d_model={D} (the bank is '
                      f'd_model x columns); valid: e.g. {max(1, round(size / D)) * D}')
  F, HD, KD = c.mlp_dim, c.num_heads * r['d_head'], r['kv_heads'] * r['d_head']
  need = {'q': HD, 'k': KD, 'v': KD, 'o': HD, 'mlp_in': F, 'mlp_out': F}
  widest = max(c.bank.targets, key=lambda t: need[t])
  if size < D * need[widest]:
    raise ConfigError(f'model.bank.size={size} is smaller than the largest matrix a layer '
                      f'generates from it ({widest}: {D} x {need[widest]} = '
                      f'{D * need[widest]}); valid: model.bank.size >= {D * need[widest]}')


def _check_mpo_bond(c: ModelConfig, r: dict[str, Any]) -> None:
  """model.mpo.bond at most the largest full bond of a target kernel (above it, nothing is
  capped: the setting would say a truncation that does not happen)."""
  F, HD, KD = c.mlp_dim, c.num_heads * r['d_head'], r['kv_heads'] * r['d_head']
  dims = {'q': (c.d_model, HD), 'k': (c.d_model, KD), 'v': (c.d_model, KD),
          'o': (HD, c.d_model), 'mlp_in': (c.d_model, F), 'mlp_out': (F, c.d_model)}
  full = max(max(mpo_lib.mpo_shape(*dims[t], c.mpo.cores, 0).bonds) for t in c.mpo.targets)
  if c.mpo.bond > full:
    raise ConfigError(f'model.mpo.bond={c.mpo.bond} is above full rank: the largest full bond '
                      f'dimension of the target kernels is {full}; valid: 1..{full}, or 0 (full)')
