"""LR transfer beyond width: the LR optimum against batch size, training horizon, weight decay and
warmup, under SP and muP, at width 128 with muP's base width 64 (the width sweep's base).

Every point keeps the rest of configs/mup/transfer.py (2 layers, 150 steps of 8 x 64 tokens,
WSD schedule with 10 warmup steps, no weight decay) and changes one key:
  batch         train.batch_size 4..32 at a fixed 150 steps (a larger batch sees more tokens)
  steps         train.steps 75..600 (the schedule spans the horizon; the batches are the loop's)
  weight_decay  train.weight_decay 0..10, lr-coupled (decay lr(t) * wd per step, AdamW's) under
                SP and muP, and independent (decay (lr(t) / lr) * wd * 2^-7 per step: equal to the
                coupled decay at LR 2^-7, the muP optimum, and not moving with the LR; Wortsman et
                al. arXiv:2309.14322, Everett et al. arXiv:2407.05872, Kosson et al.
                arXiv:2510.19093)
  warmup        train.warmup_steps 0..50 of the 150

Command:   python -m sharenet.studies.lr_sweep --config configs/mup/transfer_beyond.py \
               --out docs/results/mup/beyond
           Muon and Shampoo (docs/optimizers.md, "Transfer beyond width", has the full commands):
           --config.train.optimizer=muon --out docs/results/mup/muon/beyond with the LR grid
           moved up (--config.study.log2_lrs=-9..-2) and the independent decay's wd_scale set to
           2^-5 (Muon's optimum); --config.train.optimizer=shampoo
           --config.train.shampoo.update_every=10 --out docs/results/mup/shampoo/beyond.
Runtime:   one core each (lr_sweep.json's runtime_s): AdamW 90 min, Muon 104 min, Shampoo 87 min.
Result:    docs/results/mup/beyond/lr_sweep.md and docs/results/mup/<optimizer>/beyond/lr_sweep.md
           (optima and shifts per axis, generated from lr_sweep.json); all optimizers' shifts in
           docs/results/mup/transfer_shifts.md; the reading: docs/optimizers.md.
"""
from configs.mup import transfer


def get_config():
  c = transfer.get_config()
  s = c.study
  s.axes = 'batch,steps,weight_decay,warmup'
  s.fixed_width = 128         # d_model at every point
  s.base_width = 64           # muP's base_d_model there (SP and muP differ by the width rule)
  s.log2_lrs = '-11..-4'
  s.batch_values = '4,8,16,32'
  s.batch_variants = 'sp,mup'
  s.steps_values = '75,150,300,600'
  s.steps_variants = 'sp,mup'
  s.weight_decay_values = '0,0.1,1,10'
  s.weight_decay_variants = ('sp,mup,sp:wd_mode=independent:wd_scale=0.0078125,'
                             'mup:wd_mode=independent:wd_scale=0.0078125')
  s.warmup_values = '0,5,20,50'
  s.warmup_variants = 'sp,mup'
  return c
