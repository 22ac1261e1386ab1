"""The compatibility table: which features combine, declared once.

Every feature is a config setting (or, `action=True`, an operation on a trained model: cached
generation, loop-by-loop inference with adaptive exits, test-time depth). Features on one `axis`
exclude each other (two sharing schemes are not a pair). Every other pair works unless one of
the two names the other in `refuses`, with the one-line reason (and, optionally, a predicate
narrowing it to the configs it holds for). `check(config)` raises that line as a ConfigError:
train/experiment.py's validation runs it before anything is built, and ModelConfig runs it on
its own keys when built. `check_action` does the same for an action on a model's config; the
serving code and the conversions (convert.py's config.to, `CONVERSIONS`) call it.
tests/compatibility/test_compatibility.py is generated from this table: a pairwise covering set
of tiny configs (every working pair in at least one, none with a refused pair) each initialised
and trained one step, the actions run on them, and every refused pair checked to raise its
line; docs/compatibility.md is `compat_coverage.markdown()`; the covering set is
`compat_coverage.covering_rows()`. A feature whose config value is not in the table fails
tests/compatibility/test_compatibility.py::test_every_choice_is_declared.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

from sharenet.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Feature:
  """One row and column of the table."""
  name: str
  axis: str
  overrides: tuple[tuple[str, Any], ...]    # dotted config keys over the table's base config
  on: Callable[[Any], bool]                  # whether a full config has the feature
  # (other feature, why[, when]), one line each; `when(config)`, if given, narrows the refusal to
  # the configs it holds for (the table's pages and rows treat the pair as refused)
  refuses: tuple[tuple, ...] = ()
  action: bool = False

  @property
  def label(self) -> str:
    return ', '.join(f'{k}={v}' for k, v in self.overrides) or self.name


def _get(config: Any, key: str) -> Any:
  node = config
  for part in key.split('.'):
    node = node[part]
  return node


# K-FAC's statistics are the taps of the Dense layers' hidden kernels (models/curvature.py):
# kernels formed otherwise have none, and a statistics norm's cotangents take the same channel.
_NO_TAPS = 'K-FAC\'s Kronecker statistics come from Dense kernels; {} (valid with kfac: plain kernels)'
KFAC_REFUSES = tuple((k, 'a statistics norm\'s state and K-FAC\'s statistics both leave by '
                      'cotangents; one at a time (valid with kfac: rmsnorm, layernorm, ...)')
                     for k in ('powernorm', 'unified_norm', 'online_norm')) + (
    ('sigma_moe', _NO_TAPS.format('expert kernels are stacks outside them')),
    ('switch', _NO_TAPS.format('expert kernels are stacks outside them')),
    *((k, _NO_TAPS.format('expert kernels are stacks outside them'))
      for k in ('moe_router_per_layer', 'moe_ragged_dot', 'moe_reference')),
    ('switchhead', _NO_TAPS.format('value experts are stacks outside them')),
    ('masa', _NO_TAPS.format('MASA kernels are mixtures of shared atoms')),
    ('bank', _NO_TAPS.format('a bank\'s kernels are slices of one shared matrix')),
    ('mpo', _NO_TAPS.format('MPO kernels are chains of tensors')),
    ('cem', _NO_TAPS.format('CEM\'s output projection is the query kernel transposed, a '
                            'second untapped use')),
    ('mlp_tied', _NO_TAPS.format('a tied MLP uses its kernel twice, once transposed')))


def _setting(name: str, axis: str, key: str, value: Any, *extra: tuple[str, Any],
             refuses: tuple[tuple, ...] = (), contains: bool = False) -> Feature:
  """A feature that is on when config `key` equals `value` (or, `contains`, lists it)."""
  if contains:
    on = lambda c: value in str(_get(c, key)).replace(' ', '').split(',')
  else:
    on = lambda c: _get(c, key) == value
  return Feature(name, axis, ((key, value),) + extra, on, refuses)


MOEUT_V = 'MoEUT norms read the values un-normalised and the keys normed; values are keys here'
NOT_ROUTED = 'per-layer parts are not routed (each recursion is one scan over the K sets)'
ROUTED_PLANS = 'routing needs a cycle segment to route (valid schemes: cycle, middle_cycle)'
FLAT_ROUTED = 'each routed recursion is its own scan; valid: model.scan_lowering=nested'
LOOPED = 'loop-by-loop inference needs exactly one looped cycle segment'
LOOP_ROUTED = 'loop-by-loop inference runs every loop on every token; routing picks the loops'
DEPTH = 'test-time depth (eval.py --depths / --depth) runs another number of loops of the one ' \
    'looped cycle segment'
DEPTH_ROUTED = 'routing picks each token\'s recursions; a loop schedule of a routed model is not ' \
    'implemented'
UMUP_LAYER = 'the u-muP residual rule depends on the applied layer index'
NO_V = 'these sharing modes store no value projection for the LoRA / MASA target v'
NO_Q = 'qk_shared / qkv_shared store no query projection for the LoRA / MASA target q'
PERI = 'depth / loop branch multipliers are cancelled by peri norms'
EULER_POST = 'a post norm renormalises x + h f(x), so the loop is no Euler step'
NO_LOOP = 'recurrence and exits loop the plan\'s one looped cycle segment, which it lacks'
ROUTED_LOOPS = 'routing picks each token\'s loops itself'
UMUP_DEPTH = 'the u-muP residual rule counts applied layers, which the depth changes'
PER_LOOP_PARTS = 'per-layer parts exist for the plan\'s R loops only; a sampled depth runs others'
MOE_ROUTED = 'routed recursions rebuild the layer carry that holds the experts\' aux loss'
MOE_UMUP = 'u-muP\'s unit-scaled ops have no expert rule'
MOE_NAP = 'NaP\'s pre-activation norms norm the dense MLP\'s hidden units, which experts lack'
MOE_MLP = 'the experts are ReLU (sigma_moe, MoEUT\'s) or take model.mlp swiglu / gelu (switch)'
MOE_EXITS = 'the exits\' pass through the coda does not collect the experts\' aux loss'
CAPACITY = 'Switch capacity counts the call\'s tokens, so a cached or one-token pass drops ' \
    'other tokens than the full forward'
SWITCH_V = 'SwitchHead\'s value experts replace the stored v projection that the sharing mode ' \
    'ties'
SWITCH_LORA = 'SwitchHead makes v and o experts, which the LoRA / MASA targets name'
SWITCH_BIAS = 'SwitchHead\'s value / output experts carry no biases'
def _targets(key: str, kernel: str) -> Callable[[Any], bool]:
  """Whether the comma list at config `key` (LoRA or MASA targets) names `kernel`."""
  return lambda c: kernel in str(_get(c, key)).replace(' ', '').split(',')


def _mlp_targets(key: str) -> Callable[[Any], bool]:
  """Whether the comma list at config `key` names a dense-MLP kernel (mlp_in, mlp_out)."""
  return lambda c: any(t.startswith('mlp') for t in str(_get(c, key)).replace(' ', '').split(','))


def _generated_kernels(key: str) -> tuple[tuple, ...]:
  """The refusals of a kernel-target list at config `key` (bank, MPO): a sharing mode that
  stores no such kernel, experts replacing a targeted MLP, SwitchHead's v / o experts."""
  names = lambda c: set(str(_get(c, key)).replace(' ', '').split(','))
  return (('kv_shared', NO_V, _targets(key, 'v')), ('qkv_shared', NO_V, _targets(key, 'v')),
          ('qk_shared', NO_Q, _targets(key, 'q')), ('qkv_shared', NO_Q, _targets(key, 'q')),
          *[(m, f'the experts replace the dense MLP whose kernels {key} names',
             _mlp_targets(key)) for m in ('sigma_moe', 'switch', 'moe_ragged_dot',
                                          'moe_reference', 'moe_router_per_layer')],
          ('switchhead', SWITCH_LORA, lambda c: bool({'v', 'o'} & names(c))))


