"""Coordinate check over width (64-512), loop count R (1-8) and depth (2-16); SP vs muP.

Command:   python -m sharenet.studies.coord_check --config configs/mup/coord_check.py \
               --out docs/results/mup
Runtime:   3 min 1 s on the idle 2-core CPU (181 s for 44 model points, ~3.5-5 s each;
           measured 2026-12-01; 22 min on 2026-11-30 while shared with other jobs).
Result:    (measured 2026-11-30, rerun 2026-12-01 to 2 decimals; max |slope of log mean|x| vs
           log x| over steps t >= 1)
           width 64-512: mup residual 0.04, attn_out 0.01, mlp_hidden 0.01, mlp_out 0.04,
             embed_out 0.02; lagging: logits 0.42 (t=1; 0.02 by t=4), attn_logits 0.30.
             sp residual 2.66, mlp_out 2.76, attn_out 1.78 (negative control).
             mup_table3 / completep (base depth) give the same curves as mup (Adam symmetry).
             With readout_zero_init + query_zero_init every activation <= 0.09.
           repeats 1-8 (width 128, stack output): no rule +0.76..+1.24, inv_sqrt_R +0.30..+0.44,
             inv_R -0.01..-0.13.
           depth 2-16: mup +0.41..+1.31, completep alpha=1 -0.13..-0.28, alpha=0.5 +0.01..-0.24.
           Rerun 2026-12-01 with CompleteP's eps on every block parameter (completep alpha=1 only,
           --config.study.axes=depth --config.study.depth_variants=completep:base_depth=2
           --out docs/results/mup/depth/coord_check, 381 s): residual -0.15..-0.29,
           residual_final -0.13..-0.28 (attn_out / mlp_out ~ -1: branch outputs after x m_L^-1).
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
