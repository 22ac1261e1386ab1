"""The library half of eval.py: a workdir's checkpoint evaluated on the validation split, at
other loop counts, on downstream tasks (lm-evaluation-harness), or generating from prompts (with
adaptive exits)."""
from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Sequence

import jax
import ml_collections

from sharenet import data
from sharenet.data import corpus, tokenizer as tokenizer_lib
from sharenet.errors import ConfigError
from sharenet.inference import exits, generate, loop_by_loop, test_time_depth
from sharenet.models import DecoderLM, ModelConfig
from sharenet.models.lm import kv_cache_bytes_per_token
from sharenet.models.loops import Schedule
from sharenet.tasks import task_eval
from sharenet.train import evaluation, experiment, sampled_depth, trainer
from sharenet.train.workdir_io import load_config, restore_state


def evaluate_workdir(workdir: str, step: int | None = None,
                     overrides: dict[str, Any] | None = None, ema: bool = False
                     ) -> dict[str, Any]:
  """Restores the latest (or `step`) checkpoint's params (with `ema`, the run's average of its
  weights, train.ema) and evaluates the validation split.

  `overrides` ({'train.eval_batch_size': 64, ...}) change the workdir's config for this eval.
  """
  config = load_config(workdir)
  config.update_from_flattened_dict(overrides or {})
  state, step, (model, _, pz, tr) = restore_state(config, workdir, step, ema=ema)
  run = experiment.sections(config, model.cfg)
  params = jax.jit(trainer.effective_params, static_argnums=(1, 2))(state, tr, pz)
  out = evaluation.evaluate(model, params, run.data, run.train.seq_len,
                            run.train.eval_batch_size, sampled_depth.eval_schedule(model.cfg))
  out = {'step': int(step), **({'ema': True} if ema else {}), **out,
         'unigram_bits_per_byte': data.unigram_bits_per_byte(run.data)}
  with open(os.path.join(workdir, 'eval.json'), 'w') as f:
    json.dump(out, f, indent=2)
  return out


class ForGeneration(NamedTuple):
  """A restored workdir ready for sharenet.inference.generate: the model, the variables it applies
  (effective params: transforms and parametrization multipliers resolved once), the config."""
  model: DecoderLM
  variables: Any
  config: ml_collections.ConfigDict
  step: int
  tokenizer: Any   # data/tokenizer.py Tokenizer: encodes prompts, decodes samples


