"""LR transfer across depth (untied blocks, base depth 2 -> 2, 4, 8, 16) at width 64.

Compares mup (no depth rule: SP in depth) with CompleteP (Dey et al., arXiv:2505.01618, Table 1,
alpha = 1) at base_depth 2; the alpha = 0.5 column (Depth-muP branch rule) is
--config.study.depth_variants=completep:base_depth=2:depth_alpha=0.5.

Command:   nice -n 5 python -m sharenet.studies.lr_sweep --config configs/mup/transfer_depth.py \
               --out docs/results/mup/depth
Runtime:   (filled in after the measured run)
Result:    (filled in after the measured run)
"""
from configs.mup import transfer


def get_config():
  c = transfer.get_config()
  s = c.study
  s.axes = 'depth'
  s.fixed_width = 64          # d_model at every depth (base_d_model = fixed_width: no width rule)
  s.steps = 50
  s.seeds = 1
  s.avg_last = 10
  s.log2_lrs = '-10..-4'      # 7 LRs, 2x apart
  s.depth_values = '2,4,8,16'
  s.depth_variants = 'mup,completep:base_depth=2'   # alpha 0.5: --config.study.depth_variants
  return c
