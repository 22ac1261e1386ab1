"""Evaluates a run: python eval.py --workdir DIR [--step N]; prints one JSON line."""
import json
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train.py workdir.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from sharenet import eval_cli
  from sharenet.errors import ConfigError
  try:
    out = eval_cli.evaluate_workdir(_WORKDIR.value, _STEP.value)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  print(json.dumps(out))


if __name__ == '__main__':
  app.run(main)
