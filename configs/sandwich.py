"""Subformer sandwich: unique first and last layer, one shared middle block (U0 A A A A U5), untied norms.

Command:   python train.py --config configs/sandwich.py --workdir runs/sandwich
Runtime:   ~7.6 min on the 2-core CPU (200 steps, eval over the full split).
Result:    its row of docs/results/sharing_cpu.md (eval bits/byte, parameters, tokens/s;
           generated from docs/results/sharing_cpu.json).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'sandwich'
  s.untie_norms = True
  return c
