"""Compute ladder: untied, cycle and middle_cycle + LoRA under muP at widths 48-192, each rung
trained to 2 tokens per applied parameter at the LR transferred from width 48
(sharenet/studies/ladder.py).

Command:   python -m sharenet.studies.ladder --config configs/ladder.py --out docs/results/ladder
Runtime:   see docs/results/ladder/README.md (measured on the 2-core CPU); the largest rungs
           dominate (a width-192 rung trains ~4.5x the FLOPs of a width-128 one).
Result:    docs/results/ladder/ (ladder.md generated from ladder.json, ladder_frontier.png); the
           reading: docs/scaling.md, "Compute ladders". On a pod the same study runs the size
           presets' widths: --config.study.widths=768,1024,2048 with configs/sizes/'s meshes.
"""
import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  m, t, p = c.model, c.train, c.parametrization
  m.num_layers, m.num_heads = 4, 4    # head_dim grows with width (heads fixed), as muP's sweeps
  m.mlp = 'gelu'
  m.remat = 'none'
  t.batch_size, t.seq_len = 8, 64
  t.schedule, t.warmup_steps, t.decay_fraction = 'wsd', 10, 0.3
  t.weight_decay = 0.0
  p.kind = 'mup'                      # base width: the smallest rung (set per rung)
  c.study = s = ml_collections.ConfigDict()
  s.plans = 'untied,cycle,middle_cycle_lora'
  s.plan_overrides = ml_collections.ConfigDict({   # plan: 'key=value;key=value' overrides
      'untied': '',
      'cycle': 'model.sharing.scheme=cycle;model.sharing.num_unique=2',
      'middle_cycle_lora': 'model.sharing.scheme=middle_cycle;model.sharing.num_unique=3;'
                           'model.sharing.lora_rank=8;model.sharing.lora_targets=q,v,mlp_in'})
  s.widths = '48,64,96,128,192'
  s.mlp_ratio = 2.0                   # mlp_dim = ratio x width
  s.tokens_per_param = 2.0            # the budget rule: tokens = ratio x applied parameters
  s.log2_lrs = '-10..-5'              # the sweep at the smallest width (6 LRs, 2x apart)
  s.sweep_seeds = 1
  s.seeds = 1                         # seeds per rung (loss: their mean)
  s.avg_last = 10
  s.val_windows = 32                  # validation windows of train.seq_len + 1 tokens
  return c
