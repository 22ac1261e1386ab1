"""The library half of convert.py: a workdir's checkpoint converted (norms, recursive sharing,
head sharing, LoRA experts merged) into a new workdir."""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from sharenet import data
from sharenet.data import corpus, tokenizer as tokenizer_lib
from sharenet.errors import ConfigError
from sharenet.models.norm_stats import NORM_STATS
from sharenet.models.sections import NORMS, STATS_NORMS
from sharenet.train import experiment, trainer
from sharenet.train.workdir_io import load_config, restore_state, save_workdir
from sharenet.transforms import convert, head_share, lora_merge, recursive


CONVERSIONS = ('rmsnorm', 'crmsnorm', 'recursive', 'head_shared', 'merge_lora_experts',
               'fold_unified_norm')


def _expert_weights(opts: Any, cfg: Any) -> list[float]:
  """config.expert_weights as model.moe.lora_experts floats (one ConfigError line if not)."""
  n = cfg.moe.lora_experts
  try:
    w = [float(x) for x in str(opts.get('expert_weights', '')).split(',') if x.strip()]
  except ValueError:
    w = []
  if not n or len(w) != n:
    raise ConfigError(f'config.to=merge_lora_experts needs a source with model.moe.lora_experts '
                      f'>= 1 (has {n}) and config.expert_weights={opts.get("expert_weights")!r} '
                      f'as {n or "N"} comma-separated floats; valid: e.g. one-hot 1' +
                      ',0' * max(n - 1, 0))
  return w


def convert_workdir(workdir: str, out: str, opts: Any) -> dict[str, Any]:
  """Restores `workdir`'s latest checkpoint, converts it as `opts` (defaults.conversion_config)
  says and writes `out` (config.json and a checkpoint with fresh optimizer and data state)."""
  if opts.to not in CONVERSIONS:
    raise ConfigError(f'config.to={opts.to!r} is unknown; valid: {", ".join(CONVERSIONS)}')
  if opts.to == 'recursive' and opts.num_unique < 1:
    raise ConfigError(f'config.to=recursive needs config.num_unique >= 1, got '
                      f'{opts.num_unique}')
  if os.path.abspath(out) == os.path.abspath(workdir) or (
      os.path.isdir(out) and os.listdir(out)):
    raise ConfigError(f'--out {out} is the source or not empty; valid: a new directory '
                      f'(a conversion never writes over a run)')
  config = load_config(workdir)
  if config.transforms.project == 'ngpt':
    raise ConfigError('conversions of a model trained with transforms.project=ngpt are not '
                      'function-preserving (its projection would re-normalise the converted '
                      'matrices); valid: a source with project=none, nap or norm_project')
  if config.model.norm.kind in STATS_NORMS and opts.to != 'fold_unified_norm':
    stateless = ', '.join(n for n in NORMS if n not in STATS_NORMS)
    fold = ', or config.to=fold_unified_norm' if config.model.norm.kind == 'unified_norm' \
        else ''
    raise ConfigError(f'model.norm.kind={config.model.norm.kind}: config.to={opts.to} does not '
                      f'carry its running statistics (they would restart at their init); '
                      f'valid: a source with a stateless norm ({stateless}){fold}')
  if config.parametrization.kind != 'sp':
    raise ConfigError(f'conversions support parametrization.kind=sp, got '
                      f'{config.parametrization.kind} (its forward multipliers would be folded '
                      f'into the weights and then applied again)')
  moe = config.model.get('moe', {})
  if opts.to != 'merge_lora_experts' and (moe.get('attention', 'none') != 'none' or
                                          moe.get('lora_experts', 0)):
    raise ConfigError(f'config.to={opts.to} does not know SwitchHead\'s or the LoRA experts\' '
                      f'parameters (model.moe.attention / lora_experts); valid: '
                      f'merge_lora_experts, or a source without them')
  state, step, exp = restore_state(config, workdir)
  cfg = exp.model.cfg
  variables = jax.device_get(trainer.effective_params(state, exp.tr))   # reparams resolved
  extra = {}
  if opts.to == 'rmsnorm':
    new_cfg, new_vars = convert.ln_to_rms(cfg, variables)
  elif opts.to == 'crmsnorm':
    if cfg.norm.kind == 'layernorm':
      cfg, variables = convert.ln_to_rms(cfg, variables)
    new_cfg, new_vars = convert.rms_to_crms(cfg, variables)
  elif opts.to == 'fold_unified_norm':   # eval-mode Unified Norm folded into the readers
    new_cfg, new_vars = convert.fold_unified_norm(
        cfg, variables, jax.device_get(state.tstate.get(NORM_STATS, {})))
  elif opts.to == 'merge_lora_experts':   # Mixture of LoRAs -> depth-wise LoRA
    new_cfg, new_vars = lora_merge.merge_lora_experts(cfg, variables,
                                                      _expert_weights(opts, cfg))
  elif opts.to == 'head_shared':
    new_cfg, new_vars, extra['head_sharing'] = head_share.to_head_shared(cfg, variables,
                                                                         opts.share_rate)
  else:
    targets = tuple(t for t in opts.lora_targets.replace(' ', '').split(',') if t)
    calibration = calibration_tokens(config, opts, cfg.max_len) if opts.init == 'similar' \
        else None
    new_cfg, new_vars = recursive.to_recursive(
        cfg, variables, scheme=opts.scheme, num_unique=opts.num_unique, init=opts.init,
        lora_rank=opts.lora_rank, lora_init=opts.lora_init, lora_targets=targets,
        untie_norms=opts.untie_norms, lora_layers=opts.lora_layers, calibration=calibration)
    if calibration is not None:
      extra['pattern'] = new_cfg.sharing.pattern
  raw = config.to_dict()
  raw['model'] = new_cfg.to_config()
  raw['transforms']['reparam'] = ''     # folded into the converted weights
  summary = {'converted_from': os.path.abspath(workdir), 'conversion': opts.to, **extra}
  save_workdir(out, raw, new_cfg, new_vars, step, summary)
  return {'step': step, 'model': raw['model']}


def calibration_tokens(config: Any, opts: Any, max_len: int) -> np.ndarray:
  """(calibration_windows, T) tokens for convert.py's init=similar, T = min(train.seq_len,
  max_len): windows evenly spaced over `opts.calibration` (a text file, encoded with the
  workdir's tokenizer, bytes without one) or else the validation split of the workdir's data."""
  run = experiment.sections(config)
  if opts.calibration:
    if not os.path.isfile(opts.calibration):
      raise ConfigError(f'config.calibration={opts.calibration!r} is not a file; valid: a text '
                        f'file, or \'\' for the workdir\'s validation split')
    with open(opts.calibration, encoding='utf-8') as f:
      text = f.read()
    tok = corpus.for_data(run.data) or tokenizer_lib.ByteTokenizer()
    ids = np.asarray(tok.encode(text), np.int64)
  elif run.data.source == 'bin' and not run.data.path:
    raise ConfigError('config.init=similar needs a calibration batch and this workdir names no '
                      'data (an import); valid: --config.calibration=TEXT_FILE')
  else:
    _, ids = data.load_splits(run.data)
  T = min(run.train.seq_len, max_len)
  n = opts.calibration_windows
  if n < 1 or len(ids) < T + n:
    raise ConfigError(f'config.calibration: {len(ids)} tokens for {n} windows of {T}; valid: '
                      f'calibration_windows >= 1 and a text of at least {T + n} tokens')
  starts = np.linspace(0, len(ids) - T, n).astype(np.int64)
  return np.asarray(ids)[starts[:, None] + np.arange(T)].astype(np.int32)
