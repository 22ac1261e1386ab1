"""Untied baseline: 6 applied layers, 6 stored sets (A B C D E F).

Command:   python train.py --config configs/untied.py --workdir runs/untied
Runtime:   ~7.3 min on the 2-core CPU (200 steps, eval over the full split).
Result:    eval bits/byte 2.238 after 200 steps; params_unique 5,246,208, params_applied 5,246,208; 2,229 tokens/s (measured 2026-11-29).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'untied'
  return c