def load_for_generation(workdir: str, step: int | None = None,
                        overrides: dict[str, Any] | None = None) -> ForGeneration:
  """Restores the latest (or `step`) checkpoint for generation (eval.py --prompt).

  Prompts and samples go through the data's tokenizer (data/corpus.py for_data: bytes, or
  the shards' own for arrayrecord); a model trained on `bin` token ids needs
  --config.data.tokenizer=hf:PATH (or sentencepiece:PATH) to name it, else a ConfigError.
  """
  config = load_config(workdir)
  config.update_from_flattened_dict(overrides or {})
  tok = corpus.for_data(experiment.sections(config).data)
  if tok is None:
    raise ConfigError(f'--workdir {workdir} was trained on token ids (data.source=bin) of an '
                      f'unnamed tokenizer; valid: --config.data.tokenizer=hf:PATH or '
                      f'sentencepiece:PATH (the tokenizer that made them)')
  state, step, (model, _, pz, tr) = restore_state(config, workdir, step)
  variables = jax.jit(trainer.effective_params, static_argnums=(1, 2))(state, tr, pz)
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
  criterion:threshold, sharenet/inference/exits.py): adaptive exits after any loop (up to `depth`,
  default
  the trained loops; sharenet/inference/loop_by_loop.py), each row then with `mean_exit_loops`.
  """
  if num_samples < 1:
    raise ConfigError(f'--num_samples={num_samples} must be >= 1')
  if temperature < 0:
    raise ConfigError(f'--temperature={temperature} must be >= 0 (0: greedy)')
  rule = None if exit is None else exits.parse(exit)
  if depth is not None or rule is not None:   # checked before restoring or compiling
    config = load_config(workdir)
    config.update_from_flattened_dict(overrides or {})
    mcfg = ModelConfig.from_experiment(config)
    if depth is not None:
      test_time_depth.check_depth(mcfg, depth, '--depth')
    if rule is not None:
      loop_by_loop.check_recursive(DecoderLM(mcfg), None)
  loaded = load_for_generation(workdir, step, overrides)
  tok = loaded.tokenizer
  byte_level = isinstance(tok, tokenizer_lib.ByteTokenizer)
  eos = eos_id if eos_id is not None or byte_level else tok.eod_id
  batch = [tok.encode(p).tolist() for p in prompts for _ in range(num_samples)]
  sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, rng=jax.random.key(seed),
                  eos_id=eos)
  extra: list[dict[str, Any]] = [{} for _ in batch]
  if rule is not None:
    out = loop_by_loop.generate_early_exit(loaded.model, loaded.variables, batch, max_new_tokens,
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


def evaluate_workdir_depths(workdir: str, step: int | None, overrides: dict[str, Any] | None,
                            depths: Sequence[int]) -> list[dict[str, Any]]:
  """eval.py --depths: the workdir's checkpoint at every depth; writes the rows
  (eval_depths.jsonl) and the plot (loss_vs_depth.png) into the workdir."""
  config = load_config(workdir)
  config.update_from_flattened_dict(overrides or {})
  mcfg = ModelConfig.from_experiment(config)
  shape = test_time_depth.looped_shape(mcfg, '--depths')
  for n in depths:   # before restoring or compiling anything
    test_time_depth.check_depth(mcfg, n, '--depths')
  state, step, (model, _, pz, tr) = restore_state(config, workdir, step)
  run = experiment.sections(config, model.cfg)
  params = jax.jit(trainer.effective_params, static_argnums=(1, 2))(state, tr, pz)
  rows = [{'step': int(step), **r} for r in evaluation.evaluate_depths(
      model, params, run.data, run.train.seq_len, run.train.eval_batch_size, depths)]
  with open(os.path.join(workdir, test_time_depth.RESULTS), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  # the depth it trained at (a sampled run: its rounded mean)
  trained = shape.loops if mcfg.recurrent_segment is None else sampled_depth.fixed_depth(mcfg)
  test_time_depth.plot_depths(rows, trained, os.path.join(workdir, test_time_depth.PLOT))
  return rows


TASK_RESULTS = 'tasks.jsonl'
TASK_PLOT = 'accuracy_vs_depth.png'


def evaluate_workdir_tasks(workdir: str, step: int | None, overrides: dict[str, Any] | None,
                           tasks: str, *, task_dir: str | None = None,
                           num_fewshot: int | None = None, limit: int | None = None,
                           depths: Sequence[int] | None = None, exit: str | None = None,
                           max_batch_tokens: int = 8192) -> list[dict[str, Any]]:
  """eval.py --tasks: the checkpoint on lm-evaluation-harness tasks (sharenet/tasks/), one row
  per task (and per depth of `depths`); writes the rows (tasks.jsonl) into the workdir and, at
  several depths, accuracy against depth (accuracy_vs_depth.png). Names, shots, depths and the
  tokenizer are checked before anything is restored or compiled."""
  names = task_eval.parse_tasks(tasks)
  if num_fewshot is not None and num_fewshot < 0:
    raise ConfigError(f'--num_fewshot={num_fewshot}; valid: >= 0 (or leave it out: each task\'s '
                      f'own)')
  if limit is not None and limit < 1:
    raise ConfigError(f'--limit={limit}; valid: >= 1 items per task (or leave it out: all)')
  config = load_config(workdir)
  config.update_from_flattened_dict(overrides or {})
  mcfg = ModelConfig.from_experiment(config)
  for n in depths or []:
    test_time_depth.check_depth(mcfg, n, '--depths' if len(depths) > 1 else '--depth')
  if exit is not None:
    exits.parse(exit)
    loop_by_loop.check_recursive(DecoderLM(mcfg), None)
  task_eval.load_tasks(names, task_dir, num_fewshot)   # names and shots, before restoring
  loaded = load_for_generation(workdir, step, overrides)
  seq_len = experiment.sections(loaded.config).train.seq_len
  rows = []
  for depth in depths or [None]:
    schedule = (Schedule(loops=depth) if depth is not None
                else sampled_depth.eval_schedule(loaded.model.cfg))
    lm = task_eval.as_harness_model(loaded.model, loaded.variables, loaded.tokenizer,
                                    max_length=seq_len, schedule=schedule, exit=exit,
                                    depth=depth, max_batch_tokens=max_batch_tokens)
    results = task_eval.run_tasks(lm, names, task_dir, num_fewshot, limit)
    for name in names:
      row = {'task': name, 'step': loaded.step, **({} if depth is None else {'depth': depth}),
             'num_fewshot': num_fewshot, 'limit': limit, **results[name]}
      rows.append(row)
  with open(os.path.join(workdir, TASK_RESULTS), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  if depths is not None and len(depths) > 1:
    task_eval.plot_depths(rows, test_time_depth.looped_shape(mcfg, '--depths').loops,
                          os.path.join(workdir, TASK_PLOT))
  return rows


def run_cli(workdir: str, overrides: dict[str, Any], *, step: int | None = None,
            prompt: str | None = None, prompt_file: str | None = None,
            max_new_tokens: int = 200, temperature: float = 1.0, top_k: int = 0,
            top_p: float = 1.0, seed: int = 0, num_samples: int = 1, depths: str | None = None,
            depth: int | None = None, exit: str | None = None, tasks: str | None = None,
            task_dir: str | None = None, num_fewshot: int | None = None,
            limit: int | None = None, eos_id: int | None = None,
            ema: bool = False) -> list[dict[str, Any]]:
  """eval.py's modes, by its flags, as the rows it prints: downstream tasks (--tasks and its
  flags), generation (--prompt / --prompt_file), evaluation at depths (--depths / --depth) or
  the plain evaluation; flags of another mode, or that exclude each other, are one ConfigError
  line."""
  generating = prompt is not None or prompt_file is not None
  if ema and (generating or tasks is not None or depths is not None or depth is not None):
    raise ConfigError('--ema evaluates the weights\' average on the validation split; valid: '
                      '--ema without --prompt, --tasks, --depths or --depth')
  if tasks is not None or any(v is not None for v in (task_dir, num_fewshot, limit)):
    if tasks is None:
      raise ConfigError('--task_dir, --num_fewshot and --limit apply to --tasks; valid: with '
                        '--tasks NAMES')
    if generating:
      raise ConfigError('--tasks evaluates tasks and --prompt generates; valid: one of them')
    if depths is not None and depth is not None:
      raise ConfigError('--depth and --depths exclude each other; valid: one of them')
    at = (test_time_depth.parse_depths(depths) if depths is not None
          else [depth] if depth is not None else None)
    return evaluate_workdir_tasks(workdir, step, overrides, tasks, task_dir=task_dir,
                                  num_fewshot=num_fewshot, limit=limit, depths=at, exit=exit)
  at = test_time_depth.check_flags(depths, depth, exit, generating)
  if generating:
    return generate_from_workdir(
        workdir, step, overrides, read_prompts(prompt, prompt_file),
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, num_samples=num_samples, eos_id=eos_id, depth=depth, exit=exit)
  if at is not None:
    return evaluate_workdir_depths(workdir, step, overrides, at)
  return [evaluate_workdir(workdir, step, overrides, ema=ema)]