# per-kernel multipliers, reparametrizations and projections (their kernels by path or role)
PER_KERNEL = ('inv_R', 'inv_sqrt_R', 'zero_mean_writers', 'weight_std', 'weight_norm',
              'sigma_reparam', 'weight_conditioning', 'compander', 'ngpt', 'norm_project')
MPO_OTHER = 'MPO kernels and the other generated kernels (MASA, the bank) exclude each other'
MPO_RULE = ('the MPO tensors have no width rule (their shapes are factors of the widths); '
            'valid with model.mpo: parametrization.kind=sp')
MPO_TENSORS = ('an MPO kernel is a chain of tensors, not a kernel leaf that a per-kernel '
               'multiplier, reparametrization, projection or update can act on')
BANK_RULE = ('one bank serves readers and writers of both branches, so a rule set per branch '
             'and kernel has no leaf to scale (valid with the bank: sp, mup, mup_table3)')
BANK_ONE_MATRIX = ('the bank is one matrix behind every generated kernel, so a per-kernel '
                   'multiplier, reparametrization or projection has no kernel to act on')
SLICED_LOOPLESS = 'the slices apply to the loops of the plan\'s one looped cycle segment'
SLICED_DEPTH = ('each loop\'s slicing is fixed by its index in the plan\'s loops; another '
                'number of loops is not the trained function')
CEM_KERNELS = ('CEM\'s attention ties W_O to the plain query kernel W_Q and stores no v or o; '
               'valid: targets among k, mlp_in, mlp_out')
MLP_TIED_KERNELS = ('the tied MLP reads its nonlinear input projection as a plain kernel and '
                    'stores no wo; valid: targets among q, k, v, o')
TIED_WRITER = ('a tied transpose (CEM) is its output projection, so a multiplier or '
               'reparametrization of the branch\'s output kernel has none to act on')
TIED_WRITER_FEATURES = ('completep', 'umup', 'inv_R', 'inv_sqrt_R', 'zero_mean_writers')
KV_LOOP = 'kv sharing reuses the first loop\'s keys and values in the later loops of the plan\'s ' \
    'one looped cycle segment, which it lacks'


