"""Width coordinate check of depth-wise LoRA (a relaxed recursive model): SP vs muP.

One shared block applied twice (cycle, 1 unique set) with per-layer LoRA of rank 4 on q, v, o
and both MLP projections (Relaxed Recursive Transformers, arXiv:2410.20672). Besides the core
activations it records mean|x A| ('lora_xa') and mean|scale x A B| ('lora_out', the LoRA delta
added to each kernel's output). Rules for the factors: sharenet/parametrization.py docstring
(A = TP5 output weight, B = input weight).

Command:   nice -n 5 python -m sharenet.studies.coord_check --config configs/mup/coord_check_lora.py \
               --out docs/results/mup/lora
Runtime:   (filled in after the measured run)
Result:    (filled in after the measured run)
"""
from configs.mup import coord_check


def get_config():
  c = coord_check.get_config()
  m, sh = c.model, c.model.sharing
  m.num_layers = 2
  sh.scheme, sh.num_unique, sh.repeats = 'cycle', 1, 0
  sh.lora_rank = 4
  sh.lora_targets = 'q,v,o,mlp_in,mlp_out'
  s = c.study
  s.axes = 'width'
  s.steps = 10                # LoRA B starts at zero: A gets its first update at step 2
  s.seeds = 1
  s.width_values = '64,128,256'              # base_d_model = the first
  s.width_variants = 'sp,mup'
  return c
