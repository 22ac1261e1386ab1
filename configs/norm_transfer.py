"""Norm transfer under Scion: the optimal (LR, batch) per width and data size, and the output
layer's norm there (Filatov et al., arXiv:2510.03871), widths 32-128, 2 data sizes.

Command:   python -m sharenet.studies.norm_transfer --config configs/norm_transfer.py \
               --out docs/results/norm_transfer
Runtime:   17 min (1,003 s) on the 2-core CPU alone (measured 2026-12-07; the table's last
           line records each run's own).
Result:    docs/results/norm_transfer/norm_transfer.md (generated from norm_transfer.json) and
           norm_transfer.png; the reading: docs/optimizers.md, "Scion and norm transfer".
"""
import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  m, t, p = c.model, c.train, c.parametrization
  m.num_layers, m.num_heads = 2, 4     # head_dim scales with width (heads fixed)
  m.mlp = 'gelu'
  m.remat = 'none'
  t.seq_len = 64
  t.optimizer, t.weight_decay = 'scion', 0.0   # constrained Scion decays by itself
  t.schedule, t.decay_fraction = 'wsd', 0.3
  p.kind, p.base_d_model = 'mup', 32  # Scion's muP: its width-scaled LMOs
  c.study = s = ml_collections.ConfigDict()
  s.widths = '32,64,128'      # d_model; base_d_model = the first
  s.mlp_ratio = 2.0
  s.tokens = '32768,65536'    # trained tokens per run (steps = tokens / (batch x seq_len))
  s.batches = '2,4,8'
  s.log2_lrs = '-14,-13,-12,-11,-10,-9'
  s.seeds = 2
  s.val_windows = 32
  return c
