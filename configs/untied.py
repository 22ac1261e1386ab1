"""Untied baseline: 6 applied layers, 6 stored sets (A B C D E F).

Command:   python train.py --config configs/untied.py --workdir runs/untied
Runtime:   RUNTIME_untied
Result:    RESULT_untied
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'untied'
  return c
