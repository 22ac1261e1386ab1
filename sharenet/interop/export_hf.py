"""Exports a sharenet workdir as a Hugging Face model directory (config.json, model.safetensors).

  python -m sharenet.interop.export_hf --workdir WORKDIR --out DIR [--ema]

The model must be one a Hugging Face architecture expresses (hf_arch.py): Pre-RMSNorm, RoPE
and SwiGLU (llama; qwen2 with proj_bias=qkv; qwen3 with RMS QK-norm), the same with GeGLU and
embed_scale sqrt(d_model), tied (gemma), or Pre-LN with learned positions, GELU and
proj_bias=all (gpt2); gemma with peri norms, an attention scale and logit soft-capping is
gemma2. A tied plan is written expanded to its applied layers (every use of a
stored set becomes its own layer: the same function, more parameters), with a printed note;
what no such architecture holds (depth-wise LoRA, per-layer norms, routing, MASA, ...) is one
ConfigError naming it. The safetensors file is written without torch, one tensor at a time;
an untied model is also read one stored parameter at a time (a partial restore of the
checkpoint), so the export holds about the largest stored parameter (a stacked (L, ...) block
kernel) plus one output tensor. On any error nothing is left at DIR.
"""
from __future__ import annotations

import collections
import json
import math
import os
import shutil
from typing import Any, Callable

import jax
import numpy as np
from flax.traverse_util import flatten_dict

from sharenet.config import cli
from sharenet.errors import ConfigError
from sharenet.interop import hf_arch, hf_layout, safetensors_io
from sharenet.models import ModelConfig, layout
from sharenet.models.lm import param_table
from sharenet.train import trainer, workdir_io

_CLASSES = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM',
            'qwen3': 'Qwen3ForCausalLM', 'gemma': 'GemmaForCausalLM',
            'gemma2': 'Gemma2ForCausalLM', 'gpt2': 'GPT2LMHeadModel'}


def _refusals(cfg: Any) -> list[tuple[bool, str]]:
  """(present, 'key=value ... valid: ...') of every feature no exported architecture holds."""
  s, n = cfg.sharing, cfg.norm
  return [
      (s.lora_rank > 0, f'model.sharing.lora_rank={s.lora_rank}: depth-wise LoRA; valid: 0'),
      (s.untie_norms, 'model.sharing.untie_norms=True: per-layer norm gains; valid: False'),
      (cfg.routing.kind != 'none', f'model.routing.kind={cfg.routing.kind}; valid: none'),
      (not cfg.recurrence.is_default, 'model.recurrence is not its default; valid: fixed depth'),
      (cfg.masa.atoms > 0, f'model.masa.atoms={cfg.masa.atoms}; valid: 0'),
      (cfg.bank.size > 0, f'model.bank.size={cfg.bank.size}: a parameter bank; valid: 0'),
      (cfg.mpo.cores > 0, f'model.mpo.cores={cfg.mpo.cores}: MPO kernels; valid: 0'),
      (cfg.mlp_tied, 'model.mlp_tied=True: a tied MLP; valid: False'),
      (cfg.attention_sharing != 'none', f'model.attention_sharing={cfg.attention_sharing}; '
       f'valid: none'),
      (cfg.kv_sharing != 'none', f'model.kv_sharing={cfg.kv_sharing}; valid: none'),
      (cfg.reader_bias, 'model.reader_bias=True (written by the norm conversions); valid: '
       'False'),
      (cfg.center_embedding, 'model.center_embedding=True; valid: False'),
      (n.placement not in ('pre', 'peri'), f'model.norm.placement={n.placement}; valid: pre, '
       f'or peri (gemma2)'),
      (n.fixnorm, 'model.norm.fixnorm=True; valid: False'),
      (n.pre_activation != 'none', f'model.norm.pre_activation={n.pre_activation}; valid: none'),
      (n.qk_norm == 'l2', 'model.norm.qk_norm=l2; valid: none or rms'),
      (cfg.attn_scale < 0, f'model.attn_scale={cfg.attn_scale}; valid: >= 0'),
      (cfg.embed_dim > 0, f'model.embed_dim={cfg.embed_dim} (factorized embeddings); valid: 0'),
      (cfg.parametrization.kind != 'sp', f'parametrization.kind={cfg.parametrization.kind}; '
       f'valid: sp')]


