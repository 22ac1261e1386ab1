"""Exports a workdir's LoRA as a Hugging Face PEFT adapter beside its base model.

  python -m sharenet.interop.export_peft --workdir WORKDIR --out BASE_DIR --adapter_out ADAPTER_DIR
      [--ema]

BASE_DIR is the model without its LoRA, as export_hf writes it (a tied plan expanded to its
applied layers); ADAPTER_DIR holds `adapter_config.json` and `adapter_model.safetensors`, the
layout `peft` reads (`PeftModel.from_pretrained(base, ADAPTER_DIR)`): for applied layer i and
each LoRA target, `base_model.model.model.layers.{i}.<module>.lora_A.weight` (r, in) and
`.lora_B.weight` (out, r), with `lora_alpha = model.sharing.lora_scale * r` so that peft's
scaling alpha / r is sharenet's scale. Targets: q, k, v, o -> self_attn.{q,k,v,o}_proj,
mlp_in -> mlp.gate_proj and mlp.up_proj, mlp_out -> mlp.down_proj.

What it covers: the depth-wise LoRA of a relaxed recursive model (Relaxed Recursive Transformers,
arXiv:2410.20672: each applied layer's own adapter on the shared weights, which the expanded base
repeats), and LoRA on an imported untied model, for the architectures whose linear layers are
torch Linear (llama, mistral, qwen2, qwen3, gemma, gemma2; not GPT-2's fused Conv1D). Per-layer
norm gains and LoRA experts have no PEFT form: one error line. Because a torch Linear computes
x W^T, the adapter's delta B A equals the transpose of sharenet's scale * A B, the same reshape
export_hf applies to kernels (hf_layout.to_hf); `tests/interop/test_export_peft.py` merges the
adapter into the base with numpy, imports the result and finds the workdir's logits.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any

import jax
import numpy as np

from sharenet.config import cli
from sharenet.errors import ConfigError
from sharenet.interop import export_hf, hf_arch, safetensors_io
from sharenet.models import ModelConfig, layout
from sharenet.train import trainer, workdir_io

PREFIX = 'base_model.model.'
ADAPTER_CONFIG = 'adapter_config.json'
ADAPTER_WEIGHTS = 'adapter_model.safetensors'


def _base_config(config: Any) -> Any:
  """The workdir's config without its LoRA (the base model's)."""
  base = config.copy_and_resolve_references()
  base.model.sharing.lora_rank = 0
  return base


def adapter_tensors(arch: str, cfg: ModelConfig, per_layer: Any
                    ) -> list[tuple[str, np.ndarray]]:
  """[(PEFT tensor name, array)] of the LoRA in `per_layer` (the workdir's per_layer
  collection), every applied layer's."""
  applied = {p: np.asarray(v, np.float32) for p, v in
             layout.applied_per_layer(per_layer, cfg).items()}
  entries = {e.path: e for e in hf_arch.entries(arch, layout.untied_config(cfg), 'model.')
             if e.layer}
  out = []
  for path in sorted(p for p in applied if p[-1] == 'lora_a'):
    kernel = path[:-1] + ('kernel',)
    e = entries.get(kernel)
    if e is None or e.kind != 'linear' or e.part is not None:
      raise ConfigError(f'LoRA on {"/".join(path[:-1])} has no PEFT form for model_type '
                        f'{arch}; valid: LoRA on torch Linear layers (llama, mistral, qwen2, '
                        f'qwen3, gemma, gemma2)')
    a_L, b_L = applied[path], applied[path[:-1] + ('lora_b',)]
    r = a_L.shape[-1]
    for i in range(cfg.num_layers):
      fan_in = math.prod(a_L.shape[1:-1])
      name = PREFIX + e.hf.format(i=i)[:-len('.weight')]
      out.append((f'{name}.lora_A.weight', np.ascontiguousarray(a_L[i].reshape(fan_in, r).T)))
      out.append((f'{name}.lora_B.weight',
                  np.ascontiguousarray(b_L[i].reshape(r, -1).T)))
  return out


