"""Test-time depth: a looped model evaluated, or decoding, at another number of loops.

Recurrent depth (Geiping et al., "Scaling up Test-Time Compute with Latent Reasoning",
arXiv:2502.05171) trains a prelude, a recurrent block and a coda and evaluates the same weights
at many recurrence depths; its authors report that fixed-depth training does not generalise to
other depths, which is what `eval.py --depths` measures. A depth n here is the number of loops
of the plan's looped segment (models/loops.py `looped`: prelude + n loops of K layers + coda),
and every depth runs through models/loops.py `Schedule(loops=n)`, the same path a sampled-depth
model uses; n = the trained R is the plan itself.

Compile cost: the loop count is a scan length, so evaluation (sharenet/train/evaluation.py
`evaluate_depths`) compiles one program per depth; cached generation at depth n is one
program per (depth, prompt bucket, settings) like any generation (sharenet/inference/generate.py).

Depth-wise LoRA and untied norms (Relaxed Recursive Transformers, arXiv:2410.20672) exist for
the trained loops only: such a model runs at 1 .. R loops (the first n loops' parts), never
deeper. Routed models pick each token's recursions and take no schedule.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from sharenet.config import compat
from sharenet.errors import ConfigError
from sharenet.models import loops

DEPTH_SCHEMES = 'cycle, universal, middle_cycle, sandwich, groups'
PLOT = 'loss_vs_depth.png'
RESULTS = 'eval_depths.jsonl'


def looped_shape(cfg: Any, what: str, action: str = 'test_time_depth') -> loops.Looped:
  """The plan's looped segment (prelude, K, R, coda) for `what` (a flag, in the error line):
  first the features `action` refuses (config/compat.py), then the plan's loop count."""
  compat.check_action(action, cfg.table_config(), what)
  try:
    shape = loops.looped(cfg)
  except ConfigError:
    raise ConfigError(f'{what} needs a looped segment (one cycle segment applied more than once); '
                      f'model.sharing.scheme={cfg.sharing.scheme!r} with {cfg.num_layers} '
                      f'layers has none; valid schemes: {DEPTH_SCHEMES}') from None
  return shape


def has_per_layer_parts(cfg: Any, shape: loops.Looped) -> bool:
  """Whether the looped segment holds per-applied-layer parts (depth-wise LoRA, untied norms)."""
  seg_cfg = cfg.segment_cfg(cfg.plan.segments[shape.segment])
  return bool(seg_cfg.sharing.lora_rank or cfg.sharing.untie_norms or
              cfg.moe.router_per_layer)


def check_depth(cfg: Any, n: Any, what: str = '--depth') -> loops.Looped:
  """One ConfigError line unless `cfg` can run `n` loops of its looped segment."""
  shape = looped_shape(cfg, what)
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ConfigError(f'{what}={n}: a depth is a number of loops of the looped segment; valid: '
                      f'an integer >= 1 (trained: {shape.loops})')
  if n > shape.loops and has_per_layer_parts(cfg, shape):
    raise ConfigError(f'{what}={n}: depth-wise LoRA and untied norms exist for the trained '
                      f'{shape.loops} loops only; valid: 1 .. {shape.loops}')
  return shape


def parse_depths(text: str) -> list[int]:
  """'1,2,4,8' -> [1, 2, 4, 8]; one ConfigError line for anything else."""
  items = [t.strip() for t in str(text).split(',')]
  try:
    depths = [int(t) for t in items]
  except ValueError:
    raise ConfigError(f'--depths={text!r}: valid: comma-separated loop counts >= 1, e.g. '
                      f'--depths 1,2,4,8') from None
  bad = [d for d in depths if d < 1]
  if bad or len(set(depths)) != len(depths):
    raise ConfigError(f'--depths={text!r}: valid: distinct loop counts >= 1, e.g. '
                      f'--depths 1,2,4,8')
  return depths


def check_flags(depths: str | None, depth: int | None, exit_spec: str | None,
                generating: bool) -> list[int] | None:
  """eval.py's --depths / --depth / --exit against each other and --prompt: the depths to
  evaluate (None: plain evaluation or generation); one ConfigError line otherwise."""
  if depths is not None and depth is not None:
    raise ConfigError('--depth (one depth: generation, or one evaluation) and --depths (an '
                      'evaluation per depth) exclude each other; valid: one of them')
  if depths is not None and generating:
    raise ConfigError('--depths evaluates; with --prompt / --prompt_file valid: --depth N')
  if exit_spec is not None and not generating:
    raise ConfigError('--exit decides per generated token; valid: with --prompt or '
                      '--prompt_file')
  if depths is not None:
    return parse_depths(depths)
  if depth is not None and not generating:
    return [depth]
  return None


def plot_depths(rows: Sequence[dict[str, Any]], trained: int, path: str) -> None:
  """Eval loss against test-time depth (png), the trained depth marked."""
  plot_against_depth({None: ([r['depth'] for r in rows], [r['eval_loss'] for r in rows])},
                     trained, path, 'eval loss (nats / token)')


def plot_against_depth(curves: dict[str | None, tuple[Sequence[int], Sequence[float]]],
                       trained: int, path: str, ylabel: str) -> None:
  """Curves {label: (depths, values)} against test-time depth (png), the trained depth marked
  (eval loss here; task metrics in sharenet/tasks/task_eval.py)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  depths = sorted({d for xs, _ in curves.values() for d in xs})
  fig, ax = plt.subplots(figsize=(5.5, 3.8))
  for label, (xs, ys) in curves.items():
    ax.plot(xs, ys, 'o-', label=label)
  ax.axvline(trained, color='gray', linestyle=':', label=f'trained depth ({trained})')
  if max(depths) >= 4 * min(depths):
    ax.set_xscale('log', base=2)
  ax.set_xticks(depths, [str(d) for d in depths])
  ax.set_xlabel('loops of the looped segment (test-time depth)')
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
