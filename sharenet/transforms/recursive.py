"""Untied -> recursive (convert.py --config.to=recursive), after Relaxed Recursive Transformers
(Bae et al., arXiv:2410.20672).

Each unique set of the target plan is initialised from the untied layers: Stepwise
(round(linspace(0, L-1, K)); middle schemes linspace(1, L-2, K-2); Python's banker's rounding
as in the RRT code), Average (the mean of the layers that will use the set) or Lower (the first
K layers; middle schemes 1..K-2 plus the verbatim first and last). Optional depth-wise LoRA
comes from the truncated SVD of each applied layer's residual W_l - W_shared, exact at full rank
for any lora_scale (B is divided by it), on the layers that hold LoRA
(model.sharing.lora_layers: shared = RRT's looped layers only, or all).

init=similar (scheme explicit) folds by the similarity of the layers' outputs on a calibration
batch, after FoldGPT (Liu et al., arXiv:2407.00928, which finds most layers' outputs similar and
shares weights within groups of adjacent blocks): the L layers are split into K contiguous
groups, each tied to its most representative member (`similarity.similarity_groups`); with SVD
LoRA every other member is a removed block replaced by the kept block's weights plus a low-rank
adapter from the SVD of the difference (transforms/similarity.py).

Block choices first (transforms/block_select.py): config.remove_rate removes the least
important blocks (FoldGPT's learned gates, or Block Influence) before the rest are tied;
init=replace prunes the blocks of least Block Influence and gives each a donor's weights plus
its SVD adapter (FlexiGPT, arXiv:2501.14713); init=extend inserts tied copies of chosen layers.

CLI and what it writes: transforms/convert.py's docstring.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.kernels import linalg
from sharenet.models import sharing
from sharenet.config import compat
from sharenet.errors import require
from sharenet.models import DecoderLM, ModelConfig, init_variables, layout, param_table
from sharenet.models.sections import LORA_LAYERS
from sharenet.models.params import KERNEL_ROLES, NORM_ROLES, PER_LAYER
from sharenet.transforms import block_select, similarity

INITS = ('stepwise', 'average', 'lower', 'similar', 'replace', 'extend')
PATTERN_INITS = ('similar', 'replace', 'extend')   # scheme=explicit: a chosen pattern
SET_COUNT_INITS = tuple(i for i in INITS if i not in ('replace', 'extend'))   # read num_unique
RECURSIVE_SCHEMES = ('universal', 'cycle', 'sequence', 'middle_cycle', 'middle_sequence',
                     'explicit')


def source_layers(cfg: ModelConfig, num_unique: int, scheme: str, init: str) -> list[list[int]]:
  """For each unique set of the target plan, the source layers it is initialised from."""
  plan = sharing.make_plan(scheme, cfg.num_layers, num_unique)
  L = cfg.num_layers
  if init == 'average':
    return [list(plan.uses(u)) for u in range(plan.num_unique)]
  middle = scheme.startswith('middle_')
  k = plan.num_unique - 2 if middle else plan.num_unique
  lo, hi = (1, L - 2) if middle else (0, L - 1)
  if init == 'stepwise':
    # Python's round (half to even), as the RRT code's selection_initialize.
    picks = [round(float(x)) for x in np.linspace(lo, hi, k)]
  else:
    picks = list(range(lo, lo + k))
  if middle:
    picks = [0] + picks + [L - 1]
  return [[p] for p in picks]


class Selection(NamedTuple):
  """convert.py's block choices before tying (transforms/block_select.py): FoldGPT removal,
  FlexiGPT replacement (init=replace) and extension (init=extend)."""
  remove_rate: float = 0.0
  importance: str = 'gates'
  gate_steps: int = 100
  gate_lr: float = 0.02
  gate_l1: float = 0.01
  replace_rate: float = 0.0
  insert_after: str = ''

  @classmethod
  def from_options(cls, opts: Any) -> 'Selection':
    return cls(**{k: opts.get(k, getattr(cls(), k)) for k in cls._fields})


def needs_calibration(init: str, select: Selection) -> bool:
  """Whether the conversion reads the calibration batch's streams."""
  return init in ('similar', 'replace') or select.remove_rate > 0


