"""Converts a run: python convert.py --workdir SRC --out DST --config.to=rmsnorm|crmsnorm|recursive|
head_shared|merge_lora_experts|fold_unified_norm|wider|mpo [--config.a.b=v]; the options and their
defaults: sharenet/config/defaults.py conversion_config.

DST gets config.json and a checkpoint (fresh optimizer state and data iterator) that eval.py
reads and train.py continues (--config configs/workdir.py:DST); the conversions are in
sharenet/transforms/ (convert.py: the norms; recursive.py, head_share.py, lora_merge.py;
widen.py: --config.to=wider --config.d_model=N, a trained model grown wider).
"""
from absl import flags, logging

from sharenet.config import cli, defaults

_WORKDIR = flags.DEFINE_string('workdir', None, 'Source train.py workdir.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Destination workdir.', required=True)
_CONFIG = cli.define_config_dict('config', defaults.conversion_config(),
                                        'Conversion options: --config.to=recursive ...')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from sharenet.main import convert_workdir
  out = convert_workdir.convert_workdir(_WORKDIR.value, _OUT.value, _CONFIG.value)
  print(f'sharenet: converted {_WORKDIR.value} (step {out["step"]}) -> {_OUT.value} '
        f'({_CONFIG.value.to})', flush=True)


if __name__ == '__main__':
  cli.run(main)
