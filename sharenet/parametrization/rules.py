"""Width / depth / loop parametrizations: per-leaf init std, forward, LR, WD and eps multipliers.

Presets (papers in docs/references.md):
  sp          standard parametrization: every multiplier 1.
  mup         microsoft/mup, TP5 Table 8 (arXiv:2203.03466): hidden Adam LR / m; readout init
              constant in width (SP x sqrt(m_d)) and forward multiplier 1/m_d on the logits;
              attention 1/d_head (as alpha/d_head with alpha = sqrt(base d_head), so base width == SP).
              Works with tied embeddings (the 1/m_d sits on the logits, not on the tensor).
  mup_table3  TP5 Table 3 / Lingle (arXiv:2404.05728): readout init std ~ 1/d (SP x 1/sqrt(m_d)), no
              readout multiplier, readout LR / m_d. Untied readouts only.
  umup        u-muP (arXiv:2407.17465; reference code graphcore-research/unit-scaling): unit init
              everywhere; hidden forward 1/sqrt(fan_in), readout forward 1/fan_in; Adam LR:
              embedding d^-1/2, hidden fan_in^-1/2 L^-1/2, trunk norm gains / biases L^-1/2,
              readout 1 (L = applied layers); attention logits 1/d_head. Absolute (not
              base-relative) rules. Unit-scaled ops (sharenet/models/unit_scale.py): residual
              branches by u-muP's tau rule (Appendix G; residual_mult, residual_attn_ratio; the
              rule counts applied layers, a shared set gets one tau per application), attention
              output x its empirical unit scale (depends on the call's sequence length, causal),
              SwiGLU / GELU x their empirical unit scales, biases x their Linear's output scale,
              and the loss backward as u-muP's cross_entropy (training only; reported loss is the
              true mean cross entropy). wd_mode=auto -> independent. Not exposed: u-muP's
              attn/loss softmax mults (1) and its per-tensor weight-gradient scales (1/sqrt(batch),
              embedding sqrt(vocab/batch): constants Adam ignores but for eps).
              Gradients are in u-muP's units (~tokens x vocab/sqrt(vocab-1) x the mean loss's):
              train.grad_clip applies to those, so clip 1.0 clips every step (use 0).
  completep   mup plus CompleteP, Table 1 of Dey et al. (arXiv:2505.01618), column alpha
              (= depth_alpha; 1 is CompleteP, 0.5 the Depth-muP branch rule), m_L = unique sets /
              base_depth, m_N = m_d. Residual blocks: branch x m_L^-alpha ("MHA / MLP Residual");
              hidden LR eta m_N^-1 m_L^(alpha-1); hidden-bias and pre-LN LR eta m_L^(alpha-1);
              "AdamW eps (residual blocks)" eps m_N^-1 m_L^-alpha on every block parameter (hidden
              matrices, biases, norm gains, LoRA factors); hidden WD lambda m_N (torch AdamW).
              Outside the blocks the table keeps the muP column: embedding LR / init / eps base;
              final-norm LR base; unembedding init and LR base, forward 1/m_N; eps base (the row
              covers residual blocks only; the reference code, EleutherAI/nanoGPT-mup branch
              completep model.py configure_optimizers, scales its single eps for all groups, but its
              embedding is tied and the table is what we follow).
Loop rule (any preset; Wang et al., arXiv:2606.18524; no settled rule): the residual branches of a
block applied R times get x 1/R (`inv_R`) or x 1/sqrt(R) (`inv_sqrt_R`); Adam LR and eps are
not scaled by R (Adam normalises the summed per-use gradient; our derivation, not a published rule).
Under train.optimizer=muon | shampoo | scion (`Parametrization(cfg, config.train)`) `mup` is
that optimizer's muP and the Adam-only presets are refused (sharenet/parametrization/optimizer_rules.py).

Depth-wise LoRA factors (role 'lora'; Relaxed Recursive Transformers, arXiv:2410.20672): the
delta x A B of a kernel, A: (in..., r), B: (r, out...), rank r fixed as width grows. muP sorts a
matrix by which of its dims are infinite (the columns of TP5 Tables 3 and 8: "input weights"
have finite fan-in and infinite fan-out, "output weights" infinite fan-in and finite fan-out,
"hidden weights" both infinite). So A (fan-in = width, fan-out = r) is an output weight and B
(fan-in = r, fan-out = width) an input weight:
  A, mup / completep (Table 8): init std constant in width (SP 1/sqrt(fan_in) x sqrt(m)), forward
    multiplier 1/m, Adam LR eta; mup_table3 (Table 3): init std SP x 1/sqrt(m) (var ~ 1/fan_in^2),
    no multiplier, Adam LR eta/m. The two are one dynamics under Adam's abc-symmetry. m = A's
    fan-in multiplier (d_model or mlp_dim over the base's).
  B: init var 1/fan_in with fan_in = r finite, Adam LR eta: SP's rule already (B is zero-initialised
    as in LoRA, which every column allows).
Why it is width-consistent: x has Theta(1) coordinates, so with A's Table 8 rule x A is
Theta(1/sqrt(d)) at init and its Adam update d * eta / m = Theta(1); z = x A has r (finite)
coordinates, and B, an input weight, maps Theta(1) coordinates to Theta(1) coordinates with
Theta(eta) updates. Under SP x dA grows ~ d (measured: configs/mup/coord_check_lora.py).
CompleteP treats both factors as block parameters (LR x m_L^(alpha-1), eps, WD and, for the B of a
branch output, the branch multiplier).

Forward multipliers on weights are applied as a reparametrization inside the loss
(`forward(params)`: W_eff = A * w, checkpoints keep raw w); residual-branch
multipliers are folded into the branch's output projection (o, wo: x + eps f(x) = x + f with
eps W_out, exact for pre/post norm). Model-level scalars (attention scale, logits multiplier,
u-muP's residual rule and ops) are resolved with the ModelConfig from its model and
parametrization keys (models/scaling.py, which also holds Settings and base_config): this module
reads them and never rewrites the model config.

Weight decay convention: decoupled, `decay = lr(t) * wd * wd_mult * p` on the leaves
train.decay_roles selects, not scaled by the per-leaf LR multiplier; with wd_mode='independent'
`decay = (lr(t)/lr_peak) * wd * wd_mult * p` (u-muP / Lingle). torch AdamW decays
lr_group(t) * wd_group * p with lr_group = eta(t) * lr_mult, so a paper's group weight decay
wd_group = lambda * k is ours with wd_mult = lr_mult * k:
  microsoft/mup MuAdamW and CompleteP Table 1 muP column, hidden: lr_mult = 1/m_N, wd_group =
    lambda m_N -> wd_mult = 1 (every preset at alpha = 1 and at the base depth needs nothing);
  CompleteP Table 1 alpha column, hidden: lr_mult = m_N^-1 m_L^(alpha-1), wd_group = lambda m_N
    -> wd_mult = m_L^(alpha-1) (!= 1 only for alpha != 1 away from the base depth);
  embedding (reference code: wd lambda, LR eta) -> 1; norm gains and biases get no decay in the
    reference code; if train.decay_roles decays them, torch's lr coupling gives the block ones
    wd_mult = lr_mult = m_L^(alpha-1), the same factor, which we use for every block parameter.
`LeafRule.decays` reports whether the default roles (matrices) decay a leaf.

Roles, fan-in axes and SP init stds come from the role table recorded where each parameter is
created (sharenet/models/params.py, `models.param_table`); fan-in multipliers from global shapes of the
target and a base-width model, both made with `jax.eval_shape` (never from shard shapes); scan
axes ('layers', 'repeats') never count as width.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.parametrization import optimizer_rules
from sharenet.models import params as params_lib
from sharenet.errors import ConfigError
from sharenet.models import ModelConfig, param_table, unit_scale
from sharenet.models.scaling import base_config

# 'inject': the [state; injected] input of recurrent depth's adapter, 2 x embed
# (models/recurrence.py).
# 'embed_factor': a factorized embedding's width E, scaled with d_model (models/embeddings.py).
# 'bank': the parameter bank's columns, scaled with d_model (models/bank.py).
WIDTH_AXES = frozenset({'embed', 'mlp', 'heads', 'kv_heads', 'head_dim', 'inject',
                        'embed_factor', 'embed_factor_hidden', 'bank'})
# Leading axes that index separate matrices, never width: scan axes, the MASA atom index and
# the expert index (models/moe.py: each expert's matrices are hidden matrices of their own
# fan-in; the expert selector's rows are output weights, like the recursion routers').
SCAN_AXES = frozenset({'layers', 'repeats', 'atoms', 'experts'})
FINITE_AXES = frozenset({'vocab', 'length', 'lora'})
# Preset roles (the rule tables' rows) of the table's roles (sharenet/models/params.py).
PRESET_ROLE = {'reader': 'hidden', 'writer': 'hidden', 'readout': 'readout', 'router': 'output',
               'embedding': 'embedding', 'pos_embed': 'embedding', 'lora': 'lora',
               'norm_in': 'vector', 'norm_out': 'vector', 'bias': 'vector', 'scalar': 'vector',
               'mpo': 'vector'}
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class LeafRule:
  """One trainable leaf's role and multipliers (init_scale multiplies the SP init)."""
  path: Path
  axes: tuple[str | None, ...]
  role: str                  # embedding | hidden | readout | vector | lora
  fan_in: int
  fan_in_mult: float         # m: product over fan-in width axes of size / base size
  repeats: int               # R: applications per step of this stored tensor
  init_scale: float
  init_std: float | None     # absolute std after scaling (None: constant init, ones / zeros)
  fwd_mult: float
  lr_mult: float
  wd_mult: float             # decay multiplier where train.decay_roles decays (module docstring)
  eps_mult: float
  decays: bool               # the default train.decay_roles (matrices) decays this leaf
  damping_mult: Any = 1.0    # multiplies train.shampoo.eps (vanilla Shampoo's muP), or
                             # K-FAC's (rho_A, rho_G) multipliers (a pair; its muP)


