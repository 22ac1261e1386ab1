"""Subformer sandwich: unique first and last layer, one shared middle block (U0 A A A A U5), untied norms.

Command:   python train.py --config configs/sandwich.py --workdir runs/sandwich
Runtime:   RUNTIME_sandwich
Result:    RESULT_sandwich
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'sandwich'
  s.untie_norms = True
  return c
