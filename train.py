"""Trains a sharenet model: python train.py --config configs/NAME.py --workdir DIR [--config.a.b=v]."""
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    'config', os.path.join(os.path.dirname(__file__), 'configs', 'default.py'),
    'Experiment config file.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', 'runs/default', 'Where checkpoints and metrics go.')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from sharenet import train_lib
  from sharenet.errors import ConfigError
  try:
    out = train_lib.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, train_lib.NonFiniteLoss) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  print({k: round(v, 4) for k, v in out.items()})


if __name__ == '__main__':
  app.run(main)
