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
from sharenet.config import compat
from sharenet.models import DecoderLM, ModelConfig
from sharenet.models.norm_stats import NORM_STATS
from sharenet.train import evaluation, experiment, trainer
from sharenet.train.workdir_io import load_config, restore_state, save_workdir
from sharenet.transforms import convert, head_share, lora_merge, recursive, to_mpo, widen


CONVERSIONS = tuple(compat.CONVERSIONS)   # config.to


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


def check_options(opts: Any) -> None:
  """One ConfigError line for a conversion the options alone rule out."""
  if opts.to not in CONVERSIONS:
    raise ConfigError(f'config.to={opts.to!r} is unknown; valid: {", ".join(CONVERSIONS)}')
  if opts.post_train_steps and opts.to != 'head_shared':
    raise ConfigError(f'config.post_train_steps={opts.post_train_steps} post-trains before '
                      f'head sharing (PostShare); valid: config.to=head_shared, or 0')
  if opts.to == 'head_shared':
    head_share.check_post_training(opts)
  if opts.to == 'mpo' and opts.mpo_cores < 2:
    raise ConfigError(f'config.to=mpo needs config.mpo_cores >= 2 (the local tensors of each '
                      f'kernel), got {opts.mpo_cores}')
  if opts.to == 'recursive' and opts.init in recursive.SET_COUNT_INITS and opts.num_unique < 1:
    raise ConfigError(f'config.to=recursive needs config.num_unique >= 1, got '
                      f'{opts.num_unique}')


def convert_model(cfg: ModelConfig, variables: Any, opts: Any, norm_stats: Any = None,
                  calibration: np.ndarray | None = None
                  ) -> tuple[ModelConfig, Any, dict[str, Any]]:
  """(new config, new variables, extra summary entries): the model `cfg` with `variables`
  (reparametrizations resolved) converted as `opts` says. `norm_stats`: the statistics norm's
  collection (fold_unified_norm); `calibration`: init=similar's tokens. The compatibility
  table (config/compat.py CONVERSIONS) refuses a source it cannot convert, in one line."""
  check_options(opts)
  extra = {}
  if opts.to == 'rmsnorm':
    new_cfg, new_vars = convert.ln_to_rms(cfg, variables)
  elif opts.to == 'crmsnorm':
    if cfg.norm.kind == 'layernorm':
      cfg, variables = convert.ln_to_rms(cfg, variables)
    new_cfg, new_vars = convert.rms_to_crms(cfg, variables)
  elif opts.to == 'fold_unified_norm':   # eval-mode Unified Norm folded into the readers
    new_cfg, new_vars = convert.fold_unified_norm(cfg, variables, norm_stats or {})
  elif opts.to == 'merge_lora_experts':   # Mixture of LoRAs -> depth-wise LoRA
    new_cfg, new_vars = lora_merge.merge_lora_experts(cfg, variables,
                                                      _expert_weights(opts, cfg))
  elif opts.to == 'wider':   # row-column growth (sharenet/transforms/widen.py)
    new_cfg = widen.target(cfg, int(opts.d_model), int(opts.mlp_dim), int(opts.num_heads))
    new_vars = widen.widen(cfg, variables, new_cfg, int(opts.seed))
  elif opts.to == 'mpo':   # MPO kernels, the central tensor shared (transforms/to_mpo.py)
    targets = tuple(t for t in opts.mpo_targets.replace(' ', '').split(',') if t)
    new_cfg, new_vars, extra['mpo'] = to_mpo.to_mpo(cfg, variables, int(opts.mpo_cores),
                                                    int(opts.mpo_bond), targets)
  elif opts.to == 'head_shared':
    new_cfg, new_vars, extra['head_sharing'] = head_share.to_head_shared(
        cfg, variables, opts.share_rate, post=head_share.PostTraining.from_options(
            opts, calibration))
  else:
    targets = tuple(t for t in opts.lora_targets.replace(' ', '').split(',') if t)
    new_cfg, new_vars, chosen = recursive.convert(
        cfg, variables, scheme=opts.scheme, num_unique=opts.num_unique, init=opts.init,
        lora_rank=opts.lora_rank, lora_init=opts.lora_init, lora_targets=targets,
        untie_norms=opts.untie_norms, lora_layers=opts.lora_layers, calibration=calibration,
        select=recursive.Selection.from_options(opts))
    extra.update(chosen)
  return new_cfg, new_vars, extra


