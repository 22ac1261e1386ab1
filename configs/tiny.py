"""Tiny: the smallest sensible model, for tests and smoke runs.

Command:   python train.py --config configs/tiny.py --workdir runs/tiny
Runtime:   ~15 s on the 2-core CPU (compile dominates).
Result:    the loss falls by more than 1 nat in 40 steps (asserted in tests/train/test_loop.py).
"""
from configs import default


def get_config():
  c = default.get_config()
  m, t = c.model, c.train
  m.d_model, m.num_layers, m.num_heads, m.mlp_dim = 32, 2, 2, 64
  m.remat = 'none'
  t.steps, t.batch_size, t.seq_len = 40, 4, 32
  t.warmup_steps, t.log_every, t.checkpoint_every = 5, 1, 20
  t.eval_batch_size = 256
  t.progress = False
  return c
