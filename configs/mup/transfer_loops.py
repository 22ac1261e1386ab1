"""LR transfer across loop count R (one shared block applied R times) at width 64.

Command:   python -m sharenet.studies.lr_sweep --config configs/mup/transfer_loops.py \
               --out docs/results/mup/loops
Runtime:   16 min wall on the shared 2-core CPU (run at nice 10 next to the width sweep).
Result:    docs/results/mup/loops/lr_sweep.md (generated from its JSON; measured 2026-11-30,
           before the sweep ran the loop's step and schedule); the reading:
           docs/parametrizations.md.
"""
from configs.mup import transfer


def get_config():
  c = transfer.get_config()
  s = c.study
  s.axes = 'repeats'
  s.fixed_width = 64
  s.steps = 60
  s.seeds = 1
  s.avg_last = 10
  s.log2_lrs = '-10..-4'
  s.repeats_values = '1,2,4,8'
  s.repeats_variants = 'mup,mup:loop_rule=inv_R'
  return c