def convert_workdir(workdir: str, out: str, opts: Any) -> dict[str, Any]:
  """Restores `workdir`'s latest checkpoint, converts it as `opts` (defaults.conversion_config)
  says and writes `out` (config.json and a checkpoint with fresh optimizer and data state).
  The compatibility table checks the run's whole config (its parametrization, transforms and
  model) before anything is restored."""
  check_options(opts)
  if os.path.abspath(out) == os.path.abspath(workdir) or (
      os.path.isdir(out) and os.listdir(out)):
    raise ConfigError(f'--out {out} is the source or not empty; valid: a new directory '
                      f'(a conversion never writes over a run)')
  config = load_config(workdir)
  compat.check_action(f'convert_{opts.to}', config, f'config.to={opts.to}')
  state, step, exp = restore_state(config, workdir)
  cfg = exp.model.cfg
  variables = source_variables(state, exp, opts.to)
  calibration = calibration_tokens(config, opts, cfg.max_len) if (
      opts.to == 'recursive' and recursive.needs_calibration(
          opts.init, recursive.Selection.from_options(opts)) or
      opts.to == 'head_shared' and opts.post_train_steps) else None
  new_cfg, new_vars, extra = convert_model(
      cfg, variables, opts, jax.device_get(state.tstate.get(NORM_STATS, {})), calibration)
  raw = config.to_dict()
  raw['model'] = new_cfg.to_config()
  raw['transforms']['reparam'] = ''     # folded into the converted weights
  if opts.to == 'wider':   # the proxy's widths pinned (widen.target) in the run's group too
    raw['parametrization'].update(base_d_model=new_cfg.parametrization.base_d_model,
                                  base_num_heads=new_cfg.parametrization.base_num_heads)
    new_pz = trainer.setup(experiment.sections(raw, new_cfg), new_cfg).pz
    effective_new = new_vars
    new_vars = stored_from_effective(new_pz, new_vars)
    extra['zero_shot'] = zero_shot(exp.model.cfg, variables, new_cfg, effective_new,
                                   calibration_tokens(config, opts, cfg.max_len))
    print(f'note: grown to d_model {new_cfg.d_model}: zero-shot loss '
          f'{extra["zero_shot"]["wider_loss"]:.4f} against the source\'s '
          f'{extra["zero_shot"]["source_loss"]:.4f} (max |logit difference| '
          f'{extra["zero_shot"]["max_abs_logit_diff"]:.2e})', flush=True)
  summary = {'converted_from': os.path.abspath(workdir), 'conversion': opts.to, **extra}
  save_workdir(out, raw, new_cfg, new_vars, step, summary)
  return {'step': step, 'model': raw['model'], **extra}


def source_variables(state: Any, exp: Any, to: str) -> Any:
  """The variables a conversion `to` reads from a restored `state`: reparametrizations
  resolved; wider also applies the parametrization's forward multipliers (divided out at the
  new width, stored_from_effective), the others convert the stored values."""
  return jax.device_get(trainer.effective_params(state, exp.tr,
                                                 exp.pz if to == 'wider' else None))


def stored_from_effective(pz: Any, variables: Any) -> Any:
  """The stored parameters whose effective values under `pz` are `variables`: each leaf divided
  by its forward multiplier (1 under SP)."""
  if not pz.has_forward:
    return variables
  mult = pz.forward(jax.tree.map(np.ones_like, variables))
  return jax.tree.map(lambda v, m: np.asarray(v) / np.asarray(m), variables, mult)


def zero_shot(cfg: ModelConfig, variables: Any, new_cfg: ModelConfig, new_vars: Any,
              tokens_BT1: np.ndarray) -> dict[str, float]:
  """Mean next-token loss of the source and the converted model (effective variables) on
  `tokens_BT1`, and their largest logit difference."""
  batch = jax.numpy.asarray(tokens_BT1)
  logits, losses = [], []
  for c, v in ((cfg, variables), (new_cfg, new_vars)):
    out = jax.jit(DecoderLM(c).apply)(v, batch[:, :-1])
    nll = evaluation.token_nll(DecoderLM(c), v, batch)[0]
    logits.append(np.asarray(out, np.float64))
    losses.append(float(np.mean(np.asarray(nll))))
  return {'source_loss': losses[0], 'wider_loss': losses[1],
          'max_abs_logit_diff': float(np.max(np.abs(logits[1] - logits[0])))}


def calibration_tokens(config: Any, opts: Any, max_len: int) -> np.ndarray:
  """(calibration_windows, T) tokens for convert.py's init=similar / replace and remove_rate, T = min(train.seq_len,
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
    what = {'wider': 'the zero-shot check',
            'head_shared': 'config.post_train_steps'}.get(
        opts.to, f'config.init={opts.init} (or config.remove_rate)')
    raise ConfigError(f'{what} needs a calibration batch and this workdir names no data (an '
                      f'import); valid: --config.calibration=TEXT_FILE')
  else:
    _, ids = data.load_splits(run.data)
  T = min(run.train.seq_len, max_len)
  n = opts.calibration_windows
  if n < 1 or len(ids) < T + n:
    raise ConfigError(f'config.calibration: {len(ids)} tokens for {n} windows of {T}; valid: '
                      f'calibration_windows >= 1 and a text of at least {T + n} tokens')
  starts = np.linspace(0, len(ids) - T, n).astype(np.int64)
  return np.asarray(ids)[starts[:, None] + np.arange(T)].astype(np.int32)