def adapter_config(cfg: ModelConfig, tensors: list[tuple[str, np.ndarray]],
                   base_dir: str) -> dict[str, Any]:
  """PEFT's adapter_config.json for `tensors` (LoRA, causal LM, no dropout or bias)."""
  r = cfg.sharing.lora_rank
  modules = sorted({n.split('.')[-3] for n, _ in tensors})
  return {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': r,
          'lora_alpha': float(cfg.sharing.lora_scale) * r, 'lora_dropout': 0.0, 'bias': 'none',
          'target_modules': modules, 'fan_in_fan_out': False, 'inference_mode': True,
          'use_rslora': False, 'init_lora_weights': True, 'modules_to_save': None,
          'base_model_name_or_path': base_dir, 'layers_to_transform': None,
          'rank_pattern': {}, 'alpha_pattern': {}}


def export_peft(workdir: str, out: str, adapter_out: str, ema: bool = False) -> dict[str, Any]:
  """Writes the base model to `out` and the LoRA to `adapter_out` (module doc; with `ema`, the
  moving average of the weights that a run with train.ema keeps); on any error neither is
  left."""
  for d in (out, adapter_out):
    if os.path.exists(d) and (not os.path.isdir(d) or os.listdir(d)):
      raise ConfigError(f'{d} exists and is not an empty directory; valid: a new directory')
  config = workdir_io.load_config(workdir)
  cfg = ModelConfig.from_experiment(config)
  s = cfg.sharing
  if not s.lora_rank:
    raise ConfigError(f'--workdir {workdir} has no LoRA (model.sharing.lora_rank=0); valid: '
                      f'export_hf for the whole model')
  if s.untie_norms or cfg.moe.lora_experts:
    raise ConfigError('per-layer norm gains (model.sharing.untie_norms) and LoRA experts have '
                      'no PEFT form; valid: a workdir whose only per-layer parts are LoRA')
  base_cfg = ModelConfig.from_experiment(_base_config(config))
  arch = export_hf.export_arch(base_cfg)
  state, step, exp = workdir_io.restore_state(config, workdir, ema=ema)
  variables = jax.device_get(trainer.effective_params(state, exp.tr))
  tensors = adapter_tensors(arch, cfg, variables['per_layer'])
  made = []
  try:
    for d in (out, adapter_out):
      if not os.path.isdir(d):
        os.makedirs(d)
        made.append(d)
    export_hf.write_hf(out, arch, base_cfg, variables['params'])
    by_name = dict(tensors)
    safetensors_io.write(os.path.join(adapter_out, ADAPTER_WEIGHTS),
                         [(n, a.shape, np.float32) for n, a in tensors], by_name.__getitem__)
    with open(os.path.join(adapter_out, ADAPTER_CONFIG), 'w') as f:
      json.dump(adapter_config(cfg, tensors, os.path.abspath(out)), f, indent=2)
  except BaseException:
    for d in (out, adapter_out):
      if d in made:
        shutil.rmtree(d, ignore_errors=True)
      elif os.path.isdir(d):
        for n in os.listdir(d):
          os.remove(os.path.join(d, n))
    raise
  return {'model_type': arch, 'out': os.path.abspath(out),
          'adapter_out': os.path.abspath(adapter_out), 'step': step, 'r': s.lora_rank,
          'adapter_tensors': len(tensors), 'ema': ema}


def main(argv: list[str]) -> None:
  del argv
  from absl import flags, logging
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  print(json.dumps(export_peft(f.workdir, f.out, f.adapter_out, f.ema)), flush=True)


if __name__ == '__main__':
  from absl import flags
  flags.DEFINE_string('workdir', None, 'sharenet workdir with LoRA (convert.py, train.py).',
                      required=True)
  flags.DEFINE_string('out', None, 'New directory: the base model (Hugging Face).',
                      required=True)
  flags.DEFINE_string('adapter_out', None, 'New directory: the PEFT adapter.', required=True)
  flags.DEFINE_bool('ema', False, 'Export the weights\' moving average (a run with train.ema).')
  cli.run(main)