def _features() -> tuple[Feature, ...]:
  """The table (module docstring). Base: configs/tiny.py, 4 applied layers, cycle of 2 sets.
  One declaration per feature, so as long as the table (not split on purpose)."""
  s = 'model.sharing.'
  schemes = [
      _setting('untied', 'scheme', s + 'scheme', 'untied', (s + 'num_unique', 0),
               refuses=(('lora', 'LoRA relaxes shared layers and untied shares none; valid: '
                         'model.sharing.lora_layers=all'), ('expert_choice', ROUTED_PLANS),
                        ('token_choice', ROUTED_PLANS), ('loop_inference', LOOPED),
                        ('test_time_depth', DEPTH))),
      _setting('universal', 'scheme', s + 'scheme', 'universal', (s + 'num_unique', 1),
               refuses=(('expert_choice', ROUTED_PLANS), ('token_choice', ROUTED_PLANS))),
      _setting('cycle', 'scheme', s + 'scheme', 'cycle', (s + 'num_unique', 2)),
      _setting('sequence', 'scheme', s + 'scheme', 'sequence', (s + 'num_unique', 2),
               refuses=(('expert_choice', ROUTED_PLANS), ('token_choice', ROUTED_PLANS),
                        ('loop_inference', LOOPED), ('test_time_depth', DEPTH))),
      _setting('middle_cycle', 'scheme', s + 'scheme', 'middle_cycle', (s + 'num_unique', 3)),
      _setting('middle_sequence', 'scheme', s + 'scheme', 'middle_sequence',
               (s + 'num_unique', 3),
               refuses=(('expert_choice', ROUTED_PLANS), ('token_choice', ROUTED_PLANS),
                        ('loop_inference', LOOPED), ('test_time_depth', DEPTH))),
      _setting('sandwich', 'scheme', s + 'scheme', 'sandwich', (s + 'num_unique', 3),
               refuses=(('expert_choice', ROUTED_PLANS), ('token_choice', ROUTED_PLANS))),
      _setting('groups', 'scheme', s + 'scheme', 'groups', (s + 'num_unique', 2),
               refuses=(('expert_choice', ROUTED_PLANS), ('token_choice', ROUTED_PLANS))),
      Feature('explicit', 'scheme', ((s + 'scheme', 'explicit'), (s + 'num_unique', 0),
                                     (s + 'pattern', '0,1,1,0')),
              lambda c: _get(c, s + 'scheme') == 'explicit' and not _tying(c),
              (('expert_choice', ROUTED_PLANS), ('token_choice', ROUTED_PLANS),
               ('loop_inference', LOOPED), ('test_time_depth', DEPTH))),
      # dynamic layer tying (train/dynamic_tying.py): an explicit plan re-chosen in training;
      # it refuses what refuses a fixed explicit plan (`_explicit_or_dynamic`) and these
      Feature('dynamic_tying', 'scheme', ((s + 'scheme', 'explicit'), (s + 'num_unique', 0),
                                          (s + 'pattern', '0,1,1,0'), ('train.tying.every', 1)),
              _tying,
              (('expert_choice', ROUTED_PLANS), ('token_choice', ROUTED_PLANS),
               ('loop_inference', LOOPED), ('test_time_depth', DEPTH),
               *[(n, 'LoRA on the shared layers only comes and goes as the plan shares '
                     'layers or none; valid: model.sharing.lora_layers=all')
                 for n in ('lora', 'lora_experts')],
               ('python_loop', 'model.scan_layers=False stores one module per set, not the '
                               'stack of sets a plan change gathers from'))),
  ]
  routers = [
      _setting(kind, 'routing', 'model.routing.kind', kind,
               refuses=(('lora', NOT_ROUTED), ('untie_norms', NOT_ROUTED),
                        ('python_loop', 'routing needs model.scan_layers=True'),
                        ('flat', FLAT_ROUTED), ('umup', 'the u-muP residual rule is not routed'),
                        ('loop_inference', LOOP_ROUTED),
                        ('test_time_depth', DEPTH_ROUTED)))
      for kind in ('expert_choice', 'token_choice')]
  rc = 'model.recurrence.'
  loopless = tuple((n, NO_LOOP) for n in ('untied', 'sequence', 'middle_sequence', 'explicit'))
  loopless += (('expert_choice', ROUTED_LOOPS), ('token_choice', ROUTED_LOOPS),
               ('umup', UMUP_DEPTH))
  # init_* need an injection (init without one is refused): they set injection=add, and come
  # before inject_* here and by name, so a row holding both keeps the inject_* feature's value.
  recurrent = [
      _setting('poisson_lognormal', 'recurrence_depth', rc + 'depth', 'poisson_lognormal',
               (rc + 'mean', 2.0), (rc + 'backprop', 1),
               refuses=loopless + (('lora', PER_LOOP_PARTS), ('untie_norms', PER_LOOP_PARTS))),
      # fixed depth with its first loops run without gradient (recurrence.backprop below the
      # depth: a no-grad prefix); the sampled depth's alternative, so on the same axis
      Feature('partial_backprop', 'recurrence_depth', ((rc + 'backprop', 1),),
              # (mean 0, the plan's loops: ModelConfig.table_config reads it as that number)
      lambda c: _get(c, rc + 'depth') == 'fixed' and
      1 <= _get(c, rc + 'backprop') < _get(c, rc + 'mean'),
              loopless + (('kv_first', 'a no-grad prefix would hold the first loop and leave '
                                       'the keys and values every later loop reads without '
                                       'gradient'),)),
      *[_setting(f'init_{v}', 'state_init', rc + 'init', v, (rc + 'injection', 'add'),
                 refuses=loopless) for v in ('zeros', 'normal')],
      *[_setting(f'inject_{v}', 'injection', rc + 'injection', v,
                 refuses=loopless) for v in ('add', 'concat')],
      # the loops as Euler steps (models/block.py): branches x R / n at n loops
      Feature('ode_step', 'ode_step', ((rc + 'ode_step', True),),
              lambda c: bool(_get(c, rc + 'ode_step')),
              loopless + (('post', EULER_POST), ('peri', PERI),
                          ('kv_first', 'the shared keys\' loops run outside the loop schedule '
                                       'that sets the step'),
                          ('loop_inference', 'loop-by-loop serving decides the depth while it '
                                             'runs, and the step needs it before the first loop'))),
      # SReT's sliced group attention in the loops (models/attention.py)
      Feature('loop_slices', 'loop_slices', (('model.loop_slices', '2,1'),),
              lambda c: bool(_get(c, 'model.loop_slices')),
              tuple((r[0], SLICED_LOOPLESS if r[1] == NO_LOOP else r[1])
                    for r in loopless if r[0] != 'umup') + (
                  ('poisson_lognormal', SLICED_DEPTH), ('test_time_depth', SLICED_DEPTH),
                          ('loop_inference', 'loop-by-loop serving runs one applied layer at a '
                                             'time without the layer count the slicing reads'),
                          ('kv_first', 'the later loops read the first loop\'s keys and values, '
                                       'which a sliced first loop would hold per slice'))),
      # a loss at every loop's exit: `all`, or one weight per gradient loop
      Feature('exit_all', 'exit_loss', (('train.exit_loss', 'all'),),
              lambda c: str(_get(c, 'train.exit_loss')).replace(' ', '') != 'last', loopless)]
  # model.kv_sharing=first (models/kv_sharing.py): the later loops read the first loop's keys
  # and values, in training and in cached generation.
  kv = [_setting('kv_first', 'kv_sharing', 'model.kv_sharing', 'first', refuses=tuple(
      (n, KV_LOOP) for n in ('untied', 'sequence', 'middle_sequence', 'explicit')) + tuple(
      (n, 'routed recursions attend among their own tokens; recursive KV sharing of a routed '
       'model is not implemented') for n in ('expert_choice', 'token_choice')) + (
      ('poisson_lognormal', 'a no-grad prefix would hold the first loop and leave the keys and '
       'values every later loop reads without gradient'),))]
  # model.moe (models/moe.py): experts in the feed-forward's place; the dispatch features run
  # sigma_moe with that grouped matmul (a switch row keeps its own kind: 'switch' sorts later).
  mo = 'model.moe.'
  moe_refuses = (('expert_choice', MOE_ROUTED), ('token_choice', MOE_ROUTED),
                 ('umup', MOE_UMUP), ('nap', MOE_NAP), ('exit_all', MOE_EXITS),
                 ('geglu', MOE_MLP), ('selu', MOE_MLP))
  per_layer = 'model.scan_layers=False reuses one module per set: no per-layer parts'
  no_mlp = 'the LoRA experts adapt the dense feed-forward, which model.moe.kind replaces'
  # model.moe.router_per_layer: the experts' selector a per-layer part (the shared-expert
  # Conformer, arXiv:2209.08326); it refuses what experts and per-layer parts refuse.
  router = [Feature(
      'moe_router_per_layer', 'moe_router',
      ((mo + 'router_per_layer', True), (mo + 'kind', 'sigma_moe'), (mo + 'num_experts', 4),
       (mo + 'top_k', 2)),
      lambda c: _get(c, mo + 'kind') != 'none' and bool(_get(c, mo + 'router_per_layer')),
      moe_refuses + (('python_loop', per_layer), ('poisson_lognormal', PER_LOOP_PARTS),
                     ('lora_experts', no_mlp)))]
  # The router and dispatch features come first: a config holding one holds a kind too, and a
  # refused pair's line names the first feature of the table that refuses it.
  experts = [Feature(f'moe_{d}', 'moe_dispatch',
                     ((mo + 'dispatch', d), (mo + 'kind', 'sigma_moe'), (mo + 'num_experts', 4),
                      (mo + 'top_k', 2)),
                     lambda c, d=d: _get(c, mo + 'kind') != 'none' and
                     _get(c, mo + 'dispatch') == d, moe_refuses)
             for d in ('ragged_dot', 'reference')]
  experts = router + experts
  experts += [
      _setting('sigma_moe', 'moe', mo + 'kind', 'sigma_moe', (mo + 'num_experts', 4),
               (mo + 'top_k', 2), refuses=moe_refuses),
      _setting('switch', 'moe', mo + 'kind', 'switch', (mo + 'num_experts', 4), (mo + 'top_k', 1),
               refuses=moe_refuses + tuple((a, CAPACITY) for a in (
                   'generation', 'loop_inference', 'test_time_depth')))]
  # model.moe.attention=switchhead (models/switchhead.py): value and output experts per head.
  experts.append(_setting(
      'switchhead', 'moe_attention', mo + 'attention', 'switchhead', (mo + 'attention_experts', 4),
      (mo + 'attention_top_k', 2),
      refuses=tuple((m, SWITCH_V) for m in ('kv_shared', 'qk_shared', 'qkv_shared')) + (
          ('lora', SWITCH_LORA), ('masa', SWITCH_LORA), ('umup', MOE_UMUP),
          ('proj_bias_qkv', SWITCH_BIAS), ('proj_bias_all', SWITCH_BIAS))))
  # model.moe.lora_experts (models/lora_experts.py): routed LoRA experts on the feed-forward;
  # on the 'lora' axis (it sets lora_rank), refusing what depth-wise LoRA or experts refuse.
  experts.append(Feature(
      'lora_experts', 'lora', ((mo + 'lora_experts', 2), (s + 'lora_rank', 2),
                               (s + 'lora_targets', 'mlp_in,mlp_out')),
      lambda c: _get(c, mo + 'lora_experts') > 0,
      (('untied', 'LoRA relaxes shared layers and untied shares none; valid: '
                  'model.sharing.lora_layers=all', lambda c: _get(c, s + 'lora_layers') != 'all'),
       ('expert_choice', NOT_ROUTED), ('token_choice', NOT_ROUTED), ('python_loop', per_layer),
       ('poisson_lognormal', PER_LOOP_PARTS),
       ('umup', 'u-muP defines no rule for LoRA factors'), ('nap', MOE_NAP)) + tuple(
          (k, no_mlp) for k in ('sigma_moe', 'switch', 'moe_ragged_dot', 'moe_reference'))))
  structure = [
      _setting('flat', 'lowering', 'model.scan_lowering', 'flat'),
      _setting('python_loop', 'lowering', 'model.scan_layers', False,
               refuses=(('lora', per_layer), ('untie_norms', per_layer))),
      # depth-wise: not as lora_experts' rank; lora_all (RRT's LoRA on every applied layer,
      # model.sharing.lora_layers=all) refuses what lora refuses (_lora_all), untied aside
      *[Feature(name, 'lora', ((s + 'lora_rank', 2),) + extra,
                lambda c, layers=layers: _get(c, s + 'lora_rank') > 0 and not _get(
                    c, mo + 'lora_experts') and (_get(c, s + 'lora_layers') == 'all') == layers,
                (('kv_shared', NO_V, _targets(s + 'lora_targets', 'v')),
                 ('qkv_shared', NO_V, _targets(s + 'lora_targets', 'v')),
                 ('qk_shared', NO_Q, _targets(s + 'lora_targets', 'q')),
                 ('qkv_shared', NO_Q, _targets(s + 'lora_targets', 'q')),
                 ('umup', 'u-muP defines no rule for depth-wise LoRA factors')))
        for name, extra, layers in (('lora', (), False),
                                    ('lora_all', ((s + 'lora_layers', 'all'),), True))],
      _setting('untie_norms', 'untie_norms', s + 'untie_norms', True),
      Feature('masa', 'masa', (('model.masa.atoms', 2),),
              lambda c: _get(c, 'model.masa.atoms') > 0,
              (('kv_shared', NO_V, _targets('model.masa.targets', 'v')),
               ('qkv_shared', NO_V, _targets('model.masa.targets', 'v')),
               ('qk_shared', NO_Q, _targets('model.masa.targets', 'q')),
               ('qkv_shared', NO_Q, _targets('model.masa.targets', 'q')))),
      # the parameter bank (models/bank.py): every target kernel from one learned bank
      Feature('bank', 'bank', (('model.bank.size', 32 * 160),),
              lambda c: _get(c, 'model.bank.size') > 0,
              (('masa', 'the parameter bank and MASA both generate the block kernels'),
               *_generated_kernels('model.bank.targets'),
               ('umup', BANK_RULE), ('completep', BANK_RULE),
               *[(r, BANK_ONE_MATRIX) for r in PER_KERNEL])),
      # MPO kernels (models/mpo.py): a chain of tensors, the central one shared by all layers
      Feature('mpo', 'mpo', (('model.mpo.cores', 3),),
              lambda c: _get(c, 'model.mpo.cores') > 0,
              (('masa', MPO_OTHER), ('bank', MPO_OTHER),
               *_generated_kernels('model.mpo.targets'),
               *[(p, MPO_RULE) for p in ('mup', 'mup_table3', 'completep', 'umup')],
               *[(r, MPO_TENSORS) for r in PER_KERNEL + ('agc', 'adamp')])),
  ]
  attention = [_setting(m, 'attention_sharing', 'model.attention_sharing', m)
               for m in ('kv_shared', 'qk_shared', 'qkv_shared')]
  values_are_keys = 'recursive inference keeps keys and values per layer; values are keys here'
  attention = [dataclasses.replace(f, refuses=(('loop_inference', values_are_keys),))
               if f.name in ('kv_shared', 'qkv_shared') else f for f in attention]
  # CEM's weight-tied attention (models/projections.py): values are the keys, W_O = W_Q^T
  attention.append(_setting(
      'cem', 'attention_sharing', 'model.attention_sharing', 'cem',
      refuses=(('loop_inference', values_are_keys),
               *_tied_kernels(('q', 'v', 'o'), CEM_KERNELS), ('switchhead', SWITCH_V),
               *[(f, TIED_WRITER) for f in TIED_WRITER_FEATURES],
               ('query_zero_init', 'the output projection is the queries\' transposed, so a zero '
                                   'query would zero the branch'))))
  # CEM's tied MLP (models/mlp.py): the down projection is the nonlinear input one transposed
  attention.append(_setting(
      'mlp_tied', 'mlp_tied', 'model.mlp_tied', True,
      # (LoRA's and MASA's default targets leave the MLP out: naming its kernels there is the
      # model config's one line, ModelConfig._check_shapes)
      refuses=(*[r for r in _tied_kernels(('mlp_in', 'mlp_out'), MLP_TIED_KERNELS)
                 if r[0] in ('bank', 'mpo')],
               *[(m, 'the experts replace the dense MLP whose projections it ties')
                 for m in ('sigma_moe', 'switch', 'moe_ragged_dot', 'moe_reference',
                           'moe_router_per_layer', 'lora_experts')],
               *[(f, TIED_WRITER) for f in TIED_WRITER_FEATURES])))
  norms = [_setting(k, 'norm', 'model.norm.kind', k)
           for k in ('layernorm', 'crmsnorm', 'scalenorm', 'dyt', 'none', 'lpnorm')]
  # model.norm.kind=powernorm | unified_norm | online_norm (sharenet/models/norm_stats.py): running
  # statistics per
  # applied layer, in TrainState.tstate, read from the training step's cotangents.
  stats_layers = 'a statistics norm keeps running statistics per applied layer of the plan'
  norms += [_setting(kind, 'norm', 'model.norm.kind', kind, refuses=(
      ('expert_choice', stats_layers + '; routed recursions are not applied layers'),
      ('token_choice', stats_layers + '; routed recursions are not applied layers'),
      ('poisson_lognormal', stats_layers + '; a sampled depth runs others'),
      ('partial_backprop', 'a statistics norm reads its new statistics back from gradients, so '
                           'the loops of the no-grad prefix would store a statistic of 0 (set '
                           'model.recurrence.backprop=0 for every loop with gradient)'),
      ('exit_all', stats_layers + '; the exits\' loss runs the loops by a schedule that does '
                  'not carry them'),
      ('python_loop', per_layer),
      ('umup', 'u-muP rescales the loss gradient, which the backward statistic reads'),
      ('grad_accum', 'the statistic is per batch (valid: train.grad_accum=1)'),
      ('loop_inference', stats_layers + '; loop-by-loop inference reads the stored sets only'),
      ('test_time_depth', stats_layers + '; another depth runs layers without them')))
      for kind in ('powernorm', 'unified_norm', 'online_norm')]
  # model.mlp=selu: Klambauer et al.'s self-normalizing feed-forward, on the mlp axis with GeGLU;
  # its pair with the norm `none` is the paper's normalization-free baseline.
  norms.append(_setting('selu', 'mlp', 'model.mlp', 'selu'))
  placements = [_setting('post', 'placement', 'model.norm.placement', 'post',
                         refuses=(('umup', 'u-muP\'s residual rule needs pre or peri norms'),)),
                _setting('peri', 'placement', 'model.norm.placement', 'peri',
                         refuses=(('completep', PERI), ('inv_R', PERI), ('inv_sqrt_R', PERI))),
                # MoEUT's peri-layernorm (models/block.py): values read the raw stream
                _setting('moeut', 'placement', 'model.norm.placement', 'moeut',
                         refuses=(('umup', 'u-muP\'s residual rule is written for pre and peri '
                                           'norms'),
                                  ('kv_shared', MOEUT_V), ('qkv_shared', MOEUT_V)))]
  qk = [_setting('qk_rms', 'qk_norm', 'model.norm.qk_norm', 'rms'),
        _setting('qk_l2', 'qk_norm', 'model.norm.qk_norm', 'l2')]
  width = ('parametrization.base_d_model', 16)
  pzs = [_setting(k, 'parametrization', 'parametrization.kind', k, width)
         for k in ('mup', 'mup_table3', 'completep')]
  pzs.append(_setting('umup', 'parametrization', 'parametrization.kind', 'umup',
                      refuses=(('loop_inference', UMUP_LAYER), ('test_time_depth', UMUP_DEPTH))))
  atoms = 'MASA atoms serve every set, so a per-set loop multiplier has no kernel to scale'
  loop_rules = [_setting(r, 'loop_rule', 'parametrization.loop_rule', r,
                         refuses=(('masa', atoms),)) for r in ('inv_R', 'inv_sqrt_R')]
  reparams = [_setting(r, 'reparam', 'transforms.reparam', r, contains=True)
              for r in ('zero_mean_writers', 'weight_std', 'weight_norm', 'sigma_reparam',
                        'weight_conditioning')]
  # the compander's scale starts at the matrix's RMS: 0 for a zero-initialised one, and 0 / 0
  zero_scale = ('the compander\'s scale starts at the matrix\'s RMS, 0 for a zero-initialised '
                'matrix (its weights would be 0 / 0)')
  reparams.append(_setting('compander', 'reparam', 'transforms.reparam', 'compander',
                           contains=True, refuses=(('query_zero_init', zero_scale),
                                                   ('readout_zero_init', zero_scale))))
  no_gain = 'scale_vectors reparameterises norm gain vectors and this norm has none'
  reparams.append(_setting('scale_vectors', 'reparam', 'transforms.reparam', 'scale_vectors',
                           contains=True, refuses=(('none', no_gain), ('scalenorm', no_gain))))
  projections = [_setting(p, 'project', 'transforms.project', p)
                 for p in ('ngpt', 'norm_project')]
  projections.append(_setting('nap', 'project', 'transforms.project', 'nap',
                              ('model.norm.pre_activation', 'rmsnorm')))
  no_rule = 'AdamP has no per-leaf multipliers yet (valid with it: parametrization.kind=sp)'
  updates = [_setting('agc', 'updates', 'transforms.updates', 'agc', contains=True),
             _setting('adamp', 'updates', 'transforms.updates', 'adamp', contains=True,
                      refuses=tuple((k, no_rule) for k in ('mup', 'mup_table3', 'completep',
                                                           'umup')))]
  # train.optimizer (sharenet/optim/matrix.py): Muon / Shampoo on the hidden kernels, Adam on
  # the rest; the Adam-only presets and AdamP (which replaces Adam) are refused.
  adam_only = 'this parametrization is written for AdamW (valid with muon / shampoo: sp, mup)'
  # shampoo is grafted to Adam (train.shampoo.graft=adam), shampoo_vanilla is not (graft=none).
  refuses = tuple((k, adam_only) for k in ('mup_table3', 'completep', 'umup')) + (
      ('adamp', 'AdamP replaces Adam; valid with it: train.optimizer=adamw'),)
  # train.muon.scale (shape | rms) only changes one constant per kernel on the same code path
  # and pairs as muon does, so it is not a feature of its own (tests/optim/test_matrix.py).
  graft = lambda c: _get(c, 'train.shampoo.graft')
  kfac_graft = lambda c: _get(c, 'train.kfac.graft')
  optimizers = [
      _setting('muon', 'optimizer', 'train.optimizer', 'muon', refuses=refuses),
      Feature('shampoo', 'optimizer', (('train.optimizer', 'shampoo'),),
              lambda c: _get(c, 'train.optimizer') == 'shampoo' and graft(c) != 'none', refuses),
      Feature('shampoo_vanilla', 'optimizer',
              (('train.optimizer', 'shampoo'), ('train.shampoo.graft', 'none')),
              lambda c: _get(c, 'train.optimizer') == 'shampoo' and graft(c) == 'none', refuses),
      # K-FAC (sharenet/optim/kfac.py) on the hidden kernels, its statistics from the Dense
      # layers' taps (sharenet/models/curvature.py); grafted to Adam or not (train.kfac.graft)
      Feature('kfac', 'optimizer', (('train.optimizer', 'kfac'),),
              lambda c: _get(c, 'train.optimizer') == 'kfac' and kfac_graft(c) != 'none',
              refuses + KFAC_REFUSES),
      Feature('kfac_vanilla', 'optimizer',
              (('train.optimizer', 'kfac'), ('train.kfac.graft', 'none')),
              lambda c: _get(c, 'train.optimizer') == 'kfac' and kfac_graft(c) == 'none',
              refuses + KFAC_REFUSES),
      # Scion (sharenet/optim/scion.py): every leaf on its role's LMO, constrained by default
      # (which decays by itself: train.weight_decay=0)
      Feature('scion', 'optimizer', (('train.optimizer', 'scion'), ('train.weight_decay', 0.0)),
              lambda c: _get(c, 'train.optimizer') == 'scion',
              tuple((k, 'this parametrization is written for AdamW (valid with scion: sp, mup)')
                    for k in ('mup_table3', 'completep', 'umup')) + (
                  ('adamp', 'AdamP replaces Adam; valid with it: train.optimizer=adamw'),
                  ('mpo', 'Scion has no LMO for an MPO chain\'s tensors (no matrix view)')))]
  remats = [_setting(r, 'remat', 'model.remat', r)
            for r in ('full', 'dots', 'dots_no_batch', 'save_names', 'except_attn')]
  numerics = [_setting('pallas', 'kernels', 'model.kernels', 'pallas'),
              _setting('bfloat16', 'dtype', 'model.dtype', 'bfloat16'),
              Feature('grad_accum', 'grad_accum', (('train.grad_accum', 2),),
                      lambda c: _get(c, 'train.grad_accum') > 1),
              _setting('segment_mask', 'segment_mask', 'data.segment_mask', True)]
  # Options a Hugging Face import sets (sharenet/interop/): Gemma's GeGLU and embedding scale,
  # Qwen2's q/k/v biases, GPT-2's biases on every block projection.
  imported = [_setting('geglu', 'mlp', 'model.mlp', 'geglu',
                       refuses=(('umup', 'u-muP has no unit-scaled GeGLU; valid: mlp=swiglu or '
                                 'gelu'),)),
              _setting('proj_bias_qkv', 'proj_bias', 'model.proj_bias', 'qkv'),
              _setting('proj_bias_all', 'proj_bias', 'model.proj_bias', 'all'),
              Feature('embed_scale', 'embed_scale', (('model.embed_scale', 2.0),),
                      lambda c: _get(c, 'model.embed_scale') != 1.0),
              # Gemma 2's logit soft-capping of the attention and the output logits
              Feature('attn_softcap', 'attn_softcap', (('model.attn_softcap', 5.0),),
                      lambda c: _get(c, 'model.attn_softcap') > 0,
                      (('umup', 'u-muP\'s unit-scaled attention has no soft-capping rule'),)),
              Feature('logit_softcap', 'logit_softcap', (('model.logit_softcap', 5.0),),
                      lambda c: _get(c, 'model.logit_softcap') > 0,
                      (('umup', 'u-muP\'s unit-scaled loss has no soft-capping rule'),)),
              # Llama 3.1's RoPE scaling and position interpolation (models/positions.py)
              _setting('rope_llama3', 'rope_scaling', 'model.rope_scaling.kind', 'llama3',
                       ('model.rope_scaling.factor', 8.0),
                       ('model.rope_scaling.original_max_len', 16)),
              _setting('rope_linear', 'rope_scaling', 'model.rope_scaling.kind', 'linear',
                       ('model.rope_scaling.factor', 2.0))]
  # Model and parametrization options without an axis above. Each refusal here is the one the
  # model's or the parametrization's own validation raises too (models/config.py, scaling.py).
  tied_roles = 'one tensor cannot carry the embedding\'s and the readout\'s rules'
  rope_only = 'RoPE scaling scales RoPE, which this position kind does not use'
  no_mults = 'AdamP has no per-leaf multipliers yet (valid with it: qk_lr=1, wd_mode=auto)'
  qk_v = 'the key kernel is the value projection too here, so its LR multiplier would move ' \
      'the values\' LR as well'
  queries_are_keys = 'qk_shared / qkv_shared make the queries the keys'
  # the self-attentive embedding (models/embeddings.py) attends over the sequence before the
  # blocks, with ops of its own
  no_cache = ('the self-attentive embedding attends over the sequence before the blocks, and '
              'cached decoding keeps no cache for it')
  on_sphere = ('nGPT keeps the embedding rows on the unit sphere at width d_model, which a '
               'factorized table reaches only through its lift')
  safe = (('generation', no_cache), ('loop_inference', no_cache), ('test_time_depth', no_cache),
          ('umup', 'u-muP\'s unit-scaled ops do not cover the self-attentive embedding\'s '
                   'attention and GELU'))
  options = [
      # tied without model.center_embedding (which zero_mean_writers takes with a tied table)
      Feature('tie_embeddings', 'tie_embeddings', (('model.tie_embeddings', True),),
              lambda c: _get(c, 'model.tie_embeddings') and not _get(c, 'model.center_embedding'),
              (('mup_table3', tied_roles), ('umup', tied_roles),
               ('zero_mean_writers', 'zero-mean writers would recentre the tied readout too '
                                     '(model.center_embedding=True recentres the inputs only)'))),
      Feature('gqa', 'kv_heads', (('model.num_kv_heads', 1),),
              lambda c: _get(c, 'model.num_kv_heads') not in (0, _get(c, 'model.num_heads')),
              tuple((m, queries_are_keys + ', so they need as many kv heads as heads')
                    for m in ('qk_shared', 'qkv_shared'))),
      *[_setting(name, 'position', 'model.position', kind,
                 refuses=(('rope_llama3', rope_only), ('rope_linear', rope_only)))
        for name, kind in (('learned_positions', 'learned'), ('no_positions', 'none'))],
      *[Feature(f'embed_{proj}', 'embed_factor',
                (('model.embed_dim', 16), ('model.embed_projection', proj)),
                lambda c, proj=proj: (bool(_get(c, 'model.embed_dim')) and
                                      _get(c, 'model.embed_projection') == proj),
                refuses + (('ngpt', on_sphere),))
        for proj, refuses in (('linear', ()), ('self_attentive', safe))],
      _setting('gelu', 'mlp', 'model.mlp', 'gelu'),
      _setting('fixnorm', 'fixnorm', 'model.norm.fixnorm', True),
      Feature('qk_lr', 'qk_lr', (('parametrization.qk_lr', 4.0),),
              lambda c: _get(c, 'parametrization.qk_lr') != 1.0,
              (('kv_shared', qk_v), ('qkv_shared', qk_v), ('adamp', no_mults))),
      _setting('wd_independent', 'wd_mode', 'parametrization.wd_mode', 'independent',
               refuses=(('adamp', no_mults),)),
      _setting('readout_zero_init', 'readout_zero_init', 'parametrization.readout_zero_init',
               True, refuses=(('tie_embeddings', 'tied embeddings store no readout of their own '
                                                 '(zeroing the table would zero the inputs)'),)),
      _setting('query_zero_init', 'query_zero_init', 'parametrization.query_zero_init', True,
               refuses=tuple((m, queries_are_keys) for m in ('qk_shared', 'qkv_shared')))]
  # test_time_depth: evaluation and cached generation at another number of loops
  # (sharenet/inference/test_time_depth.py); loop_inference serves the exit criteria and sampling
  # (sharenet/inference/exits.py, sharenet/inference/loop_by_loop.py).
  actions = [Feature('generation', 'generation', (), lambda c: False, action=True),
             Feature('loop_inference', 'loop_inference', (), lambda c: False, action=True),
             Feature('test_time_depth', 'test_time_depth', (), lambda c: False, action=True)]
  return _lora_all(_explicit_or_dynamic(_values_are_keys(
      schemes + routers + recurrent + kv + experts + structure + attention + norms + placements +
      qk + pzs + loop_rules + reparams + projections + updates + optimizers + remats + numerics +
      imported + options + actions)))


