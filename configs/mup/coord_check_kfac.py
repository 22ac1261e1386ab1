"""Coordinate check of K-FAC's second-order muP (train.optimizer=kfac) over width: SP vs muP.

Ishikawa & Karakida ("On the Parameterization of Second-Order Optimization Effective Towards the
Infinite Width", arXiv:2312.12226) derive K-FAC's muP for a fixed batch as the width grows, so
the Kronecker factors' nonzero eigenvalues scale with width (A's as fan_in, G's as 1/fan_out)
and their dampings must follow. This check is in that regime: 16 rows per step (batch 2 x 8),
widths 64-256, the change from init (study.statistic=delta), 4 steps at LR 1e-2, 2 layers.

Command:   python -m sharenet.studies.coord_check --config configs/mup/coord_check_kfac.py \
               --config.study.seeds=3 \
               --out docs/results/mup/kfac/vanilla/coord_check
           Grafted K-FAC (its muP is Adam's), 1 seed: --config.train.kfac.graft=adam
               --out docs/results/mup/kfac/coord_check
Runtime:   6 min (338 s) for 1 seed, 12 min (698 s) for 3 (--config.study.seeds=3, the
           committed vanilla run), on the 2-core CPU shared with another job.
Result:    docs/results/mup/kfac/vanilla/coord_check/coord_check.md and
           docs/results/mup/kfac/coord_check/coord_check.md (generated from their JSON); the
           reading: docs/optimizers.md, "K-FAC".
"""
import ml_collections

from configs.mup import coord_check


def get_config() -> ml_collections.ConfigDict:
  c = coord_check.get_config()   # same model, Adam on the other leaves without clipping or decay
  t, s = c.train, c.study
  t.optimizer = 'kfac'
  t.kfac.graft = 'none'          # K-FAC's own step: the setting of its second-order muP
  t.batch_size, t.seq_len = 2, 8   # 16 rows per step: the width grows past the batch
  s.axes = 'width'
  s.statistic = 'delta'
  s.seeds = 1
  s.width_values = '64,128,256'  # base_d_model = the first
  s.width_variants = 'sp,mup'    # the Adam-only presets are refused beside kfac
  return c
