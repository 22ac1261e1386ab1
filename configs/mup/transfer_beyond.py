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
           (one optimizer's sweep: add --config.train.optimizer=muon and --out .../muon_beyond)
Runtime:   see docs/results/mup/beyond/lr_sweep.json's runtime_s (2-core CPU, one core).
Result:    docs/results/mup/beyond/lr_sweep.md (optima and shifts per axis, generated from
           lr_sweep.json); the reading: docs/optimizers.md, "Transfer beyond width".
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
