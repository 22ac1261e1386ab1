"""Cycle sharing (RRT / MoEUT-style): 3 unique sets looped twice (A B C A B C).

Command:   python train.py --config configs/cycle.py --workdir runs/cycle
Runtime:   ~7.9 min on the 2-core CPU (200 steps, eval over the full split).
Result:    eval bits/byte 2.205 after 200 steps; params_unique 2,688,768, params_applied 5,246,208; 1,959 tokens/s (measured 2026-11-29).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'cycle'
  s.num_unique = 3
  return c
