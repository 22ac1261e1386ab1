"""LR transfer across width on the embedded corpus: SP vs muP, widths 64-512.

Command:   python -m sharenet.studies.lr_sweep --config configs/mup/transfer.py \
               --out docs/results/mup
Runtime:   17 min 14 s wall on the 2-core CPU alone (measured 2026-11-30; 42 min while shared
           with other jobs). Width 512 dominates (~5.5 min per parametrization).
Result:    (measured 2026-11-30, before the sweep ran the loop's step and schedule: see README)
           optimum log2 LR per width 64/128/256/512:
           sp  -6.84 / -8.11 / -9.39 / -10.62 (512 at the grid edge): shift 3.78 (13.7x)
           mup -6.84 / -6.89 / -6.94 / -7.03: shift 0.19 (1.14x); loss at 2^-7 falls with width.
"""
import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  m, t = c.model, c.train
  m.num_layers, m.num_heads = 2, 4     # head_dim scales with width (heads fixed)
  m.mlp = 'gelu'
  m.remat = 'none'
  t.batch_size, t.seq_len = 8, 64
  t.schedule, t.warmup_steps, t.decay_fraction = 'wsd', 10, 0.3
  t.weight_decay = 0.0
  c.study = s = ml_collections.ConfigDict()
  s.axes = 'width'
  s.steps = 150
  s.seeds = 2
  s.avg_last = 15             # final loss = mean train loss of the last steps
  s.val_windows = 32
  s.mlp_ratio = 2.0           # mlp_dim = ratio * d_model
  s.fixed_width = 128         # repeats / depth sweeps
  s.loop_unique = 1
  s.log2_lrs = '-11..-5'      # 7 LRs, 2x apart, shared by all variants
  s.width_values = '64,128,256,512'           # base_d_model = the first
  s.width_variants = 'sp,mup'
  s.repeats_values = '1,2,4,8'
  s.repeats_variants = 'mup,mup:loop_rule=inv_R'
  s.depth_values = '2,4,8'
  s.depth_variants = 'mup,completep:base_depth=2'
  return c
