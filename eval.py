"""Evaluates a run: python eval.py --workdir DIR [--step N] [--config.a.b=v]; prints one JSON line.

`--config.a.b=v` overrides the workdir's config for this evaluation (e.g.
--config.train.eval_batch_size=64 or --config.data.path=...); any key of the default config.

With --prompt TEXT (or --prompt_file FILE, one prompt per line) it generates instead
(sharenet/inference/generate.py, docs/generation.md): one JSON line per prompt and sample, with the
continuation as `text` (bytes that are not valid UTF-8 escaped as \\xNN), `tokens_per_sec` and
`kv_bytes_per_token` (the KV cache's bytes per token of one sequence):
  python eval.py --workdir DIR --prompt "def fib(" --max_new_tokens 200 \\
      [--temperature 0.8 --top_k 40 --top_p 0.95 --seed 0 --num_samples 4]

Test-time depth of a looped model (sharenet/inference/test_time_depth.py, docs/generation.md):
--depths 1,2,4,8
evaluates at every depth (one JSON line each: depth, eval_loss, eval_bits_per_byte,
flops_per_token; writes loss_vs_depth.png and eval_depths.jsonl into the workdir); --depth N
evaluates, or with --prompt generates, at N loops; --exit maxprob:0.9 | entropy:0.5 |
entropy_change:0.001 | kl:0.01 | argmax_stable:5 | latent:0.03 | cosine:0.99 exits each generated
token after the first loop whose criterion fires (up to --depth, default the trained loops), each
line with mean_exit_loops (docs/generation.md, "Adaptive exits").

Downstream tasks through lm-evaluation-harness (sharenet/tasks/, docs/evaluation.md):
  python eval.py --workdir DIR --tasks hellaswag,piqa [--task_dir DIR] [--num_fewshot K]
      [--limit N] [--depths 1,2,4 | --depth N] [--exit kl:0.01]
prints one JSON line per task (and depth) with the harness's metrics and writes them to
DIR/tasks.jsonl (with --depths, accuracy_vs_depth.png); --exit applies to generation tasks.
"""
import json

from absl import flags, logging
from ml_collections import config_flags

from sharenet.config import cli, defaults

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train.py workdir.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_CONFIG = cli.define_config_dict(
    'config', defaults.default_config(), 'Overrides of the workdir config: --config.a.b=v.')
_PROMPT = flags.DEFINE_string('prompt', None, 'Generate a continuation of this text.')
_PROMPT_FILE = flags.DEFINE_string('prompt_file', None,
                                   'Generate for every line of this file (one batch).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 200, 'Tokens (bytes) to generate.')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Sampling temperature; 0: greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample from the k most likely tokens; 0: all.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass; 1: off.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_NUM_SAMPLES = flags.DEFINE_integer('num_samples', 1, 'Samples per prompt.')
_DEPTHS = flags.DEFINE_string('depths', None, 'Evaluate at these loop counts of the looped '
                              'segment, e.g. 1,2,4,8 (test-time depth).')
_DEPTH = flags.DEFINE_integer('depth', None, 'Loops of the looped segment for generation (or '
                              'one evaluation); with --exit the most loops a token runs.')
_EXIT = flags.DEFINE_string('exit', None, 'Adaptive exit of generated tokens: maxprob:T, '
                            'entropy:T, entropy_change:T, kl:T, argmax_stable:K, latent:T or '
                            'cosine:T (docs/generation.md).')
_TASKS = flags.DEFINE_string('tasks', None, 'lm-evaluation-harness tasks, e.g. hellaswag,piqa '
                             '(docs/evaluation.md): one JSON line per task (and per --depths).')
_TASK_DIR = flags.DEFINE_string('task_dir', None, 'Also the harness task definitions (YAML) '
                                'under this directory.')
_NUM_FEWSHOT = flags.DEFINE_integer('num_fewshot', None, 'Shots per task item; default: each '
                                    'task\'s own.')
_LIMIT = flags.DEFINE_integer('limit', None, 'Only the first N items of each task.')
_EOS = flags.DEFINE_integer('eos_id', None, 'Stop a sample at this token id; default: none for '
                            'byte models, the end-of-document id for arrayrecord shards.')


def _generate(overrides) -> None:
  from sharenet.main import eval_workdir
  prompts = eval_workdir.read_prompts(_PROMPT.value, _PROMPT_FILE.value)
  for row in eval_workdir.generate_from_workdir(
      _WORKDIR.value, _STEP.value, overrides, prompts, max_new_tokens=_MAX_NEW.value,
      temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
      seed=_SEED.value, num_samples=_NUM_SAMPLES.value, eos_id=_EOS.value,
      depth=_DEPTH.value, exit=_EXIT.value):
    print(json.dumps(row))


def _tasks(overrides, generating) -> None:
  from sharenet.errors import ConfigError
  from sharenet.inference import test_time_depth
  from sharenet.main import eval_workdir
  if _TASKS.value is None:
    raise ConfigError('--task_dir, --num_fewshot and --limit apply to --tasks; valid: with '
                      '--tasks NAMES')
  if generating:
    raise ConfigError('--tasks evaluates tasks and --prompt generates; valid: one of them')
  if _DEPTHS.value is not None and _DEPTH.value is not None:
    raise ConfigError('--depth and --depths exclude each other; valid: one of them')
  depths = (test_time_depth.parse_depths(_DEPTHS.value) if _DEPTHS.value is not None
            else [_DEPTH.value] if _DEPTH.value is not None else None)
  for row in eval_workdir.evaluate_workdir_tasks(
      _WORKDIR.value, _STEP.value, overrides, _TASKS.value, task_dir=_TASK_DIR.value,
      num_fewshot=_NUM_FEWSHOT.value, limit=_LIMIT.value, depths=depths, exit=_EXIT.value):
    print(json.dumps(row))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from sharenet.inference import test_time_depth
  from sharenet.main import eval_workdir
  overrides = config_flags.get_override_values(flags.FLAGS['config'])
  generating = _PROMPT.value is not None or _PROMPT_FILE.value is not None
  if _TASKS.value is not None or any(f.value is not None for f in (_TASK_DIR, _NUM_FEWSHOT,
                                                                    _LIMIT)):
    _tasks(overrides, generating)
    return
  depths = test_time_depth.check_flags(_DEPTHS.value, _DEPTH.value, _EXIT.value, generating)
  if generating:
    _generate(overrides)
    return
  if depths is not None:
    for row in eval_workdir.evaluate_workdir_depths(_WORKDIR.value, _STEP.value, overrides, depths):
      print(json.dumps(row))
    return
  from sharenet.main import eval_workdir
  out = eval_workdir.evaluate_workdir(_WORKDIR.value, _STEP.value, overrides)
  print(json.dumps(out))


if __name__ == '__main__':
  cli.run(main)
