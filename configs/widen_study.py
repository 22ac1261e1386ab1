"""Growth study: the default model at d_model 64 (muP) trained 300 steps, grown to 128 (twice:
every unit copied, the function kept) and to 96 (half the units drawn: the function moves),
then trained 150 more steps, against the same wider models from scratch, 2 seeds
(sharenet/studies/widen_study.py).

Command:   python -m sharenet.studies.widen_study --config configs/widen_study.py \
               --out runs/widen_study
Runtime:   see docs/results/widen_study/README.md (measured on the 2-core CPU).
Result:    docs/results/widen_study/ (widen_study.md generated from its JSON); the reading:
           docs/scaling.md, "Compute ladders".
"""
import ml_collections

from configs import default


def get_config():
  c = default.get_config()
  m, t, p = c.model, c.train, c.parametrization
  m.d_model, m.mlp_dim, m.num_heads = 64, 192, 2   # head_dim 32: heads grow whole
  t.batch_size, t.seq_len = 8, 128
  t.keep_checkpoints = 1
  p.kind, p.base_d_model = 'mup', 64                # one LR for every width
  t.lr = 3e-3
  c.study = s = ml_collections.ConfigDict()
  s.source_steps = 300       # the source's training steps
  s.widths = '128,96'        # the grown widths (multiples of head_dim 32)
  s.steps = 150              # steps after growing (grown) and from init (scratch)
  s.seeds = '0,1'            # train.seed of those runs (data order; scratch's init too)
  s.eval_tokens = 0          # validation tokens every model is evaluated on; 0 = all
  return c