def _tying(config: Any) -> bool:
  """Whether `config` turns dynamic layer tying on (train.tying.every > 0)."""
  return int(_get(config, 'train.tying.every')) > 0


def _explicit_or_dynamic(features: list[Feature]) -> list[Feature]:
  """The table, where what refuses a fixed explicit plan refuses dynamic tying too: every
  plan it chooses is explicit."""
  return [dataclasses.replace(f, refuses=f.refuses + tuple(
      ('dynamic_tying', *rest) for other, *rest in f.refuses if other == 'explicit'))
          for f in features]


def _tied_kernels(targets: tuple[str, ...], why: str) -> tuple[tuple, ...]:
  """Refusals of the kernel-target lists (LoRA, MASA, bank, MPO) naming any of `targets`: a
  tied transpose reads its partner's plain kernel."""
  keys = (('lora', 'model.sharing.lora_targets'), ('masa', 'model.masa.targets'),
          ('bank', 'model.bank.targets'), ('mpo', 'model.mpo.targets'))
  names = lambda key: lambda c: bool(
      set(targets) & set(str(_get(c, key)).replace(' ', '').split(',')))
  return tuple((f, why, names(key)) for f, key in keys)


def _values_are_keys(features: list[Feature]) -> list[Feature]:
  """The table, where what refuses kv_shared (values are the keys) refuses cem too."""
  return [dataclasses.replace(f, refuses=f.refuses + tuple(
      ('cem', *rest) for other, *rest in f.refuses if other == 'kv_shared'))
          if f.name != 'cem' else f for f in features]


