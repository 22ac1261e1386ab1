"""Study driver (sharenet/studies/common.py): axes in order, annotation, plots and JSON."""
import json

import ml_collections
import pytest

from sharenet.errors import ConfigError
from sharenet.studies import common


def test_study_driver_runs_each_axis_then_writes_json_and_plots(tmp_path):
  """studies.common.run_axes (the driver of coord_check and lr_sweep): every configured axis in
  order, annotated, one plot per axis, and a JSON with the runtime and the config."""
  from configs import tiny
  c = tiny.get_config()
  c.study = ml_collections.ConfigDict({'axes': 'width,loops', 'width_values': '1,2',
                                       'loops_values': '1,2'})
  seen = []

  def run_axis(config, axis, log):
    seen.append(axis)
    return {'xs': [1, 2]}

  def plot(res, axis, path):
    open(path, 'w').write(axis)

  res = common.run_axes(c, str(tmp_path), 'demo', run_axis, plot,
                        annotate=lambda r: r.update(n=len(r['xs'])))
  assert seen == ['width', 'loops'] and res['width'] == {'xs': [1, 2], 'n': 2}
  saved = json.load(open(tmp_path / 'demo.json'))
  assert saved['loops']['n'] == 2 and saved['config']['study']['axes'] == 'width,loops'
  assert saved['runtime_s'] >= 0
  assert open(tmp_path / 'demo_width.png').read() == 'width'
  c.study.axes = 'width,bogus'
  with pytest.raises(ConfigError, match="unknown axis 'bogus'"):
    common.run_axes(c, str(tmp_path), 'demo', run_axis, plot)


def test_with_overrides_rejects_an_unknown_key_naming_the_nearest():
  from sharenet.config import defaults
  from sharenet.errors import ConfigError
  from sharenet.studies import common
  base = defaults.default_config()
  c = common.with_overrides(base, {'transforms.updates': 'agc', 'model.d_model': 64})
  assert c.transforms.updates == 'agc' and c.model.d_model == 64 and base.model.d_model == 256
  with pytest.raises(ConfigError, match="unknown config key 'transforms.update'; did you mean "
                     "'transforms.updates'"):
    common.with_overrides(base, {'transforms.update': 'agc'})