def export_arch(cfg: Any) -> str:
  """The Hugging Face architecture that expresses `cfg` (ConfigError naming what none does)."""
  for bad, what in _refusals(cfg):
    if bad:
      raise ConfigError(f'{what} (Hugging Face export: no supported architecture holds it)')
  n = cfg.norm
  gemma_like = cfg.mlp == 'geglu' and cfg.tie_embeddings and n.qk_norm == 'none' and \
      cfg.proj_bias == 'none' and math.isclose(cfg.embed_scale, math.sqrt(cfg.d_model))
  gemma2 = n.placement == 'peri' or cfg.attn_softcap or cfg.logit_softcap or cfg.attn_scale
  if gemma2:   # only Gemma 2 has norms after the branches, soft-capping, its own scale
    if not (gemma_like and n.placement == 'peri' and n.kind == 'rmsnorm' and
            cfg.position == 'rope'):
      raise ConfigError(f'model.norm.placement={n.placement}, attn_scale={cfg.attn_scale:g}, '
                        f'attn_softcap={cfg.attn_softcap:g}, logit_softcap='
                        f'{cfg.logit_softcap:g}: of the Hugging Face architectures only '
                        f'gemma2 holds peri norms, an attention scale or soft-capping; valid '
                        f'with them: geglu, tied, embed_scale sqrt(d_model), peri (gemma2)')
    _query_pre_attn_scalar(cfg)   # the scale gemma2 can store
    return 'gemma2'
  if n.kind == 'layernorm' and cfg.position == 'learned' and cfg.mlp == 'gelu' and \
      cfg.proj_bias == 'all' and cfg.kv_heads == cfg.num_heads and cfg.embed_scale == 1.0 \
      and n.qk_norm == 'none' and not cfg.head_dim:
    return 'gpt2'
  if n.kind != 'rmsnorm' or cfg.position != 'rope':
    raise ConfigError(f'model.norm.kind={n.kind} with model.position={cfg.position}: '
                      f'Hugging Face export needs rmsnorm with rope (llama, qwen2, qwen3, '
                      f'gemma) or layernorm with learned positions, gelu and proj_bias=all '
                      f'(gpt2)')
  if gemma_like:
    return 'gemma'
  if cfg.mlp != 'swiglu' or cfg.embed_scale != 1.0 or cfg.proj_bias == 'all' or \
      (cfg.proj_bias == 'qkv' and n.qk_norm != 'none'):
    raise ConfigError(f'model.mlp={cfg.mlp}, proj_bias={cfg.proj_bias}, embed_scale='
                      f'{cfg.embed_scale:g}, norm.qk_norm={n.qk_norm}: no Hugging Face '
                      f'architecture combines them; valid: swiglu with proj_bias none (llama, '
                      f'qwen3 with qk_norm=rms) or qkv (qwen2), or geglu, tied, embed_scale '
                      f'sqrt(d_model) (gemma)')
  return 'qwen3' if n.qk_norm == 'rms' else 'qwen2' if cfg.proj_bias == 'qkv' else 'llama'


