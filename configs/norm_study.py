"""Normalization study base: the default model at 4 layers, 200 steps, for every norm/transform.

Command:   python -m sharenet.studies.norm_study --config configs/norm_study.py \
               --out runs/norm_study
           (27 variants x 2 schemes; each variant overrides this config, see
           sharenet/studies/norm_study.py VARIANTS; --config.study.variants=a,b or
           --config.study.schemes=untied runs a slice; two processes pinned with
           `taskset -c 0` / `taskset -c 1` may share one --out)
Runtime:   ~5.3 min per run on the 2-core CPU (200 steps of 4,096 tokens + full validation
           eval), ~3.4 h for the grid in one process; ~9 min per run with two single-core
           workers, ~2.8 h for the grid.
Result:    OUT/norm_study.{json,md,png}; the measured tables are docs/results/norm_study/
           norm_study.md (seed 0) and norm_study_seeds.md (3 seeds), generated from their JSON;
           the reading: docs/normalization.md.
"""
import ml_collections

from configs import default


def get_config():
  c = default.get_config()
  c.train.steps = 200
  c.train.warmup_steps = 30
  c.train.checkpoint_every = 200
  c.train.keep_checkpoints = 1
  # The table's rows were measured with this weight-gradient and attention program (before the
  # CPU defaults dense_grad=rows and attention=chunked existed): every cell keeps one program.
  # (A rerun of rmsnorm seed 1 under the new defaults moved by +0.004 bits/byte, but two other
  # cells reproduced to 3 decimals under both programs: docs/normalization.md.)
  c.model.dense_grad = 'xla'
  c.model.attention = 'xla'
  c.study = s = ml_collections.ConfigDict()
  s.schemes = 'untied,cycle'  # comma list of sharenet/studies/norm_study.py SCHEMES
  s.variants = 'all'          # comma list of norm_study.py VARIANTS, or all
  s.seeds = '0'               # comma list of train.seed values (init and data order) per cell
  return c
