"""Sequence sharing (MobileLLM-LS-style immediate repeat): A A B B C C.

Command:   python train.py --config configs/sequence.py --workdir runs/sequence
Runtime:   ~7.8 min on the 2-core CPU (200 steps, eval over the full split).
Result:    its row of docs/results/sharing_cpu.md (eval bits/byte, parameters, tokens/s;
           generated from docs/results/sharing_cpu.json).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'sequence'
  s.num_unique = 3
  return c
