"""Evaluates a run: python eval.py --workdir DIR [--step N] [--config.a.b=v]; prints one JSON line.

`--config.a.b=v` overrides the workdir's config for this evaluation (e.g.
--config.train.eval_batch_size=64 or --config.data.path=...); any key of the default config.
"""
import json

from absl import flags, logging
from ml_collections import config_flags

from sharenet import config_lib, defaults

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train.py workdir.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_CONFIG = config_lib.define_config_dict(
    'config', defaults.default_config(), 'Overrides of the workdir config: --config.a.b=v.')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from sharenet import workdir_lib
  overrides = config_flags.get_override_values(flags.FLAGS['config'])
  out = workdir_lib.evaluate_workdir(_WORKDIR.value, _STEP.value, overrides)
  print(json.dumps(out))


if __name__ == '__main__':
  config_lib.run(main)
