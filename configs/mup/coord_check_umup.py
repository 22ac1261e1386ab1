"""Coordinate check of u-muP (parametrization.kind=umup) over width and depth, SP / muP as controls.

Command:   nice -n 5 python -m sharenet.studies.coord_check \
               --config configs/mup/coord_check_umup.py --out docs/results/mup/umup
Runtime:   1,515 s on the 2-core CPU shared with other jobs (15 model points; compile dominates).
Result:    docs/results/mup/umup/README.md and coord_check.md (generated from its JSON).
"""
import ml_collections

from configs.mup import coord_check


def get_config() -> ml_collections.ConfigDict:
  c = coord_check.get_config()   # same model, batch, Adam without clipping or decay
  s = c.study
  s.axes = 'width,depth'
  s.steps = 3                    # updates; mean|x| is recorded at t = 0 (init) .. steps
  s.width_values = '64,128,256'  # base_d_model = the first (umup's rules are absolute)
  # u-muP's LR is absolute and O(1) (its Adam LR factors carry the widths); 0.5 as in
  # configs/mup/coord_check.py.
  s.width_variants = 'sp,mup,umup:lr=0.5'
  s.fixed_width = 128
  s.depth_values = '2,4,8'
  s.depth_variants = 'mup,umup:lr=0.5'
  return c
