"""LR transfer across depth (untied blocks, base depth 2 -> 2, 4, 8, 16) at width 64.

Compares mup (no depth rule: SP in depth) with CompleteP (Dey et al., arXiv:2505.01618, Table 1,
alpha = 1) at base_depth 2; the alpha = 0.5 column (Depth-muP branch rule) is
--config.study.depth_variants=completep:base_depth=2:depth_alpha=0.5.

Command:   nice -n 5 python -m sharenet.studies.lr_sweep --config configs/mup/transfer_depth.py \
               --out docs/results/mup/depth
Runtime:   1,504 s (25 min) wall, nice 5, on the 2-core CPU shared with 4 other jobs (load ~11);
           depth 16 dominates (5.5-6.7 min per variant).
Result:    (measured 2026-12-01; 50 steps, 1 seed, so +-0.3 in log2 is within noise) optimum
           log2 LR (quadratic vertex) for depth 2 / 4 / 8 / 16, and the best final train loss:
           mup        -6.80 / -6.83 / -7.08 / -7.49  (loss 2.624 / 2.633 / 2.690 / 2.746)
           completep  -6.80 / -6.12 / -6.11 / -6.16  (loss 2.624 / 2.594 / 2.627 / 2.591)
           mup's optimum falls steadily (-0.23 log2 per depth doubling, 0.69 over 2 -> 16) and its
           loss gets worse with depth; completep moves once, 2 -> 4 (the depth-2 basin is flat from
           2^-7 to 2^-5), then stays within 0.05 from 4 to 16 while its loss does not degrade.
           alpha 0.5 (--config.study.depth_variants=completep:base_depth=2:depth_alpha=0.5
           --out docs/results/mup/depth/alpha_0.5, 453 s at a lower load):
                      -6.80 / -5.83 / -5.65 / -5.86  (loss 2.624 / 2.593 / 2.593 / 2.604)
           i.e. the same one-step move 2 -> 4 and 0.21 spread from 4 to 16 (vs 0.05 at alpha 1).
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