def _lora_all(features: list[Feature]) -> tuple[Feature, ...]:
  """The table, where a feature refusing depth-wise LoRA on the shared layers ('lora') refuses
  it on every layer ('lora_all') for the same reason; untied, which shares no layer, and dynamic
  tying, whose per-layer parts stay while its plan changes, take it."""
  out = []
  for f in features:
    extra = tuple(('lora_all', *rest) for other, *rest in f.refuses
                  if other == 'lora' and f.name not in ('untied', 'dynamic_tying'))
    out.append(dataclasses.replace(f, refuses=f.refuses + extra) if extra else f)
  return tuple(out)


# convert.py's config.to (sharenet/main/convert_workdir.py): each conversion of a trained model
# is an action whose source is the features it implies (their overrides are its rows' configs).
# It refuses what they refuse and the other values of their axes, beside its own refusals.
NGPT_CONV = ('its projection would re-normalise the converted matrices, so the converted model '
             'would not compute the source\'s function')
NON_SP = 'the forward multipliers would be folded into the weights and then applied again'
NO_STATS = 'it does not carry the running statistics (they would restart at their init)'
UNKNOWN_PARTS = 'it does not know SwitchHead\'s or the LoRA experts\' parameters'
PER_LAYER_ROUTERS = 'it does not carry per-layer expert selectors (model.moe.router_per_layer)'
FACTORIZED = ('it does not map a factorized embedding\'s table and lift (model.embed_dim: the '
              'table\'s width is not d_model)')
