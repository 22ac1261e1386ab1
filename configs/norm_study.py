"""Normalization study base: the default model at 4 layers, 200 steps, for every norm/transform.

Command:   python -m sharenet.studies.norm_study --config configs/norm_study.py \
               --out runs/norm_study --schemes untied,cycle
           (19 variants x 2 schemes; each variant overrides this config, see
           sharenet/studies/norm_study.py VARIANTS)
Runtime:   ~5.3 min per run on the 2-core CPU (200 steps of 4,096 tokens + full validation eval),
           ~3 h for the whole grid; --variants a,b or --schemes untied runs a slice.
Result:    OUT/norm_study.md (eval bits per byte per variant and scheme). Measured 2026-11-30,
           untied: rmsnorm 2.223, zero_mean_writers 2.226, weight_norm 2.210; cycle: rmsnorm
           2.240, weight_norm 2.231 (328 s / 317 s per run alone; the rest of the grid not yet
           run, see README).
"""
from configs import default


def get_config():
  c = default.get_config()
  c.train.steps = 200
  c.train.warmup_steps = 30
  c.train.checkpoint_every = 200
  c.train.keep_checkpoints = 1
  return c
