"""Evaluates a run: python eval.py --workdir DIR [--step N] [--config.a.b=v]; prints JSON lines.

One line with eval_loss and eval_bits_per_byte; `--config.a.b=v` overrides the workdir's config
for this evaluation. --prompt TEXT / --prompt_file FILE generates (one line per sample;
docs/generation.md); --depths 1,2,4 evaluates at other loop counts of a looped model, --depth N
at one, --exit R exits generated tokens early (docs/generation.md); --tasks A,B runs
lm-evaluation-harness tasks (docs/evaluation.md); --ema evaluates the weights' moving average
(train.ema). The modes and their flags are
sharenet/main/eval_workdir.py `run_cli`.
"""
import json

from absl import flags, logging
from ml_collections import config_flags

from sharenet.config import cli, defaults

flags.DEFINE_string('workdir', None, 'A train.py workdir.', required=True)
flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
cli.define_config_dict('config', defaults.default_config(),
                       'Overrides of the workdir config: --config.a.b=v.')
flags.DEFINE_string('prompt', None, 'Generate a continuation of this text.')
flags.DEFINE_string('prompt_file', None, 'Generate for every line of this file (one batch).')
flags.DEFINE_integer('max_new_tokens', 200, 'Tokens (bytes) to generate.')
flags.DEFINE_float('temperature', 1.0, 'Sampling temperature; 0: greedy.')
flags.DEFINE_integer('top_k', 0, 'Sample from the k most likely tokens; 0: all.')
flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass; 1: off.')
flags.DEFINE_integer('seed', 0, 'Sampling seed.')
flags.DEFINE_integer('num_samples', 1, 'Samples per prompt.')
flags.DEFINE_string('depths', None, 'Evaluate at these loop counts of the looped segment, e.g. '
                    '1,2,4,8 (test-time depth).')
flags.DEFINE_integer('depth', None, 'Loops of the looped segment for generation (or one '
                     'evaluation); with --exit the most loops a token runs.')
flags.DEFINE_string('exit', None, 'Adaptive exit of generated tokens: maxprob:T, entropy:T, '
                    'entropy_change:T, kl:T, argmax_stable:K, latent:T or cosine:T '
                    '(docs/generation.md).')
flags.DEFINE_string('tasks', None, 'lm-evaluation-harness tasks, e.g. hellaswag,piqa '
                    '(docs/evaluation.md): one JSON line per task (and per --depths).')
flags.DEFINE_string('task_dir', None, 'Also the harness task definitions (YAML) under this '
                    'directory.')
flags.DEFINE_integer('num_fewshot', None, 'Shots per task item; default: each task\'s own.')
flags.DEFINE_integer('limit', None, 'Only the first N items of each task.')
flags.DEFINE_integer('eos_id', None, 'Stop a sample at this token id; default: none for byte '
                     'models, the end-of-document id for arrayrecord shards.')
flags.DEFINE_bool('ema', False, 'Evaluate the weights\' moving average (a run with train.ema).')
OPTIONS = ('ema', 'step', 'prompt', 'prompt_file', 'max_new_tokens', 'temperature', 'top_k', 'top_p',
           'seed', 'num_samples', 'depths', 'depth', 'exit', 'tasks', 'task_dir', 'num_fewshot',
           'limit', 'eos_id')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from sharenet.main import eval_workdir
  overrides = config_flags.get_override_values(flags.FLAGS['config'])
  for row in eval_workdir.run_cli(flags.FLAGS.workdir, overrides,
                                  **{n: flags.FLAGS[n].value for n in OPTIONS}):
    print(json.dumps(row))


if __name__ == '__main__':
  cli.run(main)
