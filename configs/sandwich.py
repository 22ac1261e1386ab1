"""Subformer sandwich: unique first and last layer, one shared middle block (U0 A A A A U5), untied norms.

Command:   python train.py --config configs/sandwich.py --workdir runs/sandwich
Runtime:   ~7.6 min on the 2-core CPU (200 steps, eval over the full split).
Result:    eval bits/byte 2.197 after 200 steps; params_unique 2,690,304, params_applied 5,246,208; 2,108 tokens/s (measured 2026-11-29).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'sandwich'
  s.untie_norms = True
  return c
