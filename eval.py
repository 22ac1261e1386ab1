"""Evaluates a run: python eval.py --workdir DIR [--step N] [--config.a.b=v]; prints one JSON line.

`--config.a.b=v` overrides the workdir's config for this evaluation (e.g.
--config.train.eval_batch_size=64 or --config.data.path=...); any key of the default config.

With --prompt TEXT (or --prompt_file FILE, one prompt per line) it generates instead
(sharenet/generate.py, README "Generation"): one JSON line per prompt and sample, with the
continuation as `text` (bytes that are not valid UTF-8 escaped as \\xNN) and `tokens_per_sec`:
  python eval.py --workdir DIR --prompt "def fib(" --max_new_tokens 200 \\
      [--temperature 0.8 --top_k 40 --top_p 0.95 --seed 0 --num_samples 4]
"""
import json

from absl import flags, logging
from ml_collections import config_flags

from sharenet import config_lib, defaults
from sharenet.errors import ConfigError

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train.py workdir.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_CONFIG = config_lib.define_config_dict(
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
_EOS = flags.DEFINE_integer('eos_id', None, 'Stop a sample at this token id; default: none for '
                            'byte models, the end-of-document id for arrayrecord shards.')


def _prompts() -> list[str]:
  if _PROMPT.value is not None and _PROMPT_FILE.value is not None:
    raise ConfigError('--prompt and --prompt_file are exclusive; pass one')
  if _PROMPT_FILE.value is not None:
    try:
      with open(_PROMPT_FILE.value, encoding='utf-8') as f:
        prompts = [line.rstrip('\r\n') for line in f]
    except OSError as e:
      raise ConfigError(f'--prompt_file {_PROMPT_FILE.value}: {e.strerror}') from None
    if not prompts:
      raise ConfigError(f'--prompt_file {_PROMPT_FILE.value} holds no prompt')
  else:
    prompts = [_PROMPT.value]
  for i, p in enumerate(prompts):
    if not p:
      where = f' (line {i + 1} of --prompt_file)' if _PROMPT_FILE.value is not None else ''
      raise ConfigError(f'empty prompt{where}; valid: at least one character')
  return prompts


def _generate(overrides) -> None:
  import jax
  from sharenet import generate, workdir_lib
  from sharenet.data import tokenizer as tokenizer_lib
  prompts = _prompts()
  if _NUM_SAMPLES.value < 1:
    raise ConfigError(f'--num_samples={_NUM_SAMPLES.value} must be >= 1')
  if _TEMPERATURE.value < 0:
    raise ConfigError(f'--temperature={_TEMPERATURE.value} must be >= 0 (0: greedy)')
  loaded = workdir_lib.load_for_generation(_WORKDIR.value, _STEP.value, overrides)
  tok = loaded.tokenizer
  byte_level = isinstance(tok, tokenizer_lib.ByteTokenizer)
  encode = generate.encode if byte_level else (lambda p: [int(t) for t in tok.encode(p)])
  decode = generate.decode if byte_level else tok.decode
  # Shards end every document with the end-of-document id: a sample stops there by default.
  eos = _EOS.value if _EOS.value is not None or byte_level else tok.eod_id
  batch = [encode(p) for p in prompts for _ in range(_NUM_SAMPLES.value)]
  out = generate.generate(loaded.model, loaded.variables, batch, _MAX_NEW.value,
                          temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                          top_p=_TOP_P.value, rng=jax.random.key(_SEED.value),
                          eos_id=eos)
  for i, tokens in enumerate(out.tokens):
    print(json.dumps({'prompt': prompts[i // _NUM_SAMPLES.value],
                      'sample': i % _NUM_SAMPLES.value, 'text': decode(tokens),
                      'num_tokens': len(tokens), 'step': loaded.step,
                      'tokens_per_sec': round(out.tokens_per_sec, 1),
                      'compile_sec': round(out.compile_seconds, 2)}))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  overrides = config_flags.get_override_values(flags.FLAGS['config'])
  if _PROMPT.value is not None or _PROMPT_FILE.value is not None:
    _generate(overrides)
    return
  from sharenet import workdir_lib
  out = workdir_lib.evaluate_workdir(_WORKDIR.value, _STEP.value, overrides)
  print(json.dumps(out))


if __name__ == '__main__':
  config_lib.run(main)
