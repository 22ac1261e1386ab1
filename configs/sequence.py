"""Sequence sharing (MobileLLM-LS-style immediate repeat): A A B B C C.

Command:   python train.py --config configs/sequence.py --workdir runs/sequence
Runtime:   RUNTIME_sequence
Result:    RESULT_sequence
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'sequence'
  s.num_unique = 3
  return c
