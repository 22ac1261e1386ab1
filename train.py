"""Trains a sharenet model: python train.py --config configs/NAME.py --workdir DIR [--config.a.b=v]."""
import json
import os

from absl import flags, logging

from sharenet.config import cli

_CONFIG = cli.define_config_file(
    'config', os.path.join(os.path.dirname(__file__), 'configs', 'default.py'),
    'Experiment config file.')
_WORKDIR = flags.DEFINE_string('workdir', 'runs/default', 'Where checkpoints and metrics go.')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from sharenet.train import loop
  out = loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  print(json.dumps({k: round(v, 4) for k, v in out.items()}))   # last line: JSON, for scripts


if __name__ == '__main__':
  cli.run(main)
