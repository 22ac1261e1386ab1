"""Width coordinate check of depth-wise LoRA (a relaxed recursive model): SP vs muP.

One shared block applied twice (cycle, 1 unique set) with per-layer LoRA of rank 4 on q, v, o
and both MLP projections (Relaxed Recursive Transformers, arXiv:2410.20672). Besides the core
activations it records mean|x A| ('lora_xa') and mean|scale x A B| ('lora_out', the LoRA delta
added to each kernel's output). Rules for the factors: sharenet/parametrization.py docstring
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
Result:    (measured 2026-12-01, widths 64-256, slope of log mean|x| vs log width per step)
           lr 1e-2: mup lora_xa -0.49 at t=0 (x A at init ~ d^-1/2: an output weight's init term,
             the transient TP5 / microsoft/mup allow for the logits) shrinking to -0.33 at t=10;
             lora_out -0.49 (t=1) -> -0.28 (t=10); its growth over init is width-independent
             (lora_xa t=10 minus t=0: +0.39 / +0.30 / +0.34). residual / mlp_out <= 0.10 / 0.14.
             sp (control): lora_xa +0.01 (t=1) -> +1.63 (t=10), lora_out -0.08 -> +1.57
             (growth over init +0.39 / +0.93 / +9.75), residual +2.73.
           lr 0.04 (above the base model's stable LR; the whole model drifts): mup lora_xa and
             lora_out within -0.25..+0.17 for t = 3..7, +0.29..+0.58 for t = 8..10 (residual
             -0.77..+0.29); sp +2.0..+4.3 from t = 2.
           So the muP LoRA rule removes SP's width blow-up; the remaining negative slope is the
           shrinking init term of x A, which 10 steps at these LRs do not wash out (B starts at
           zero, so A is first updated at step 2); it is not flat within 0.1 with B = 0 at init.
           A zero-initialised instead (--config.model.sharing.lora_zero=a: A = 0, B ~ N(0, 1/r);
           --out docs/results/mup/lora/a_zero, 252 s): x A has no init term and the muP curves are
           flat: slope per step t = 1..10, mup lora_xa +0.06 .. -0.08 (max |.| 0.11), lora_out
           -0.07 .. +0.07, residual <= 0.11; sp lora_xa +0.74 -> +2.59, lora_out +0.69 -> +2.63.
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