def hf_config(arch: str, cfg: Any) -> dict[str, Any]:
  """The Hugging Face config.json of `cfg` as architecture `arch` (untied: every layer)."""
  common = dict(architectures=[_CLASSES[arch]], model_type=arch, vocab_size=cfg.vocab_size,
                tie_word_embeddings=cfg.tie_embeddings, torch_dtype='float32',
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
  if arch == 'gpt2':
    return dict(common, n_embd=cfg.d_model, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                n_inner=cfg.mlp_dim, n_positions=cfg.max_len, activation_function='gelu_new',
                layer_norm_epsilon=cfg.norm.eps, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0)
  act = 'gelu_pytorch_tanh' if arch in hf_arch.GEMMAS else 'silu'
  out = dict(common, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim,
             num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
             num_key_value_heads=cfg.kv_heads, head_dim=cfg.d_head,
             max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm.eps,
             rope_theta=cfg.rope_base, rope_parameters=_rope_parameters(cfg),
             hidden_act=act, hidden_activation=act, attention_bias=False, mlp_bias=False,
             use_sliding_window=False, sliding_window=None, attention_dropout=0.0)
  if arch == 'gemma2':   # every layer full attention; the window covers every position
    out.update(query_pre_attn_scalar=_query_pre_attn_scalar(cfg),
               attn_logit_softcapping=cfg.attn_softcap or None,
               final_logit_softcapping=cfg.logit_softcap or None,
               sliding_window=cfg.max_len, layer_types=['full_attention'] * cfg.num_layers)
  return out


def _query_pre_attn_scalar(cfg: Any) -> int:
  """Gemma 2's query_pre_attn_scalar (an integer: scale = scalar^-1/2) of model.attn_scale."""
  if not cfg.attn_scale:
    return cfg.d_head
  scalar = cfg.attn_scale ** -2
  if not math.isclose(scalar, round(scalar), rel_tol=1e-6):
    raise ConfigError(f'model.attn_scale={cfg.attn_scale:g} is not n^-1/2 for an integer n '
                      f'(gemma2 stores the scale as the integer query_pre_attn_scalar); valid: '
                      f'0 or n^-1/2')
  return int(round(scalar))


def _rope_parameters(cfg: Any) -> dict[str, Any]:
  """transformers' rope_parameters of model.rope_base and model.rope_scaling."""
  rs = cfg.rope_scaling
  if rs.kind == 'none':
    return {'rope_type': 'default', 'rope_theta': cfg.rope_base}
  out = {'rope_type': rs.kind, 'rope_theta': cfg.rope_base, 'factor': rs.factor}
  if rs.kind == 'llama3':
    out.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
               original_max_position_embeddings=rs.original_max_len)
  return out


def _tensors(arch: str, cfg: Any) -> list[tuple[str, list[tuple[hf_arch.Entry, int | None]]]]:
  """[(Hugging Face name, its (entry, layer) parts in order)] of untied model `cfg`."""
  prefix = 'transformer.' if arch == 'gpt2' else 'model.'
  out: dict[str, list[tuple[hf_arch.Entry, int | None]]] = {}
  for e in hf_arch.entries(arch, cfg, prefix):
    for i in range(cfg.num_layers) if e.layer else [None]:
      out.setdefault(e.hf.format(i=i), []).append((e, i))
  for parts in out.values():
    parts.sort(key=lambda p: p[0].part or (0, 1))
  return list(out.items())


def write_hf(out: str, arch: str, cfg: Any, params: dict[str, Any] | None = None,
             read: Callable[[tuple], np.ndarray] | None = None,
             shapes: dict[tuple, tuple] | None = None) -> int:
  """Writes `out` (config.json, model.safetensors) from the params of `cfg`, every applied
  layer its own (models/layout.py applied_params: a tied plan expanded); returns the tensor
  count. The params are `params` (the whole 'params' tree) or, for an untied plan, `read`
  (stored path -> host array, one stored parameter at a time) with their `shapes`: the tensors
  are then written grouped by the stored parameter they come from, so each is read once and
  at most a few are held (workdir_io.param_reader)."""
  if params is not None:
    flat = dict(flatten_dict(params))
    read, shapes = flat.__getitem__, {p: tuple(v.shape) for p, v in flat.items()}
  shapes = {p: tuple(getattr(v, 'shape', v)) for p, v in shapes.items()}
  table = {p[1:]: i for p, i in param_table(cfg).items() if p[0] == 'params'}
  if cfg.sharing.scheme == 'untied':   # the stored leaves are per applied layer already
    source = {i.local: p for p, i in table.items() if i.in_block}   # block-local -> stored
    fused = max(len(parts) for _, parts in _tensors(arch, layout.untied_config(cfg)))
    get = _recent(read, fused)   # GPT-2's c_attn reads q, k and v at once
    stored = lambda e: source[e.path] if e.layer else e.path
  else:   # {block-local path: (L, ...)}, a copy: the expanded model
    if params is None:
      raise ValueError('write_hf: a tied plan is expanded from the whole params tree')
    applied = layout.applied_params(params, cfg)
    get = lambda path: applied[path] if path in applied else read(path)
    stored = lambda e: e.path
  cfg = layout.untied_config(cfg)

  def value(e: hf_arch.Entry, layer: int | None) -> np.ndarray:
    return np.asarray(get(stored(e)) if layer is None else get(stored(e))[layer], np.float32)

  def shape(e: hf_arch.Entry, layer: int | None) -> tuple:
    full = shapes[stored(e)] if stored(e) in shapes else tuple(applied[e.path].shape)
    return tuple(full) if layer is None else tuple(full[1:])

  tensors = _tensors(arch, cfg)
  tensors.sort(key=lambda t: (stored(t[1][0][0]), t[1][0][1] or 0))   # one source at a time
  by_name = dict(tensors)
  shapes_hf = {n: hf_layout.hf_shape(parts[0][0], shape(*parts[0])) for n, parts in tensors}

  def produce(name):
    parts = by_name[name]
    return hf_layout.to_hf(parts[0][0], [value(e, layer) for e, layer in parts])

  safetensors_io.write(os.path.join(out, 'model.safetensors'),
                       [(n, shapes_hf[n], np.float32) for n, _ in tensors], produce)
  with open(os.path.join(out, 'config.json'), 'w') as f:
    json.dump(hf_config(arch, cfg), f, indent=2)
  return len(tensors)