def to_recursive(cfg: ModelConfig, variables: Any, scheme: str, num_unique: int, init: str,
                 lora_rank: int = 0, lora_init: str = 'zero', lora_targets: tuple = (),
                 untie_norms: bool = False, seed: int = 0, lora_layers: str = 'shared',
                 calibration: np.ndarray | None = None, select: Selection = Selection()
                 ) -> tuple[ModelConfig, Any]:
  """Untied -> recursive with `num_unique` stored sets (see the module docstring);
  init=similar, init=replace and select.remove_rate read `calibration` (N, T) tokens."""
  new_cfg, out, _ = convert(cfg, variables, scheme, num_unique, init, lora_rank, lora_init,
                            lora_targets, untie_norms, seed, lora_layers, calibration, select)
  return new_cfg, out


def convert(cfg: ModelConfig, variables: Any, scheme: str, num_unique: int, init: str,
            lora_rank: int = 0, lora_init: str = 'zero', lora_targets: tuple = (),
            untie_norms: bool = False, seed: int = 0, lora_layers: str = 'shared',
            calibration: np.ndarray | None = None, select: Selection = Selection()
            ) -> tuple[ModelConfig, Any, dict[str, Any]]:
  """to_recursive's (config, variables) and what it chose (the summary's entries: the pattern,
  the removed blocks and their importance, the replaced blocks and their donors)."""
  compat.check_action('convert_recursive', cfg.table_config(), 'config.to=recursive')
  require(scheme in RECURSIVE_SCHEMES,
          f'config.scheme={scheme!r} is unknown; valid: {", ".join(RECURSIVE_SCHEMES)}')
  require(init in INITS, f'config.init={init!r} is unknown; valid: {", ".join(INITS)}')
  require((init in PATTERN_INITS) == (scheme == 'explicit'),
          f'config.init={init} with config.scheme={scheme}: init={"/".join(PATTERN_INITS)} '
          f'build an explicit pattern; valid: those with scheme=explicit, or another init with '
          f'{", ".join(RECURSIVE_SCHEMES[:-1])}')
  require(lora_init in ('zero', 'svd'),
          f'config.lora_init={lora_init!r} is unknown; valid: zero, svd')
  require(lora_layers in LORA_LAYERS, f'config.lora_layers={lora_layers!r} is unknown; valid: '
          f'{", ".join(LORA_LAYERS)}')
  require((select.replace_rate > 0) == (init == 'replace'),
          f'config.replace_rate={select.replace_rate} with config.init={init}: the rate of '
          f'replaced blocks belongs to init=replace; valid: both or neither')
  require(bool(select.insert_after) == (init == 'extend'),
          f'config.insert_after={select.insert_after!r} with config.init={init}: the repeated '
          f'layers belong to init=extend; valid: both or neither')
  info: dict[str, Any] = {}
  if needs_calibration(init, select):
    require(calibration is not None, f'config.init={init} (or config.remove_rate) needs a '
                                     f'calibration batch')
  if select.remove_rate > 0:   # FoldGPT: the least important blocks go first
    n = block_select.count(select.remove_rate, cfg.num_layers, 'remove_rate')
    score = block_select.importance(cfg, variables, calibration, select)
    removed = block_select.least(score, n)
    kept = [l for l in range(cfg.num_layers) if l not in removed]
    info.update(removed=removed, importance=[round(float(x), 6) for x in score])
    cfg, variables = _assemble(cfg, variables, cfg.derive(num_layers=len(kept)),
                               [[k] for k in kept], kept, seed)
  L = cfg.num_layers
  sources, pattern = list(range(L)), None
  if init == 'similar':
    pattern, reps = similarity.fold_plan(cfg, variables, calibration, num_unique)
  elif init == 'replace':
    pattern, reps, chosen = block_select.replacement_pattern(
        cfg, variables, calibration, select.replace_rate, lora_rank,
        tuple(lora_targets) or cfg.sharing.lora_targets)
    info.update(chosen)
  elif init == 'extend':
    pattern = sources = block_select.extended_pattern(
        L, block_select.parse_layers(select.insert_after, L, 'insert_after'))
    reps = list(range(L))
  if pattern is not None:
    info['pattern'] = ','.join(map(str, pattern))
  new_cfg = cfg.derive(num_layers=len(sources), sharing={
      'scheme': scheme, 'num_unique': 0 if pattern else num_unique, 'repeats': 0,
      'pattern': info.get('pattern', ''),
      'lora_rank': lora_rank, 'lora_targets': tuple(lora_targets) or cfg.sharing.lora_targets,
      'untie_norms': untie_norms, 'lora_layers': lora_layers})
  picks = [[r] for r in reps] if pattern else source_layers(cfg, num_unique, scheme, init)
  return new_cfg, _assemble(cfg, variables, new_cfg, picks, sources, seed,
                            svd=bool(lora_rank) and lora_init == 'svd')[1], info


