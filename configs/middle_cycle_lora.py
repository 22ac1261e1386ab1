"""Relaxed Recursive Transformer: middle-cycle (U0 A B A B U5) + depth-wise LoRA, untied norms.

LoRA rank 8 on q, v and the MLP input, B = 0 at init (so step 0 equals the strict plan), on the
shared middle layers only (model.sharing.lora_layers=shared, as RRT: the unique first and last
layers are not relaxed).

Command:   python train.py --config configs/middle_cycle_lora.py --workdir runs/middle_cycle_lora
Runtime:   ~8.8 min on the 2-core CPU (200 steps, eval over the full split).
Result:    params_unique 3,640,576, params_applied 5,344,512 (counted 2026-12-01); eval bits/byte
           not yet measured with lora_layers=shared. With --config.model.sharing.lora_layers=all
           (LoRA on every applied layer, the default before 2026-12-01): eval bits/byte 2.192
           after 200 steps; params_unique 3,689,728, params_applied 5,393,664; 1,845 tokens/s
           (measured 2026-11-29).
"""
from configs import sharing_common


def get_config():
  c = sharing_common.base()
  s = c.model.sharing
  s.scheme = 'middle_cycle'
  s.num_unique = 4
  s.lora_rank = 8
  s.lora_targets = 'q,v,mlp_in'
  s.untie_norms = True
  return c