BANK_CONVERT = 'it reads and writes plain kernels, not generated ones (bank, MPO)'
NORM_PRE = 'the equivalence uses that only norms read the stream (norm placement pre)'
TIED_READERS = 'folding a norm into tied readers would untie them'
WHOLE_HEADS = ('it copies whole heads (their q, k, v and o slices): plain kernels, as many kv '
               'heads as heads, no QK-norm gain (one per layer, not per head)')
MOE_READERS = ('the experts read the normed stream through expert kernels, which the fold of '
               'the norm into its readers does not know')
STREAM_READERS = ('{} reads the stream itself, not through a norm, so the stream\'s mean, which '
                  'the conversion moves into the norms, would reach it')
FOLD_LAYOUT = ('model.scan_layers=False stores one module per set, not the stacked layout the '
               'fold reads')
FIXNORM_FOLD = 'fixnorm renormalises the embedding rows, which the fold recentres'
TIED_FOLD = 'a norm folded into a reader whose transpose is a writer (CEM) would scale it too'
NORM_FOLDS = (('placement', NORM_PRE), ('untie_norms', TIED_READERS), ('lora', TIED_READERS),
              ('cem', TIED_FOLD), ('mlp_tied', TIED_FOLD),
              ('moe', MOE_READERS), ('moe_dispatch', MOE_READERS), ('fixnorm', FIXNORM_FOLD),
              ('python_loop', FOLD_LAYOUT),
              ('masa', 'MASA\'s kernels are combinations of atoms every layer shares, so one '
                       'layer\'s norm cannot be folded into them'))
