"""Mixture-of-Recursions, tiny: middle_cycle (unique first / last layer, a 2-set block looped
R = 3 times) with expert-choice routing at the reference's default capacities 1, 2/3, 1/3
(docs/routing.md). The width and steps of configs/tiny.py.

Command:   python train.py --config configs/mor_tiny.py --workdir runs/mor_tiny
           (token choice: add --config.model.routing.kind=token_choice)
Runtime:   MEASURED_RUNTIME
Result:    MEASURED_RESULT
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  m = c.model
  m.num_layers = 8                 # 1 + 3 x 2 + 1 applied layers
  m.sharing.scheme = 'middle_cycle'
  m.sharing.num_unique = 4         # first, the 2-set block, last
  m.routing.kind = 'expert_choice'
  return c
