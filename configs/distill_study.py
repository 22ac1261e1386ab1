"""Distillation study: a recursive conversion of a trained untied model uptrained with cross
entropy or with knowledge distillation from that model, at two LoRA ranks and two seeds
(sharenet/studies/distill_study.py).

Command:   python -m sharenet.studies.distill_study --config configs/distill_study.py \
               --out runs/distill_study
Runtime:   see docs/results/distill_study/README.md (measured on the 2-core CPU: the teacher,
           2 conversions and 8 uptraining runs of the default model at d_model 128).
Result:    docs/results/distill_study/ (distill_study.md generated from its JSON); the reading:
           docs/interop.md, "Distillation".
"""
import ml_collections

from configs import default


def get_config():
  c = default.get_config()   # the teacher: the default 4-layer untied model at half width,
  c.model.d_model, c.model.mlp_dim = 128, 384   # on the embedded corpus
  c.train.keep_checkpoints = 1
  c.study = s = ml_collections.ConfigDict()
  s.teacher_steps = 300      # the teacher's training steps
  s.scheme = 'cycle'         # the students: convert.py --config.scheme
  s.num_unique = 2           # stored sets of the 4 applied layers
  s.init = 'average'         # RRT's initialisation of each set
  s.lora_targets = 'q,k,v,o,mlp_in,mlp_out'
  s.ranks = '8,64'           # depth-wise LoRA ranks (SVD init); 0 = plain recursive
  s.steps = 150              # uptraining steps of every student (CE and KD alike)
  s.lr = 1e-3                # uptraining peak LR (wsd from the converted step on)
  s.warmup_steps = 10
  s.kd_weight = 1.0          # train.teacher.weight of the kd students (1: distillation only)
  s.temperature = 1.0
  s.seeds = '0,1'            # train.seed of the uptraining (data order)
  s.eval_tokens = 0          # validation tokens every model is evaluated on; 0 = all
  return c