def _recent(read: Callable[[tuple], np.ndarray], size: int) -> Callable[[tuple], np.ndarray]:
  """`read` keeping the `size` most recently read arrays."""
  kept: collections.OrderedDict = collections.OrderedDict()

  def get(path):
    if path not in kept:
      while len(kept) >= size:   # dropped before the next is read: never size + 1 held
        kept.popitem(last=False)
      kept[path] = read(path)
    kept.move_to_end(path)
    return kept[path]
  return get


def export_hf(workdir: str, out: str, ema: bool = False) -> dict[str, Any]:
  """Writes Hugging Face directory `out` from `workdir`'s latest checkpoint (with `ema`, the
  moving average of its weights that a run with train.ema keeps)."""
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ConfigError(f'--out {out} exists and is not an empty directory; valid: a new '
                      f'directory')
  config = workdir_io.load_config(workdir)
  cfg = ModelConfig.from_experiment(config)
  arch = export_arch(cfg)
  # An untied model whose stored params are the applied ones (no reparameterization) is read
  # one stored parameter at a time; otherwise the effective params are restored whole.
  streaming = cfg.sharing.scheme == 'untied' and not config.transforms.reparam and not ema
  if streaming:
    step, shapes, read = workdir_io.param_reader(config, workdir)
    write = lambda d: write_hf(d, arch, cfg, read=read, shapes=shapes)
  else:
    state, step, exp = workdir_io.restore_state(config, workdir, ema=ema)
    variables = jax.device_get(trainer.effective_params(state, exp.tr))
    extra = [k for k, v in variables.items() if k != 'params' and flatten_dict(v)]
    if extra:
      raise ConfigError(f'--workdir {workdir} holds the collection {extra[0]} (per-layer '
                        f'parts); no Hugging Face architecture holds it')
    write = lambda d: write_hf(d, arch, cfg, variables['params'])
  if cfg.sharing.scheme != 'untied':
    print(f'note: the tied plan {cfg.sharing.scheme} ({cfg.plan.num_unique} stored sets) is '
          f'written expanded to its {cfg.num_layers} applied layers', flush=True)
  out = os.path.abspath(out)
  tmp = f'{out}.export-{os.getpid()}.tmp'
  try:
    os.makedirs(tmp)
    count = write(tmp)
    if os.path.isdir(out):
      os.rmdir(out)
    os.rename(tmp, out)
  finally:
    if os.path.isdir(tmp):
      shutil.rmtree(tmp)
  return {'model_type': arch, 'out': out, 'step': step, 'tensors': count, 'ema': ema}


def main(argv: list[str]) -> None:
  del argv
  from absl import flags, logging
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  print(json.dumps(export_hf(f.workdir, f.out, f.ema)), flush=True)


if __name__ == '__main__':
  from absl import flags
  flags.DEFINE_string('workdir', None, 'sharenet workdir (train.py, convert.py, import_hf).',
                      required=True)
  flags.DEFINE_string('out', None, 'New Hugging Face model directory.', required=True)
  flags.DEFINE_bool('ema', False, 'Export the weights\' moving average (a run with train.ema).')
  cli.run(main)
