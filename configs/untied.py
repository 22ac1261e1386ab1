"""Untied baseline: 6 applied layers, 6 stored sets (A B C D E F).

Command:   python train.py --config configs/untied.py --workdir runs/untied
Runtime:   ~7.3 min on the 2-core CPU (200 steps, eval over the full split).
Result:    its row of docs/results/sharing_cpu.md (eval bits/byte, parameters, tokens/s;
           generated from docs/results/sharing_cpu.json).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'untied'
  return c
