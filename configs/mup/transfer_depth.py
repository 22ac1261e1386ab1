"""LR transfer across depth (untied blocks, base depth 2 -> 2, 4, 8, 16) at width 64.

Compares mup (no depth rule: SP in depth) with CompleteP (Dey et al., arXiv:2505.01618, Table 1,
alpha = 1) at base_depth 2; the alpha = 0.5 column (Depth-muP branch rule) is
--config.study.depth_variants=completep:base_depth=2:depth_alpha=0.5.

Command:   nice -n 5 python -m sharenet.studies.lr_sweep --config configs/mup/transfer_depth.py \
               --out docs/results/mup/depth
Runtime:   1,504 s (25 min) wall, nice 5, on the 2-core CPU shared with 4 other jobs (load ~11);
           depth 16 dominates (5.5-6.7 min per variant).
Result:    docs/results/mup/depth/lr_sweep.md and, for alpha 0.5
           (--config.study.depth_variants=completep:base_depth=2:depth_alpha=0.5
           --out docs/results/mup/depth/alpha_0.5, 453 s at a lower load),
           docs/results/mup/depth/alpha_0.5/lr_sweep.md, generated from their JSON; the reading:
           docs/parametrizations.md, "CompleteP across depth".
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
