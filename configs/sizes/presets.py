"""Size presets for pods: the shapes, the shared plans at the same applied depth, and the slices
each preset's dry run fits (configs/sizes/<size>.py, docs/scaling.md "Size presets").

A preset is the default model (pre-RMSNorm, RoPE, SwiGLU, byte vocabulary: set
--config.model.vocab_size to your tokenizer's) at a GPT-3 or Llama 3 shape, bfloat16 compute
with float32 parameters and AdamW state, 2,048-token sequences, 8 sequences per chip, FSDP over
the chips of its first slice. `plan` picks the untied model or a shared one applying the same
layers: `cycle` (L/4 stored sets looped 4 times) or `middle_cycle_lora` (unique first and
last layers, the middle looped twice, depth-wise LoRA of rank 64 on q, v and the MLP input).
"""
from __future__ import annotations

import ml_collections

from configs import default

# size: (d_model, layers, heads, kv heads, mlp_dim): GPT-3 Small's, Medium's and Large's widths
# and depths with a SwiGLU of ~8/3 d (rounded), Llama 3.2 1B's and 3B's and Llama 3 8B's shapes
# (benchmarks/roofline.py bounds the step time of each).
SHAPES = {'125m': (768, 12, 12, 12, 2048), '350m': (1024, 24, 16, 16, 2816),
          '760m': (1536, 24, 16, 16, 4096), '1b': (2048, 16, 32, 8, 8192),
          '3b': (3072, 28, 24, 8, 8192), '8b': (4096, 32, 32, 8, 14336)}
# slice: (chips, a device_kind of its chip for sharenet/train/perf.py). TPU v5p slice names count
# TensorCores, two per chip.
SLICES = {'v5p-8': (4, 'TPU v5p'), 'v5p-32': (16, 'TPU v5p'),
          '8xH100': (8, 'NVIDIA H100 80GB HBM3')}
# size: (the slices its dry run fits, the first one configured; remat)
FITS = {'125m': (('v5p-8', '8xH100'), 'dots_no_batch'),
        '350m': (('v5p-8', '8xH100'), 'dots_no_batch'),
        '760m': (('v5p-8', '8xH100'), 'dots_no_batch'),
        '1b': (('v5p-8', '8xH100'), 'dots_no_batch'),
        '3b': (('v5p-8', '8xH100'), 'full'),
        '8b': (('v5p-32', '8xH100'), 'full')}
PLANS = ('untied', 'cycle', 'middle_cycle_lora')
SEQ_LEN, SEQS_PER_CHIP = 2048, 8


def config(size: str, plan: str = 'untied', slice_: str | None = None
           ) -> ml_collections.ConfigDict:
  """The preset `size` with `plan`, its mesh and batch for `slice_` (default: its first)."""
  if size not in SHAPES:
    raise ValueError(f'size {size!r}; valid: {", ".join(SHAPES)}')
  if plan not in PLANS:
    raise ValueError(f'plan {plan!r}; valid: {", ".join(PLANS)} (e.g. configs/sizes/350m.py:cycle)')
  slices, remat = FITS[size]
  slice_ = slice_ or slices[0]
  chips = SLICES[slice_][0]
  d, layers, heads, kv, mlp = SHAPES[size]
  c = default.get_config()
  m, t = c.model, c.train
  m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.mlp_dim = d, layers, heads, kv, mlp
  m.dtype, m.remat = 'bfloat16', remat
  if plan == 'cycle':
    m.sharing.scheme, m.sharing.num_unique = 'cycle', layers // 4
  elif plan == 'middle_cycle_lora':
    s = m.sharing
    s.scheme, s.num_unique = 'middle_cycle', 2 + (layers - 2) // 2
    s.lora_rank, s.lora_targets = 64, 'q,v,mlp_in'
  t.seq_len, t.batch_size = SEQ_LEN, SEQS_PER_CHIP * chips
  t.eval_batch_size = t.batch_size
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, chips, 1
  return c
