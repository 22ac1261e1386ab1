"""Shared base of the sharing configs: 6 applied layers at width 256, 200 steps.

Not an experiment itself; each configs/<scheme>.py changes only model.sharing.
"""
from configs import default


def base():
  c = default.get_config()
  c.model.num_layers = 6
  c.train.steps = 200
  c.train.warmup_steps = 30
  c.train.checkpoint_every = 100
  return c
