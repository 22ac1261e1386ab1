"""Universal Transformer / ALBERT-style: one block applied 6 times (A A A A A A).

Command:   python train.py --config configs/universal.py --workdir runs/universal
Runtime:   ~7.7 min on the 2-core CPU (200 steps, eval over the full split).
Result:    its row of docs/results/sharing_cpu.md (eval bits/byte, parameters, tokens/s;
           generated from docs/results/sharing_cpu.json).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'universal'
  return c
