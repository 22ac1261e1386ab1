"""Sharing methods study base: 4 applied layers, d 64, at the stored parameters of a cycle of 2.

Command:   python -m sharenet.studies.sharing_methods_study \
               --config configs/sharing_methods_study.py --out runs/sharing_methods_study
           (every variant of sharenet/studies/sharing_methods_study.py VARIANTS x seeds 0,1;
           --config.study.variants=a,b runs a slice)
Runtime:   ~1-2 min per run on the 2-core CPU (300 steps of 8 x 128 bytes, compile and the
           one-loop evaluation included), ~45 min for the grid of 14 x 2 (measured
           2026-12-07 beside a test run; dynamic tying's two seeds 2.5 min).
Result:    docs/results/sharing_methods_study/ (sharing_methods_study.md generated from its
           JSON); the reading: docs/sharing.md, "Sharing methods at equal stored parameters".
"""
import ml_collections

from configs import default


def get_config():
  c = default.get_config()
  m, t = c.model, c.train
  m.d_model, m.num_layers, m.num_heads, m.mlp_dim = 64, 4, 4, 192
  m.remat = 'none'
  t.steps, t.batch_size, t.seq_len = 300, 8, 128
  t.warmup_steps, t.log_every, t.checkpoint_every = 30, 50, 300
  t.keep_checkpoints = 1
  t.eval_batch_size = 64
  c.study = s = ml_collections.ConfigDict()
  s.variants = 'all'     # comma list of sharenet/studies/sharing_methods_study.py VARIANTS, or all
  s.seeds = '0,1'        # train.seed values (init and data order)
  return c