class OptMultipliers(NamedTuple):
  """Per-leaf optimizer multiplier trees (python floats) for chain.make_optimizer.

  Which leaves decay is the optimizer's role mask (train.decay_roles) alone; `wd` (None: all 1)
  scales the decay of the leaves it selects.
  """
  lr: Any
  eps: Any
  independent_wd: bool
  wd: Any = None
  damping: Any = None    # Shampoo's damping multiplier per leaf (None: all 1)
  scion_scaled: bool = False   # train.optimizer=scion: the width-scaled LMOs (its muP)


def _role(info: params_lib.ParamInfo, axes: tuple) -> tuple[str, tuple[int, ...]]:
  """Preset role and fan-in axis positions of a table row (scan axes already removed)."""
  role = PRESET_ROLE.get(info.role)
  if role is None:
    raise ConfigError(f'parameter {info.key}: role {info.role!r} has no preset rule; valid: '
                      f'{", ".join(PRESET_ROLE)}')
  if role == 'hidden':
    unknown = [a for a in axes if a not in WIDTH_AXES]
    if unknown:
      raise ConfigError(f'parameter {info.key}: logical axes {unknown} are neither width '
                        f'{sorted(WIDTH_AXES)} nor finite {sorted(FINITE_AXES | SCAN_AXES)}')
  if role == 'lora' and ('lora' in axes[:info.num_in]) == ('lora' in axes[info.num_in:]):
    raise ConfigError(f'parameter {info.key}: a LoRA factor needs the rank axis \'lora\' on '
                      f'exactly one side (A: in... -> lora, B: lora -> out...); got {axes}')
  return role, tuple(range(info.num_in)) if role != 'vector' else ()


