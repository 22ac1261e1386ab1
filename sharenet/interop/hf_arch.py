"""The Hugging Face architectures sharenet reads and writes: config fields -> model keys, and
each sharenet parameter's Hugging Face tensor.

  llama, mistral, qwen2, qwen3   Pre-RMSNorm, RoPE (rotate-half, as sharenet's), SwiGLU, GQA;
                                 qwen2 biases on q, k, v (model.proj_bias=qkv); qwen3 RMS
                                 QK-norm over head_dim (model.norm.qk_norm=rms), before RoPE.
  gemma                          the same with GeGLU (tanh GELU), RMSNorm gains stored as
                                 1 + w (folded here: the same function), the embedded tokens
                                 times sqrt(d_model) (model.embed_scale), tied readout.
  gemma2                         gemma with a norm after each branch too (input / post-attention
                                 and pre / post-feedforward: model.norm.placement=peri), the
                                 attention scale query_pre_attn_scalar^-1/2 (model.attn_scale)
                                 and logit soft-capping of the attention and the output
                                 (model.attn_softcap, model.logit_softcap).
A sliding window (Mistral's, Gemma 2's sliding layers) below max_position_embeddings is imported
as model.attention_window with model.max_len capped to it: within the window sliding-window
attention equals full attention, so the model is exact for every context it accepts, and
longer ones are refused (train.seq_len, generation's prompt + new tokens).
  gpt2                           Pre-LN LayerNorm with biases, learned positions, tanh GELU,
                                 biases on every projection (model.proj_bias=all), tied
                                 readout; Conv1D kernels are stored (in, out), q k v fused.
A field whose value sharenet does not model is one ConfigError naming it (`model_keys`);
dropout rates are training-only and sharenet trains without dropout, so they are not read.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from sharenet.errors import ConfigError

ARCHITECTURES = ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2', 'gpt2')
LLAMA_FAMILY = ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2')
GEMMAS = ('gemma', 'gemma2')
TANH_GELUS = ('gelu_new', 'gelu_pytorch_tanh', 'gelu_fast')   # sharenet's gelu is tanh GELU


class Entry(NamedTuple):
  """One sharenet parameter (path under 'params', or with `layer` its block-local path,
  ParamInfo.local: one per applied layer) and the Hugging Face tensor `hf` it is read from
  ('{i}': the layer).

  kind: linear (HF (out, in) -> kernel (in..., out...), `n_in` input dims), conv1d (HF (in,
  out)), vector (reshaped) or same. `part` (j, n): the j-th of n equal chunks of the HF
  tensor's output axis (GPT-2's fused c_attn). `offset` is added on import (Gemma's 1 + w)."""
  path: tuple[str, ...]
  hf: str
  kind: str = 'same'
  layer: bool = False
  n_in: int = 1
  part: tuple[int, int] | None = None
  offset: float = 0.0


def _get(hf: dict[str, Any], name: str, default: Any = None) -> Any:
  return hf[name] if hf.get(name) is not None else default


def _refuse(arch: str, field: str, value: Any, why: str) -> ConfigError:
  return ConfigError(f'config.json ({arch}): {field}={value!r} is not modelled by sharenet '
                     f'({why})')


ROPE_TYPES = ('default', 'linear', 'llama3')   # rope_type values sharenet models


def _rope(arch: str, hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
  """(rope_theta, model.rope_scaling) from rope_theta / rope_scaling (older configs) or
  rope_parameters (newer): default, linear and llama3 RoPE; another rope_type, or a partial
  rotary factor, is refused."""
  scaling = hf.get('rope_scaling') or {}
  params = {**(hf.get('rope_parameters') or {}), **scaling}
  rope_type = (scaling.get('rope_type', scaling.get('type')) or params.get('rope_type')
               or 'default')
  if rope_type not in ROPE_TYPES:
    raise _refuse(arch, 'rope_scaling', rope_type, f'valid: null, {", ".join(ROPE_TYPES)}')
  partial = params.get('partial_rotary_factor', hf.get('partial_rotary_factor'))
  if partial not in (None, 1, 1.0):
    raise _refuse(arch, 'partial_rotary_factor', partial, 'RoPE on every head dimension; '
                  'valid: 1.0')
  base = float(params.get('rope_theta', _get(hf, 'rope_theta', 10000.0)))
  if rope_type == 'default':
    return base, dict(kind='none')
  scaling = dict(kind=rope_type, factor=float(params['factor']))
  if rope_type == 'llama3':
    scaling.update(low_freq_factor=float(params['low_freq_factor']),
                   high_freq_factor=float(params['high_freq_factor']),
                   original_max_len=int(params.get('original_max_position_embeddings')
                                        or hf['max_position_embeddings']))
  return base, scaling


def _check_llama(arch: str, hf: dict[str, Any]) -> int:
  """The fields of the Llama family whose non-default values sharenet does not model; returns
  the sliding window that binds (below max_position_embeddings), else 0."""
  for field, ok, why in (
      ('attention_bias', not hf.get('attention_bias') or arch == 'qwen2',
       'biases on q, k, v and o; valid: false'),
      ('mlp_bias', not hf.get('mlp_bias'), 'MLP biases; valid: false'),
      ('pretraining_tp', _get(hf, 'pretraining_tp', 1) == 1, 'valid: 1'),
      ('use_sliding_window', not hf.get('use_sliding_window'), 'sliding-window attention; '
       'valid: false'),
      ('attn_logit_softcapping', hf.get('attn_logit_softcapping') is None or arch == 'gemma2',
       'valid: null'),
      ('final_logit_softcapping', hf.get('final_logit_softcapping') is None or arch == 'gemma2',
       'valid: null'),
      ('quantization_config', hf.get('quantization_config') is None, 'quantized weights; '
       'valid: a float checkpoint')):
    if not ok:
      raise _refuse(arch, field, hf.get(field), why)
  window = hf.get('sliding_window')
  windowed = window is not None and window < hf['max_position_embeddings']
  raw_types = hf.get('layer_types')
  layer_types = set(raw_types or ['full_attention'])
  # Gemma 2's every other layer slides (its default when layer_types is absent): the same as
  # full attention when the window covers every position
  slides = arch == 'mistral' or (arch == 'gemma2' and (
      raw_types is None or 'sliding_attention' in layer_types))
  if arch == 'gemma2':
    layer_types.discard('sliding_attention')
    layer_types = layer_types or {'full_attention'}
  if layer_types != {'full_attention'}:
    raise _refuse(arch, 'layer_types', sorted(layer_types), 'valid: full_attention only')
  if windowed and slides and window < 1:
    raise _refuse(arch, 'sliding_window', window, 'valid: null or >= 1')
  return int(window) if windowed and slides else 0


def _llama_keys(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
  window = _check_llama(arch, hf)
  act = hf.get('hidden_activation') or hf.get('hidden_act', 'silu')
  if arch in GEMMAS:
    if act not in TANH_GELUS:
      raise _refuse(arch, 'hidden_act', act, f'valid: {", ".join(TANH_GELUS)}')
  elif act != 'silu':
    raise _refuse(arch, 'hidden_act', act, 'valid: silu')
  d, heads = hf['hidden_size'], hf['num_attention_heads']
  head_dim = _get(hf, 'head_dim', d // heads)
  scalar = _get(hf, 'query_pre_attn_scalar', head_dim)
  if arch == 'gemma' and scalar != head_dim:
    raise _refuse(arch, 'query_pre_attn_scalar', hf['query_pre_attn_scalar'],
                  f'valid: head_dim={head_dim}')
  gemma2 = arch == 'gemma2'
  base, scaling = _rope(arch, hf)
  return dict(
      vocab_size=hf['vocab_size'], d_model=d, num_layers=hf['num_hidden_layers'],
      num_heads=heads, num_kv_heads=_get(hf, 'num_key_value_heads', heads),
      head_dim=head_dim, mlp_dim=hf['intermediate_size'],
      mlp='geglu' if arch in GEMMAS else 'swiglu', position='rope',
      rope_base=base, rope_scaling=scaling,
      max_len=window or _get(hf, 'max_position_embeddings', 2048), attention_window=window,
      tie_embeddings=bool(_get(hf, 'tie_word_embeddings', arch in GEMMAS)),
      proj_bias='qkv' if arch == 'qwen2' else 'none',
      embed_scale=math.sqrt(d) if arch in GEMMAS else 1.0,
      attn_scale=float(scalar) ** -0.5 if gemma2 and scalar != head_dim else 0.0,
      attn_softcap=float(_get(hf, 'attn_logit_softcapping', 0.0)) if gemma2 else 0.0,
      logit_softcap=float(_get(hf, 'final_logit_softcapping', 0.0)) if gemma2 else 0.0,
      norm=dict(kind='rmsnorm', placement='peri' if gemma2 else 'pre',
                eps=float(_get(hf, 'rms_norm_eps', 1e-6)),
                qk_norm='rms' if arch == 'qwen3' else 'none'))


def _gpt2_keys(hf: dict[str, Any]) -> dict[str, Any]:
  act = hf.get('activation_function', 'gelu_new')
  for field, ok, why in (
      ('activation_function', act in TANH_GELUS, f'valid: {", ".join(TANH_GELUS)}'),
      ('scale_attn_weights', hf.get('scale_attn_weights', True), 'valid: true'),
      ('scale_attn_by_inverse_layer_idx', not hf.get('scale_attn_by_inverse_layer_idx'),
       'valid: false'),
      ('add_cross_attention', not hf.get('add_cross_attention'), 'valid: false'),
      ('quantization_config', hf.get('quantization_config') is None, 'valid: null')):
    if not ok:
      raise _refuse('gpt2', field, hf.get(field), why)
  d = hf['n_embd']
  return dict(
      vocab_size=hf['vocab_size'], d_model=d, num_layers=hf['n_layer'], num_heads=hf['n_head'],
      num_kv_heads=0, head_dim=0, mlp_dim=_get(hf, 'n_inner', 4 * d), mlp='gelu',
      position='learned', max_len=hf['n_positions'],
      tie_embeddings=bool(_get(hf, 'tie_word_embeddings', True)), proj_bias='all',
      embed_scale=1.0,
      norm=dict(kind='layernorm', placement='pre', eps=float(hf.get('layer_norm_epsilon', 1e-5)),
                qk_norm='none'))


def model_keys(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
  """(architecture, the config.model keys it sets) of a Hugging Face config.json dict."""
  arch = hf.get('model_type')
  if arch not in ARCHITECTURES:
    raise ConfigError(f'config.json: model_type={arch!r} is not supported; valid: '
                      f'{", ".join(ARCHITECTURES)}')
  return arch, (_gpt2_keys(hf) if arch == 'gpt2' else _llama_keys(arch, hf))


def entries(arch: str, cfg: Any, prefix: str) -> list[Entry]:
  """Every sharenet parameter of `cfg` with its Hugging Face tensor; `prefix` is the names'
  ('model.' / 'transformer.' or '' for a bare base-model checkpoint)."""
  if arch == 'gpt2':
    return _gpt2_entries(cfg, prefix)
  p, L = prefix, prefix + 'layers.{i}.'
  g = 1.0 if arch in GEMMAS else 0.0
  out = [Entry(('embed', 'embedding'), p + 'embed_tokens.weight'),
         Entry(('final_norm', 'scale'), p + 'norm.weight', offset=g)]
  if not cfg.tie_embeddings:
    out.append(Entry(('readout', 'kernel'), 'lm_head.weight', 'linear'))
  blk = lambda path, name, kind='same', **kw: Entry(path, L + name, kind, True, **kw)
  if arch == 'gemma2':   # a norm before and after each branch (peri placement)
    out += [blk(('attn_out_norm', 'scale'), 'post_attention_layernorm.weight', offset=g),
            blk(('mlp_norm', 'scale'), 'pre_feedforward_layernorm.weight', offset=g),
            blk(('mlp_out_norm', 'scale'), 'post_feedforward_layernorm.weight', offset=g)]
  else:
    out.append(blk(('mlp_norm', 'scale'), 'post_attention_layernorm.weight', offset=g))
  out += [blk(('attn_norm', 'scale'), 'input_layernorm.weight', offset=g),
          blk(('attn', 'o', 'kernel'), 'self_attn.o_proj.weight', 'linear', n_in=2),
          blk(('mlp', 'wi_gate', 'kernel'), 'mlp.gate_proj.weight', 'linear'),
          blk(('mlp', 'wi_up', 'kernel'), 'mlp.up_proj.weight', 'linear'),
          blk(('mlp', 'wo', 'kernel'), 'mlp.down_proj.weight', 'linear')]
  for t in 'qkv':
    out.append(blk(('attn', t, 'kernel'), f'self_attn.{t}_proj.weight', 'linear'))
    if cfg.proj_bias == 'qkv':
      out.append(blk(('attn', t, 'bias'), f'self_attn.{t}_proj.bias', 'vector'))
  if cfg.norm.qk_norm == 'rms':
    out += [blk(('attn', f'{t}_norm', 'scale'), f'self_attn.{t}_norm.weight') for t in 'qk']
  return out


def _gpt2_entries(cfg: Any, p: str) -> list[Entry]:
  out = [Entry(('embed', 'embedding'), p + 'wte.weight'),
         Entry(('pos_embed',), p + 'wpe.weight'),
         Entry(('final_norm', 'scale'), p + 'ln_f.weight'),
         Entry(('final_norm', 'bias'), p + 'ln_f.bias')]
  if not cfg.tie_embeddings:
    out.append(Entry(('readout', 'kernel'), 'lm_head.weight', 'linear'))
  L = p + 'h.{i}.'
  blk = lambda path, name, kind='same', **kw: Entry(path, L + name, kind, True, **kw)
  for sn, hf in (('attn_norm', 'ln_1'), ('mlp_norm', 'ln_2')):
    out += [blk((sn, 'scale'), f'{hf}.weight'), blk((sn, 'bias'), f'{hf}.bias')]
  for j, t in enumerate('qkv'):
    out += [blk(('attn', t, 'kernel'), 'attn.c_attn.weight', 'conv1d', part=(j, 3)),
            blk(('attn', t, 'bias'), 'attn.c_attn.bias', 'vector', part=(j, 3))]
  for path, name, n_in in ((('attn', 'o'), 'attn.c_proj', 2), (('mlp', 'wi'), 'mlp.c_fc', 1),
                           (('mlp', 'wo'), 'mlp.c_proj', 1)):
    out += [blk(path + ('kernel',), f'{name}.weight', 'conv1d', n_in=n_in),
            blk(path + ('bias',), f'{name}.bias', 'vector')]
  return out


# Tensors a checkpoint may hold that are not parameters (GPT-2's causal-mask buffers).
IGNORED_SUFFIXES = ('.attn.bias', '.attn.masked_bias')


def ignored(arch: str, name: str) -> bool:
  return arch == 'gpt2' and name.endswith(IGNORED_SUFFIXES) and '.c_' not in name


def prefix(arch: str, names: set[str]) -> str:
  """The checkpoint's name prefix: a *ForCausalLM's ('model.', 'transformer.') or a bare base
  model's ('')."""
  first = 'wte.weight' if arch == 'gpt2' else 'embed_tokens.weight'
  for p in (('transformer.', '') if arch == 'gpt2' else ('model.', '')):
    if p + first in names:
      return p
  raise ConfigError(f'the checkpoint has no tensor {first} (nor with a model. / transformer. '
                    f'prefix); valid: a {arch} checkpoint')
