"""Sequence sharing (MobileLLM-LS-style immediate repeat): A A B B C C.

Command:   python train.py --config configs/sequence.py --workdir runs/sequence
Runtime:   ~7.8 min on the 2-core CPU (200 steps, eval over the full split).
Result:    eval bits/byte 2.238 after 200 steps; params_unique 2,688,768, params_applied 5,246,208; 2,031 tokens/s (measured 2026-11-29).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'sequence'
  s.num_unique = 3
  return c
