"""A train.py workdir: its config, its restored state, evaluation and conversion (the library
side of eval.py and convert.py)."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple

import jax
import ml_collections
import numpy as np

from sharenet.data import tokenizer as tokenizer_lib
from sharenet import checkpoint, data, defaults, eval_lib, recurrence
from sharenet import sharding
from sharenet import train_lib
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig
from sharenet.models.lm import kv_cache_bytes_per_token
from sharenet.models.sections import NORMS, STATS_NORMS
from sharenet.norm_stats import NORM_STATS
from sharenet.transforms import convert, head_share, lora_merge, recursive
from sharenet.workdir_save import save_workdir  # noqa: F401 - convert_workdir, callers


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The workdir's config.json; keys added since it was written take the defaults."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise ConfigError(f'--workdir {workdir} has no config.json; pass the workdir of a train.py run')
  with open(path) as f:
    raw = json.load(f)
  keys = ('model', 'train', 'data', 'parametrization', 'mesh', 'transforms')
  return defaults.complete({k: raw[k] for k in keys if k in raw})


class Restored(NamedTuple):
  """A workdir's restored train state, its step and the experiment that trained it."""
  state: train_lib.TrainState
  step: int
  exp: train_lib.Experiment


def restore_state(config: ml_collections.ConfigDict, workdir: str,
                  step: int | None = None) -> Restored:
  """The parameters and transform state of the latest readable (or `step`) checkpoint of
  `workdir`, with the experiment `config` builds (`state.opt_state` is None: not needed).

  Reads only; nothing in the workdir is moved or written. A checkpoint that does not fit
  `config` is one ConfigError line.
  """
  mcfg = ModelConfig.from_experiment(config)
  exp = train_lib.setup(config, mcfg)
  abstract = jax.eval_shape(
      lambda: train_lib.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz))
  # Restore onto this process's devices, whatever mesh (or hosts) wrote the checkpoint.
  abstract = sharding.with_shardings(abstract, sharding.replicated_like(abstract))
  parts = {'step': abstract.step, 'params': abstract.params, 'tstate': abstract.tstate}
  mngr = checkpoint.manager(workdir, config.train.keep_checkpoints, async_save=False)
  try:
    steps = sorted(mngr.all_steps(), reverse=True)
    if not steps:
      raise ConfigError(f'--workdir {workdir} holds no checkpoint')
    if step is not None and step not in steps:
      raise ConfigError(f'--step={step} not found; available: {sorted(steps)}')
    for s in [step] if step is not None else steps:
      try:
        out, _ = checkpoint.restore_parts(mngr, s, parts)
      except checkpoint.StateMismatch as e:
        raise ConfigError(f'--workdir {workdir}: {e}: it was written by another config; valid: '
                          f'the workdir\'s own config.json, overriding only fields that keep '
                          f'the parameter tree') from None
      except Exception as e:  # noqa: BLE001 - unreadable: report it, try an older one
        if step is not None:
          raise ConfigError(f'--workdir {workdir}: checkpoint {s} is unreadable '
                            f'({type(e).__name__}); available: {sorted(steps)}') from None
        print(f'WARNING: checkpoint {s} is unreadable ({type(e).__name__}); trying an older '
              f'one', flush=True)
        continue
      state = train_lib.TrainState(out['step'], out['params'], None, out['tstate'])
      return Restored(state, int(s), exp)
    raise ConfigError(f'--workdir {workdir}: no readable checkpoint')
  finally:
    mngr.close()


def param_reader(config: ml_collections.ConfigDict, workdir: str
                 ) -> tuple[int, dict[tuple, Any], Callable[[tuple], np.ndarray]]:
  """(step, {params path: ShapeDtypeStruct}, read) for `workdir`'s latest checkpoint:
  read(path) restores that one stored parameter as a host array (checkpoint.restore_leaf), so
  a caller holds one tensor at a time. The checkpoint's parameter tree must be the config's
  (else one ConfigError line, as restore_state)."""
  from flax.traverse_util import flatten_dict as flat_of
  exp = train_lib.setup(config, ModelConfig.from_experiment(config))
  abstract = train_lib.abstract_state(exp.model, exp.tx, exp.tr, exp.pz).params['params']
  shapes = dict(flat_of(abstract))
  mngr = checkpoint.manager(workdir, config.train.keep_checkpoints, async_save=False)
  try:
    steps = sorted(mngr.all_steps())
    if not steps:
      raise ConfigError(f'--workdir {workdir} holds no checkpoint')
    step = steps[-1]
    saved = {k: v for k, v in checkpoint.saved_signatures(mngr, step).items()
             if k.startswith('params/params/')}
    want = {'params/params/' + k: v for k, v in checkpoint.leaf_signatures(abstract).items()}
    diff = checkpoint.first_difference(saved, want)
    if diff is not None:
      raise ConfigError(f'--workdir {workdir}: checkpoint {step}: {diff}: it was written by '
                        f'another config; valid: the workdir\'s own config.json')
  finally:
    mngr.close()

  def read(path: tuple) -> np.ndarray:
    m = checkpoint.manager(workdir, config.train.keep_checkpoints, async_save=False)
    try:
      return checkpoint.restore_leaf(m, step, 'params', ('params',) + tuple(path), shapes[path])
    finally:
      m.close()
  return step, shapes, read


