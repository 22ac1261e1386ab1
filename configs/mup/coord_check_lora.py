"""Width coordinate check of depth-wise LoRA (a relaxed recursive model): SP vs muP.

One shared block applied twice (cycle, 1 unique set) with per-layer LoRA of rank 4 on q, v, o
and both MLP projections (Relaxed Recursive Transformers, arXiv:2410.20672). Besides the core
activations it records mean|x A| ('lora_xa') and mean|scale x A B| ('lora_out', the LoRA delta
added to each kernel's output). Rules for the factors: sharenet/parametrization/rules.py docstring
(A = TP5 output weight, B = input weight).

Command:   nice -n 5 python -m sharenet.studies.coord_check \
               --config configs/mup/coord_check_lora.py --out docs/results/mup/lora
           then the focused figure coord_check_width_lora.png (lora_xa, lora_out, residual):
           python -c "import json; from sharenet.studies import coord_check as cc; \
             r = json.load(open('docs/results/mup/lora/coord_check.json'))['width']; \
             cc.plot_activations(r, 'width', ['lora_xa', 'lora_out', 'residual'], \
             'docs/results/mup/lora/coord_check_width_lora.png')"
Runtime:   648 s wall (nice 5, 2-core CPU shared with 4 other jobs; compile dominates, 1-2.5 min
           per point). With --config.study.width_variants=sp:lr=0.04,mup:lr=0.04 and
           --out docs/results/mup/lora/lr_0.04: 618 s.
Result:    docs/results/mup/lora/coord_check.md (and lr_0.04/, and a_zero/ for
           --config.model.sharing.lora_zero=a, 252 s), generated from their JSON; the reading:
           docs/parametrizations.md, "LoRA under muP".
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
