"""Normalize-and-Project study: parameter norms and angular updates with and without projection.

Command:   nice -n 5 python -m sharenet.studies.nap_study --config configs/nap_study.py \
               --out docs/results/nap
           (variants: baseline = no pre-activation norm, no projection; pre_act = the norm before
           the MLP nonlinearities only; nap = that norm plus transforms.project=nap;
           --config.study.variants=a,b runs a slice)
Runtime:   ~7.5 min on the 2-core CPU shared with other jobs (137-145 s per run: 200 steps of a
           64-wide 2-layer model at a constant learning rate, no weight decay, then the full
           validation eval); 8.5 min wall measured with `nice -n 5`.
Result:    OUT/nap_study.{json,md,png}: per step, ||W|| / ||W_0|| and the angular update
           ||W_{t+1} - W_t|| / ||W_t|| of the MLP input kernels, the residual writers and the
           readout; the eval loss of each run.
           Measured: docs/results/nap/README.md and nap_study.md (generated from its JSON).
"""
import ml_collections

from configs import default


def get_config():
  c = default.get_config()
  m, t = c.model, c.train
  m.d_model, m.num_layers, m.num_heads, m.mlp_dim = 64, 2, 2, 192
  m.remat = 'none'
  t.steps, t.batch_size, t.seq_len = 200, 16, 128
  t.schedule, t.lr, t.warmup_steps = 'constant', 1e-2, 10   # constant LR: the ELR is visible
  t.weight_decay = 0.0        # no decay: parameter norms grow freely without the projection
  t.eval_batch_size = 64
  t.progress = False
  c.study = s = ml_collections.ConfigDict()
  s.variants = 'baseline,pre_act,nap'   # comma list of sharenet/studies/nap_study.py VARIANTS
  return c