def evaluate_workdir(workdir: str, step: int | None = None,
                     overrides: dict[str, Any] | None = None) -> dict[str, Any]:
  """Restores the latest (or `step`) checkpoint's params and evaluates the validation split.

  `overrides` ({'train.eval_batch_size': 64, ...}) change the workdir's config for this eval.
  """
  config = load_config(workdir)
  config.update_from_flattened_dict(overrides or {})
  state, step, (model, _, pz, tr) = restore_state(config, workdir, step)
  params = jax.jit(train_lib.effective_params, static_argnums=(1, 2))(state, tr, pz)
  out = eval_lib.evaluate(model, params, config.data, config.train.seq_len,
                          config.train.eval_batch_size, recurrence.eval_schedule(model.cfg))
  out = {'step': int(step), **out,
         'unigram_bits_per_byte': data.unigram_bits_per_byte(config.data)}
  with open(os.path.join(workdir, 'eval.json'), 'w') as f:
    json.dump(out, f, indent=2)
  return out


class ForGeneration(NamedTuple):
  """A restored workdir ready for sharenet.generate: the model, the variables it applies
  (effective params: transforms and parametrization multipliers resolved once), the config."""
  model: DecoderLM
  variables: Any
  config: ml_collections.ConfigDict
  step: int
  tokenizer: Any   # data/tokenizer.py Tokenizer: encodes prompts, decodes samples


def load_for_generation(workdir: str, step: int | None = None,
                        overrides: dict[str, Any] | None = None) -> ForGeneration:
  """Restores the latest (or `step`) checkpoint for generation (eval.py --prompt).

  Prompts and samples go through the data's tokenizer (data/tokenizer.py for_data: bytes, or
  the shards' own for arrayrecord); a model trained on `bin` token ids needs
  --config.data.tokenizer=hf:PATH (or sentencepiece:PATH) to name it, else a ConfigError.
  """
  config = load_config(workdir)
  config.update_from_flattened_dict(overrides or {})
  tok = tokenizer_lib.for_data(config.data)
  if tok is None:
    raise ConfigError(f'--workdir {workdir} was trained on token ids (data.source=bin) of an '
                      f'unnamed tokenizer; valid: --config.data.tokenizer=hf:PATH or '
                      f'sentencepiece:PATH (the tokenizer that made them)')
  state, step, (model, _, pz, tr) = restore_state(config, workdir, step)
  variables = jax.jit(train_lib.effective_params, static_argnums=(1, 2))(state, tr, pz)
  return ForGeneration(model, variables, config, int(step), tok)


def read_prompts(prompt: str | None, prompt_file: str | None) -> list[str]:
  """eval.py's --prompt or --prompt_file (one prompt per line) as a list; ConfigError if empty."""
  if prompt is not None and prompt_file is not None:
    raise ConfigError('--prompt and --prompt_file are exclusive; pass one')
  if prompt_file is not None:
    try:
      with open(prompt_file, encoding='utf-8') as f:
        prompts = [line.rstrip('\r\n') for line in f]
    except OSError as e:
      raise ConfigError(f'--prompt_file {prompt_file}: {e.strerror}') from None
    if not prompts:
      raise ConfigError(f'--prompt_file {prompt_file} holds no prompt')
  else:
    prompts = [prompt]
  for i, p in enumerate(prompts):
    if not p:
      where = f' (line {i + 1} of --prompt_file)' if prompt_file is not None else ''
      raise ConfigError(f'empty prompt{where}; valid: at least one character')
  return prompts


