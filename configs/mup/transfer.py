"""LR transfer across width on the embedded corpus: SP vs muP, widths 64-512.

Command:   python -m sharenet.studies.lr_sweep --config configs/mup/transfer.py \
               --out docs/results/mup
Runtime:   10 min 26 s wall on the idle 2-core CPU (measured 2026-12-01 with the CPU-speed
           defaults; 25 min 19 s before them). Width 512 dominates (~3 min per parametrization).
Result:    docs/results/mup/lr_sweep.md (optima, shift, every cell's loss; generated from
           lr_sweep.json); the reading: docs/parametrizations.md, "LR transfer".
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
