"""Recursion study base: 8 applied layers (middle_cycle R=3 = first + 2-set block x 3 + last).

Command:   python -m sharenet.studies.recursion_study --config configs/recursion_study.py \
               --out runs/recursion_study
           (vanilla, recursive, mor_expert, mor_token, masa, kv_shared x seeds 0,1; see
           sharenet/studies/recursion_study.py VARIANTS; --config.study.variants=a,b runs a
           slice; two processes pinned with `taskset -c 0` / `taskset -c 1` may share one --out)
Runtime:   estimate before the first full run: ~10-15 min per run on one core of the 2-core CPU
           (the vanilla model: 200 steps of 16 x 256 bytes; routed models take more steps at
           the same training FLOPs), ~1.5 h for the grid with two single-core workers.
Result:    docs/results/recursion_study/ (recursion_study.md generated from its JSON); the
           reading: docs/routing.md, "The recursion study".
"""
import ml_collections

from configs import default


def get_config():
  c = default.get_config()
  c.model.num_layers = 8
  c.train.warmup_steps = 30
  c.train.keep_checkpoints = 1
  c.study = s = ml_collections.ConfigDict()
  s.variants = 'all'     # comma list of sharenet/studies/recursion_study.py VARIANTS, or all
  s.seeds = '0,1'        # train.seed values (init and data order)
  s.base_steps = 200     # the vanilla model's steps; sets every variant's training-FLOPs budget
  return c
