"""Universal Transformer / ALBERT-style: one block applied 6 times (A A A A A A).

Command:   python train.py --config configs/universal.py --workdir runs/universal
Runtime:   RUNTIME_universal
Result:    RESULT_universal
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'universal'
  return c
