"""Cycle sharing (RRT / MoEUT-style): 3 unique sets looped twice (A B C A B C).

Command:   python train.py --config configs/cycle.py --workdir runs/cycle
Runtime:   ~7.9 min on the 2-core CPU (200 steps, eval over the full split).
Result:    its row of docs/results/sharing_cpu.md (eval bits/byte, parameters, tokens/s;
           generated from docs/results/sharing_cpu.json).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'cycle'
  s.num_unique = 3
  return c
