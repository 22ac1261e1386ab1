"""Recurrent depth (Geiping et al., arXiv:2502.05171): a prelude, a recurrent block and a coda,
the prelude's output re-injected at every loop, the depth sampled per step (docs/loops.md).

middle_cycle with 10 applied layers: the unique first layer (prelude), a 2-set block looped
R = 4 times, the unique last layer (coda). Each step draws its loops from the Poisson /
log-normal sampler around mean 4 (never fewer than backprop = 2); only the last 2 loops carry
gradient. The state starts as noise and the prelude's output re-enters every loop through the
concat adapter. Evaluation runs the plan's R = 4 loops (eval.py --depths evaluates others).

Command:   python train.py --config configs/recurrent_depth.py --workdir runs/recurrent_depth
           (trained exits: add --config.train.exit_loss=all; the fixed-depth baseline:
           --config.model.recurrence.depth=fixed --config.model.recurrence.backprop=0)
Runtime:   estimated ~4 min on the 2-core CPU (120 steps at width 256; each step runs ~10
           applied layers forward and ~6 backward, about 1.8x the default's step; not yet
           measured).
Result:    metrics.jsonl rows carry each step's `depth` and `executed_flops_per_token` (MFU
           counts them); eval bits per byte not yet measured.
"""
from configs import default


def get_config():
  c = default.get_config()
  m = c.model
  m.num_layers = 10                 # 1 + 4 x 2 + 1 applied layers
  m.sharing.scheme = 'middle_cycle'
  m.sharing.num_unique = 4          # first, the 2-set block, last
  r = m.recurrence
  r.depth = 'poisson_lognormal'     # loops drawn per step, mean 4
  r.mean = 4.0
  r.backprop = 2                    # gradient through the last 2 loops only
  r.injection = 'concat'            # adapter on [state; prelude output] at every loop
  r.init = 'normal'                 # the state entering the first loop: noise
  return c
