"""Coordinate check over width (64-512), loop count R (1-8) and depth (2-16); SP vs muP.

Command:   python -m sharenet.studies.coord_check --config configs/mup/coord_check.py \
               --out docs/results/mup
Runtime:   3 min 1 s on the idle 2-core CPU (181 s for 44 model points, ~3.5-5 s each;
           measured 2026-12-01; 22 min on 2026-11-30 while shared with other jobs).
Result:    docs/results/mup/coord_check.md (max |slope| per activation, generated from
           coord_check.json) and the plots beside it; the reading: docs/parametrizations.md.
           CompleteP's depth rerun (--config.study.axes=depth
           --config.study.depth_variants=completep:base_depth=2
           --out docs/results/mup/depth/coord_check, 381 s): docs/results/mup/depth/coord_check/.
           The umup:lr=0.5 curves in coord_check.json predate u-muP's unit-scaled ops; the full
           scheme's check is configs/mup/coord_check_umup.py (docs/results/mup/umup/).
"""
import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  m, t = c.model, c.train
  m.num_layers, m.num_heads = 2, 4     # head_dim scales with width (heads fixed)
  m.remat = 'none'
  t.batch_size, t.seq_len = 8, 64
  t.lr = 1e-2                 # deliberately large Adam LR (microsoft/mup Transformer example)
  t.schedule, t.warmup_steps = 'constant', 0
  t.weight_decay, t.grad_clip = 0.0, 0.0
  c.study = s = ml_collections.ConfigDict()
  s.axes = 'width,repeats,depth'
  s.steps = 4                 # updates; mean|x| is recorded at t = 0 (init) .. steps
  s.statistic = 'l1'          # l1: mean|x|; delta: mean|x - x0|, the change from init
                              # (sharenet/studies/coord_check.py, docs/parametrizations.md)
  s.seeds = 2
  s.mlp_ratio = 3.0           # mlp_dim = ratio * d_model at every point
  s.fixed_width = 128         # d_model for the repeats / depth sweeps
  s.loop_unique = 1           # repeats sweep: this many unique sets, each applied R times
  s.width_values = '64,128,256,512'          # base_d_model = the first
  s.width_variants = 'sp,mup,mup_table3,completep,umup:lr=0.5'
  s.repeats_values = '1,2,4,8'
  s.repeats_variants = 'mup,mup:loop_rule=inv_sqrt_R,mup:loop_rule=inv_R'
  s.depth_values = '2,4,8,16'
  s.depth_variants = 'mup,completep:base_depth=2,completep:base_depth=2:depth_alpha=0.5'
  return c
