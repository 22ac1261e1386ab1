"""Relaxed Recursive Transformer: middle-cycle (U0 A B A B U5) + depth-wise LoRA, untied norms.

LoRA rank 8 on q, v and the MLP input, B = 0 at init (so step 0 equals the strict plan), on the
shared middle layers only (model.sharing.lora_layers=shared, as RRT: the unique first and last
layers are not relaxed).

Command:   python train.py --config configs/middle_cycle_lora.py --workdir runs/middle_cycle_lora
Runtime:   ~8.8 min on the 2-core CPU (200 steps, eval over the full split).
Result:    docs/results/sharing_cpu.md's middle_cycle_lora row was measured with
           --config.model.sharing.lora_layers=all; docs/performance.md ("Sharing configs") gives
           the parameter counts under today's lora_layers=shared (eval not yet rerun).
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