def _assemble(cfg: ModelConfig, variables: Any, new_cfg: ModelConfig, picks: list[list[int]],
              sources: list[int], seed: int, svd: bool = False) -> tuple[ModelConfig, Any]:
  """The variables of `new_cfg` from untied `cfg`'s: stored set u is the mean of the source
  layers picks[u]; applied layer l's own parts (untied norms, SVD LoRA) come from source layer
  sources[l]; embedding, final norm and readout are copied."""
  src = {p: v for p, v in layout.applied_params(variables['params'], cfg).items()}
  if PER_LAYER in variables:
    src.update(layout.applied_per_layer(variables[PER_LAYER], cfg))
  plan = new_cfg.plan
  # one compiled program (op by op, an init compiles each scan and initializer separately)
  target = jax.jit(lambda key: init_variables(DecoderLM(new_cfg), key))(jax.random.key(seed))
  shared_paths = layout.unique_sets(target['params'], new_cfg).keys()
  sets = {p: jnp.stack([jnp.mean(src[p][jnp.asarray(ls)], axis=0) for ls in picks])
          for p in shared_paths}
  out = dict(target)
  out['params'] = layout.from_unique_sets(target['params'], sets, new_cfg)
  outside = {p[1:] for p, i in param_table(cfg).items() if p[0] == 'params' and not i.in_block}
  out['params'] = unflatten_dict({**flatten_dict(out['params']),
                                  **{p: v for p, v in flatten_dict(variables['params']).items()
                                     if p in outside}})   # embedding, final norm, readout
  if PER_LAYER in target:
    applied = {p: v[jnp.asarray(sources)] for p, v in src.items()}   # per new applied layer
    layers = layout.applied_per_layer(target[PER_LAYER], new_cfg)
    norms = {i.local for p, i in param_table(new_cfg).items()
             if p[0] == PER_LAYER and i.role in NORM_ROLES}
    for p in layers:
      if p in norms:                 # untied norm parameters: each applied layer's own
        layers[p] = applied[p]
    if svd:
      # Factors for every applied layer; from_applied_per_layer keeps only the layers that hold
      # LoRA (lora_layers=shared: not the unique first / last layers, copied exactly, so their
      # residual is zero and they need none).
      layers.update(svd_lora(applied, sets, plan.index, new_cfg))
    out[PER_LAYER] = layout.from_applied_per_layer(target[PER_LAYER], layers, new_cfg)
  return new_cfg, out


def svd_lora(src: dict, sets: dict, index: tuple, cfg: ModelConfig) -> dict:
  """A_l, B_l with scale * A_l B_l = trunc_r(W_l - W_shared(l)) (RRT SVD init, arXiv:2410.20672).

  Flax kernels are (in, out): R = U S V^T, so A = U_r (in, r) and B = S_r V_r^T / scale.
  """
  out = {}
  idx = jnp.asarray(index)
  r = cfg.sharing.lora_rank
  table = param_table(cfg)
  # A LoRA factor's kernel: the block kernel created by the same module (block-local paths).
  kernels = {i.local[:-1]: i for i in table.values() if i.role in KERNEL_ROLES and i.in_block}
  factors = {}   # block-local kernel path -> (kernel info, {'a' | 'b': block-local path})
  for i in table.values():
    if i.role == 'lora':   # A maps the kernel's fan-in to the rank: its last axis is 'lora'
      k = kernels[i.local[:-1]]
      entry = factors.setdefault(k.local, (k, {}))
      entry[1]['a' if i.axes[-1] == 'lora' else 'b'] = i.local
  for kpath, (kinfo, ab) in sorted(factors.items()):
    w_src, w_tied = src[kpath], sets[kpath][idx]               # (L, in..., out...)
    n_in = kinfo.num_in
    in_shape, out_shape = w_src.shape[1:1 + n_in], w_src.shape[1 + n_in:]
    res = (w_src - w_tied).reshape(len(index), int(np.prod(in_shape)), -1)
    u, s, vt = linalg.per_matrix(functools.partial(jnp.linalg.svd, full_matrices=False), res)
    k = min(r, s.shape[-1])
    a = jnp.zeros(res.shape[:2] + (r,), res.dtype).at[..., :k].set(u[..., :k])
    b = jnp.zeros((len(index), r, res.shape[2]), res.dtype).at[:, :k].set(
        s[:, :k, None] * vt[:, :k] / cfg.sharing.lora_scale)
    out[ab['a']] = a.reshape((len(index),) + in_shape + (r,))
    out[ab['b']] = b.reshape((len(index), r) + out_shape)
  return out