def generate_from_workdir(workdir: str, step: int | None, overrides: dict[str, Any],
                          prompts: list[str], *, max_new_tokens: int, temperature: float,
                          top_k: int, top_p: float, seed: int, num_samples: int,
                          eos_id: int | None, depth: int | None = None,
                          exit: str | None = None) -> list[dict[str, Any]]:
  """eval.py --prompt: `num_samples` continuations of every prompt, one JSON-able row each.

  Prompts are encoded and samples decoded with the data's tokenizer; byte models show invalid
  UTF-8 as \\xNN; shards' models stop at the end-of-document id unless `eos_id` is given.
  `depth` (eval.py --depth): decode at that many loops of the looped segment; `exit` (--exit
  criterion:threshold, sharenet/exits.py): adaptive exits after any loop (up to `depth`, default
  the trained loops; sharenet/recursive_inference.py), each row then with `mean_exit_loops`.
  """
  from sharenet import depth as depth_lib
  from sharenet import exits, generate
  from sharenet import recursive_inference as ri
  if num_samples < 1:
    raise ConfigError(f'--num_samples={num_samples} must be >= 1')
  if temperature < 0:
    raise ConfigError(f'--temperature={temperature} must be >= 0 (0: greedy)')
  rule = None if exit is None else exits.parse(exit)
  if depth is not None or rule is not None:   # checked before restoring or compiling
    config = load_config(workdir)
    config.update_from_flattened_dict(overrides or {})
    mcfg = ModelConfig.from_experiment(config)
    depth_lib.looped_shape(mcfg, '--exit' if depth is None else '--depth')
    if depth is not None:
      depth_lib.check_depth(mcfg, depth, '--depth')
    if rule is not None:
      ri.check_recursive(DecoderLM(mcfg), None)
  loaded = load_for_generation(workdir, step, overrides)
  tok = loaded.tokenizer
  byte_level = isinstance(tok, tokenizer_lib.ByteTokenizer)
  eos = eos_id if eos_id is not None or byte_level else tok.eod_id
  batch = [tok.encode(p).tolist() for p in prompts for _ in range(num_samples)]
  sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, rng=jax.random.key(seed),
                  eos_id=eos)
  extra: list[dict[str, Any]] = [{} for _ in batch]
  if rule is not None:
    out = ri.generate_early_exit(loaded.model, loaded.variables, batch, max_new_tokens,
                                 exit=rule, depth=depth, **sampling)
    timing = {'tokens_per_sec': round(out.tokens_per_sec, 1)}
    extra = [{'exit': f'{rule.criterion}:{rule.threshold:g}', 'mean_exit_loops': round(d, 3)}
             for d in out.exit_depths]
  else:
    out = generate.generate(loaded.model, loaded.variables, batch, max_new_tokens,
                            loops=depth, **sampling)
    timing = {'tokens_per_sec': round(out.tokens_per_sec, 1),
              'compile_sec': round(out.compile_seconds, 2)}
  # the keys and values the cache holds per token of one sequence (loop by loop: the bytes a
  # cache of this depth allocates; it holds the same rows)
  timing['kv_bytes_per_token'] = (round(out.kv_bytes_per_token, 1) if rule is None else
                                  kv_cache_bytes_per_token(loaded.model.cfg, depth))
  if depth is not None:
    extra = [{'depth': depth, **e} for e in extra]
  return [{'prompt': prompts[i // num_samples], 'sample': i % num_samples,
           'text': tok.decode(tokens), 'num_tokens': len(tokens), 'step': loaded.step,
           **timing, **extra[i]}
          for i, tokens in enumerate(out.tokens)]


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
  variables = jax.device_get(train_lib.effective_params(state, exp.tr))   # reparams resolved
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
  if opts.calibration:
    if not os.path.isfile(opts.calibration):
      raise ConfigError(f'config.calibration={opts.calibration!r} is not a file; valid: a text '
                        f'file, or \'\' for the workdir\'s validation split')
    with open(opts.calibration, encoding='utf-8') as f:
      text = f.read()
    tok = tokenizer_lib.for_data(config.data) or tokenizer_lib.ByteTokenizer()
    ids = np.asarray(tok.encode(text), np.int64)
  elif config.data.source == 'bin' and not config.data.path:
    raise ConfigError('config.init=similar needs a calibration batch and this workdir names no '
                      'data (an import); valid: --config.calibration=TEXT_FILE')
  else:
    _, ids = data.load_splits(config.data)
  T = min(config.train.seq_len, max_len)
  n = opts.calibration_windows
  if n < 1 or len(ids) < T + n:
    raise ConfigError(f'config.calibration: {len(ids)} tokens for {n} windows of {T}; valid: '
                      f'calibration_windows >= 1 and a text of at least {T + n} tokens')
  starts = np.linspace(0, len(ids) - T, n).astype(np.int64)
  return np.asarray(ids)[starts[:, None] + np.arange(T)].astype(np.int32)