RAW_STREAM_READS = (('routing', STREAM_READERS.format('the router')),
                ('inject_concat', STREAM_READERS.format('the concat injection\'s adapter')),
                ('init_normal', 'the random initial state is not zero-mean, as the converted '
                                'stream must be'))
CONVERSIONS = {   # config.to: (implied features, own refusals: (an axis, a feature, or
                  # 'norm_stats' (the statistics norms), why))
    'rmsnorm': (('layernorm',), *NORM_FOLDS, *RAW_STREAM_READS),
    'crmsnorm': (('layernorm',), *NORM_FOLDS, *RAW_STREAM_READS),
    'recursive': (('untied',), ('lora', 'the source already has depth-wise LoRA'),
                  ('norm_stats', NO_STATS)),
    'head_shared': (('untied',), ('attention_sharing', WHOLE_HEADS), ('masa', WHOLE_HEADS),
                    ('lora', WHOLE_HEADS), ('kv_heads', WHOLE_HEADS), ('qk_norm', WHOLE_HEADS),
                    ('norm_stats', NO_STATS)),
    'merge_lora_experts': (('lora_experts',), ('norm_stats', NO_STATS),
                           ('switchhead', 'the merge makes depth-wise LoRA, which SwitchHead '
                                          'refuses (its v and o are experts)')),
    'fold_unified_norm': (('unified_norm', 'untied'), *NORM_FOLDS),
    # any plan grows (its stacks' axes are not widths); what holds a width-sized axis of its own
    # (the concat injection's [e; x] input) or width statistics is refused
    # MPO kernels from plain ones (sharenet/transforms/to_mpo.py)
    'mpo': ((), ('masa', 'MASA\'s kernels are combinations of shared atoms, not plain kernels'),
            ('norm_stats', NO_STATS)),
    'wider': ((), ('norm_stats', NO_STATS),
              ('inject_concat', 'the concat injection\'s adapter reads [e; x], an axis of twice '
                                'the width that the growth does not map')),
}
STATS_NORM_FEATURES = ('powernorm', 'unified_norm', 'online_norm')


