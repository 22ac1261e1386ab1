"""A run's own recorded config: continue any workdir (a converted one too) exactly as it was.

Command:   python train.py --config configs/workdir.py:DIR --workdir DIR [--config.a.b=v]
           e.g. python train.py --config configs/workdir.py:runs/rms --workdir runs/rms \
                    --config.train.steps=300
Runtime:   that of the recorded config's remaining steps.
Result:    the run continues from DIR's newest checkpoint with DIR/config.json's settings (keys
           added to sharenet since it was written take their defaults); a conversion's DIR
           holds the converted model, so this is how a converted run is trained further.
"""
from sharenet.train import workdir_io


def get_config(workdir: str):
  return workdir_io.load_config(workdir)