def _lora_reads_width(info: params_lib.ParamInfo) -> bool:
  """LoRA A (fan-in = width, fan-out = rank): a muP output weight; B (rank -> width) an input
  weight (module docstring)."""
  return 'lora' not in info.axes[info.num_stack:info.num_stack + info.num_in]


def _repeats(info: params_lib.ParamInfo, loop_rule: str) -> int:
  """Applications per step of one stored entry of the leaf (1 outside the blocks and for the
  per-recursion router rows), from its structure metadata."""
  if loop_rule != 'none' and len(set(info.uses)) > 1:
    raise ConfigError(f'parametrization.loop_rule={loop_rule} needs every stored set applied '
                      f'equally often; {info.key} holds sets applied {sorted(set(info.uses))} '
                      f'times; valid: loop_rule=none, or a regular scheme (not explicit)')
  return info.applications


def _is_branch_out(info: params_lib.ParamInfo) -> bool:
  """The last projection of a residual branch (its kernel or LoRA B): it writes the stream."""
  return info.writes and info.branch is not None


class Parametrization:
  """Per-leaf rules of a ModelConfig's parametrization (`cfg.parametrization`).

  `cfg` is the model that trains, as built: its model-level scalars (attention and logits
  multipliers, u-muP's residual rule and ops) were resolved with it (models/scaling.py), and
  this class never rewrites it.
  """

  def __init__(self, cfg: ModelConfig, train: Any = None):
    self.cfg = cfg
    # train.optimizer picks the optimizer's version of the preset (optimizer_rules.py).
    self.opt_settings = optimizer_rules.settings_of(train)
    self.optimizer, self.matrix_roles = self.opt_settings[:2]
    s = self.settings = cfg.parametrization
    self.base_cfg = base_config(cfg)
    self.m_d = cfg.d_model / self.base_cfg.d_model
    self.m_L = cfg.plan.num_unique / (s.base_depth or cfg.plan.num_unique)
    # u-muP cross entropy's backward scale on the logits (trainer.loss_fn); 1 = plain loss.
    self.loss_grad_scale = unit_scale.loss_grad_scale(cfg.vocab_size) if s.kind == 'umup' else 1.0
    self.rules = optimizer_rules.adjust(
        self._rules(cfg), *self._tables, self.settings.kind, self.opt_settings,
        self.settings.qk_lr, cfg.logits_mult)

  # ---- per-leaf rules ------------------------------------------------------------------------
  def _rules(self, cfg: ModelConfig) -> dict[Path, LeafRule]:
    target, base = self._tables = param_table(cfg), param_table(self.base_cfg)
    if target.keys() != base.keys():
      raise ConfigError('parametrization: the base-width model has different parameters '
                        f'({sorted(set(target) ^ set(base))[:3]})')
    rules = {}
    for path, info in target.items():
      axes, shape, base_shape = info.axes, info.shape, base[path].shape
      keep = [i for i, a in enumerate(axes) if a not in SCAN_AXES]
      for i, a in enumerate(axes):   # shape-diff cross-check of the name-derived width axes
        if shape[i] != base_shape[i] and a not in WIDTH_AXES:
          raise ConfigError(f'parameter {"/".join(path)}: axis {a!r} changes with width '
                            f'({base_shape[i]} -> {shape[i]}) but is not a width axis')
      waxes = tuple(axes[i] for i in keep)
      wshape = tuple(shape[i] for i in keep)
      wbase = tuple(base_shape[i] for i in keep)
      role, in_pos = _role(info, waxes)
      fan_in = math.prod(wshape[i] for i in in_pos) if in_pos else 1
      m = float(math.prod(wshape[i] / wbase[i] for i in in_pos if waxes[i] in WIDTH_AXES))
      if role == 'hidden' and self.m_d != 1:
        out_pos = [i for i in range(len(waxes)) if i not in in_pos]
        if m == 1 or all(wshape[i] == wbase[i] for i in out_pos):
          raise ConfigError(f'parameter {"/".join(path)}: a hidden matrix whose fan-in or fan-out '
                            f'does not vary with base_d_model (vary mlp_dim / heads too)')
      R = _repeats(info, self.settings.loop_rule)
      init_scale, fwd, lr, eps = self._table(info, role, fan_in, m, R)
      sp_std = info.init_std
      rules[path] = LeafRule(
          path=path, axes=axes, role=role, fan_in=fan_in, fan_in_mult=m, repeats=R,
          init_scale=init_scale, init_std=None if sp_std is None else sp_std * init_scale,
          fwd_mult=fwd, lr_mult=lr, wd_mult=self._wd_mult(info), eps_mult=eps,
          decays=info.role in params_lib.MATRIX_ROLES)
    if self.settings.kind == 'umup':
      # u-muP's Linear scales its whole output, bias included: (x W + b) / sqrt(fan_in)
      # (unit_scaling.functional.linear), so a bias takes its kernel's forward multiplier.
      for path, r in rules.items():
        kernel = rules.get(path[:-1] + ('kernel',))
        if path[-1] == 'bias' and kernel is not None:
          rules[path] = dataclasses.replace(r, fwd_mult=r.fwd_mult * kernel.fwd_mult)
    return rules

  def _wd_mult(self, info: params_lib.ParamInfo) -> float:
    """Decay multiplier in our convention (module docstring): CompleteP Table 1's hidden WD
    lambda m_N at LR eta m_N^-1 m_L^(alpha-1) is m_L^(alpha-1) on every block parameter."""
    if self.settings.kind == 'completep' and info.branch is not None:
      return self.m_L ** (self.settings.depth_alpha - 1)
    return 1.0

  def _table(self, info: params_lib.ParamInfo, role: str, fan_in: int, m: float, R: int):
    """(init_scale, fwd_mult, lr_mult, eps_mult) of the preset's table for one leaf."""
    s, k = self.settings, self.settings.kind
    init, fwd, lr, eps = 1.0, 1.0, 1.0, 1.0
    trunk = info.branch is not None   # a block parameter
    if k in ('mup', 'mup_table3', 'completep'):
      if role == 'hidden':
        lr = 1.0 / m                                         # Table 8 / Table 3: eta / m
      elif role == 'readout':
        if k == 'mup_table3':
          init, lr = self.m_d ** -0.5, 1.0 / self.m_d          # std ~ 1/d, LR eta / m (TP5 Table 3)
        else:
          init = self.m_d ** 0.5                               # std 1/sqrt(d_base) (TP5 Table 8)
      elif role == 'output' or (role == 'lora' and _lora_reads_width(info)):
        # A TP5 output weight (width in, finite out): a router's rows, LoRA A
        if k == 'mup_table3':
          init, lr = m ** -0.5, 1.0 / m                        # Table 3: var 1/fan_in^2, eta/m
        else:
          init, fwd = m ** 0.5, 1.0 / m                        # Table 8: std const, mult 1/m
      # LoRA B (rank -> width) is a TP5 input weight: SP's init and LR already (module docstring).
    elif k == 'umup':
      L = self.cfg.num_layers     # u-muP DepthSequential counts applied blocks
      if role == 'embedding':
        init, lr = 1.0 / info.init_std, self.cfg.d_model ** -0.5
      elif role == 'hidden':
        init, fwd, lr = fan_in ** 0.5, fan_in ** -0.5, fan_in ** -0.5 * L ** -0.5
      elif role in ('readout', 'output'):
        init, fwd = fan_in ** 0.5, 1.0 / fan_in
      elif role == 'vector' and trunk:
        lr = L ** -0.5
    if k == 'completep' and trunk:   # CompleteP Table 1, alpha column: every block parameter
      a, mL = s.depth_alpha, self.m_L
      lr *= mL ** (a - 1)                    # hidden (x m_N^-1 above), hidden bias, pre-LN LR
      eps = 1.0 / (self.m_d * mL ** a)       # "AdamW eps (residual blocks)": m_N^-1 m_L^-alpha
      if _is_branch_out(info):
        fwd *= mL ** -a                      # X + m_L^-alpha MHA(LN(X)), same for the MLP
    if s.loop_rule != 'none' and trunk and _is_branch_out(info) and R > 1:
      fwd *= 1.0 / R if s.loop_rule == 'inv_R' else R ** -0.5   # Wang et al., arXiv:2606.18524
    # TP5 (arXiv:2203.03466) section D.2's zero-initialised readout and query, under any kind
    if (s.readout_zero_init and role == 'readout'
        or s.query_zero_init and role == 'hidden' and info.use == 'query'):
      init = 0.0
    return init, fwd, lr, eps

  # ---- application ---------------------------------------------------------------------------
  def tree(self, field: str) -> Any:
    """{collection: nested dict} of one LeafRule field."""
    return unflatten_dict({p: getattr(r, field) for p, r in self.rules.items()})

  def _scale(self, variables: Any, field: str) -> Any:
    flat = flatten_dict(nn.unbox(variables))
    out = {}
    for path, x in flat.items():
      k = getattr(self.rules[path], field)
      out[path] = x if k == 1.0 else x * jnp.asarray(k, x.dtype)   # skip: bit-identical to SP
    return unflatten_dict(out)

  def init(self, variables: Any) -> Any:
    """SP-initialised variables -> this preset's init (deterministic rescale)."""
    return self._scale(variables, 'init_scale')

  def forward(self, variables: Any) -> Any:
    """Raw variables -> effective variables the model is applied to (W_eff = fwd_mult * w)."""
    return self._scale(variables, 'fwd_mult')

  @property
  def has_forward(self) -> bool:
    return any(r.fwd_mult != 1.0 for r in self.rules.values())

  def opt_multipliers(self) -> OptMultipliers | None:
    """Per-leaf LR / WD / eps trees; None when they are exactly plain AdamW's (SP)."""
    plain = all(r.lr_mult == 1.0 and r.eps_mult == 1.0 and r.wd_mult == 1.0
                and r.damping_mult == 1.0 for r in self.rules.values())
    scion_scaled = self.optimizer == 'scion' and self.settings.kind == 'mup'
    if plain and not self.settings.independent_wd and not scion_scaled:
      return None
    wd = None if all(r.wd_mult == 1.0 for r in self.rules.values()) else self.tree('wd_mult')
    damping = None if all(r.damping_mult == 1.0 for r in self.rules.values()) \
        else self.tree('damping_mult')
    return OptMultipliers(self.tree('lr_mult'), self.tree('eps_mult'),
                          self.settings.independent_wd, wd, damping, scion_scaled)

  def describe(self) -> list[dict[str, Any]]:
    """One row per leaf plus a row of model-level scalars (for config.json and reports)."""
    rows = [{'path': '/'.join(r.path), 'axes': list(r.axes), **{
        f: getattr(r, f) for f in ('role', 'fan_in', 'fan_in_mult', 'repeats', 'init_std',
                                   'fwd_mult', 'lr_mult', 'wd_mult', 'eps_mult', 'decays',
                                   'damping_mult')}}
            for r in self.rules.values()]
    rows.append({'path': '<model>', 'attn_scale': self.cfg.attn_mult,
                 'logits_mult': self.cfg.logits_mult, 'm_d': self.m_d, 'm_L': self.m_L,
                 'umup_residual': list(self.cfg.umup_residual),
                 'umup_ops': self.cfg.umup_ops,
                 'loss_grad_scale': self.loss_grad_scale,
                 'independent_wd': self.settings.independent_wd})
    return rows
