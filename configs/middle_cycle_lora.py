"""Relaxed Recursive Transformer: middle-cycle (U0 A B A B U5) + depth-wise LoRA, untied norms.

LoRA rank 8 on q, v and the MLP input, B = 0 at init (so step 0 equals the strict plan).

Command:   python train.py --config configs/middle_cycle_lora.py --workdir runs/middle_cycle_lora
Runtime:   RUNTIME_middle_cycle_lora
Result:    RESULT_middle_cycle_lora
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
