"""Cycle sharing (RRT / MoEUT-style): 3 unique sets looped twice (A B C A B C).

Command:   python train.py --config configs/cycle.py --workdir runs/cycle
Runtime:   RUNTIME_cycle
Result:    RESULT_cycle
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'cycle'
  s.num_unique = 3
  return c