def _conversions(table: tuple[Feature, ...]) -> tuple[Feature, ...]:
  """The conversion actions of CONVERSIONS over the feature table `table`."""
  by_name = {f.name: f for f in table}
  out = []
  for to, (implied, *own) in CONVERSIONS.items():
    name = f'convert_{to}'
    overrides = tuple(kv for f in implied for kv in by_name[f].overrides)
    refuses = []
    for f in implied:
      source = by_name[f]
      refuses += [(g.name, f'it converts a model with {source.label}') for g in table
                  if g.axis == source.axis and g.name != f and not g.action]
      refuses += [(other, *rest) for other, *rest in source.refuses
                  if not by_name[other].action]
      refuses += [(g.name, why, *when) for g in table for other, why, *when in g.refuses
                  if other == f and not g.action]
    for key, why in own:
      group = STATS_NORM_FEATURES if key == 'norm_stats' else [
          g.name for g in table if g.axis == key] or [key]
      refuses += [(g, why) for g in group if g not in implied]
    refuses += [('ngpt', NGPT_CONV)]
    if to != 'wider':   # wider applies the forward multipliers and divides out the new ones
      refuses += [(g.name, NON_SP) for g in table
                  if g.axis in ('parametrization', 'loop_rule')]
    if to != 'merge_lora_experts':
      refuses += [('switchhead', UNKNOWN_PARTS), ('lora_experts', UNKNOWN_PARTS)]
    if to != 'wider':   # the growth reads the role table; the others place parts by name
      refuses += [('moe_router_per_layer', PER_LAYER_ROUTERS)]
    refuses += [(g.name, FACTORIZED) for g in table if g.axis == 'embed_factor']
    refuses += [('bank', BANK_CONVERT), ('mpo', BANK_CONVERT)]
    seen, unique = set(), []
    for r in refuses:   # the first reason of a pair stays
      if r[0] not in seen and r[0] not in implied:
        seen.add(r[0])
        unique.append(r)
    out.append(Feature(name, 'conversion', overrides, lambda c: False, tuple(unique),
                       action=True))
  return tuple(out)


FEATURES = _features()
FEATURES = FEATURES + _conversions(FEATURES)
BY_NAME = {f.name: f for f in FEATURES}


def refusal(a: str, b: str, config: Any = None) -> str | None:
  """Why features a and b do not combine (None: they do, or they share an axis); with a
  `config`, only where a narrowed refusal's `when` holds for it."""
  fa, fb = BY_NAME[a], BY_NAME[b]
  if fa.axis == fb.axis:
    return None
  for x, y in ((fa, fb), (fb, fa)):
    for other, why, *when in x.refuses:
      if other == y.name and (config is None or not when or when[0](config)):
        return why
  return None


def _message(a: Feature, b: Feature, why: str) -> str:
  return f'{a.label} with {b.label}: {why}; valid: either one without the other'


def active(config: Any) -> list[str]:
  """The table's config features that `config` turns on."""
  out = []
  for f in FEATURES:
    if f.action:
      continue
    try:
      if f.on(config):
        out.append(f.name)
    except (KeyError, AttributeError, TypeError):
      continue
  return out


def check(config: Any) -> None:
  """One ConfigError line for the first refused pair of features `config` turns on."""
  for a, b in itertools.combinations(active(config), 2):
    why = refusal(a, b, config)
    if why:
      raise ConfigError(_message(BY_NAME[a], BY_NAME[b], why))


def check_action(action: str, config: Any, what: str | None = None) -> None:
  """One ConfigError line if `action` (an operation on a trained model) refuses a feature of
  `config` (an experiment config, or ModelConfig.table_config()); `what` names the operation
  as the user asked for it (a flag), default the action's name."""
  for a in active(config):
    why = refusal(action, a, config)
    if why:
      label = BY_NAME[a].label
      raise ConfigError(f'{what or action} of a model with {label}: {why}; valid: a model '
                        f'without {label}')


def is_pair(a: Feature, b: Feature) -> bool:
  """Features on different axes, but not a conversion with another action: a conversion writes
  a new model, which the other actions then read as any other."""
  return a.axis != b.axis and not (a.action and b.action and
                                   'conversion' in (a.axis, b.axis))


def pairs() -> list[tuple[str, str, str | None]]:
  """Every pair of features (`is_pair`): (a, b, why refused or None)."""
  return [(a.name, b.name, refusal(a.name, b.name))
          for a, b in itertools.combinations(FEATURES, 2) if is_pair(a, b)]
