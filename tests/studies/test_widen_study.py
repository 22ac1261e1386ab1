"""The growth study (sharenet/studies/widen_study.py): a trained source grown wider, then
trained on, against the same wider model from scratch and the source trained on."""
import json
import os

import pytest

from configs import widen_study as widen_study_config
from sharenet.errors import ConfigError
from sharenet.studies import common, widen_study

TINY = {'study.source_steps': 4, 'study.steps': 3, 'study.widths': '64,48', 'study.seeds': '0',
        'study.eval_tokens': 2048, 'train.batch_size': 2, 'train.seq_len': 32,
        'model.d_model': 32, 'model.mlp_dim': 64, 'model.num_heads': 2,
        'parametrization.base_d_model': 32}


@pytest.mark.slow
def test_the_study_grows_trains_and_resumes(tmp_path):
  """At twice the width the grown model's eval loss is the source's (every unit copied); at
  1.5x it moves; one row per width x method x seed plus the continued source; the table
  regenerates from the JSON; a rerun trains nothing."""
  config = common.with_overrides(widen_study_config.get_config(), TINY)
  out = str(tmp_path / 'study')
  assert widen_study.main(config, out) == 0
  result = json.load(open(os.path.join(out, 'widen_study.json')))
  source = result['source']['eval_loss']
  assert result['grown']['64']['eval_loss'] == pytest.approx(source, abs=1e-5)
  assert result['grown']['64']['zero_shot']['max_abs_logit_diff'] < 1e-4
  assert abs(result['grown']['48']['eval_loss'] - source) > 1e-4
  assert len(result['rows']) == 2 * 2 and len(result['continued']) == 1
  grown = [r['eval_loss'] for r in result['rows'] if r['method'] == 'grown']
  assert all(g != source for g in grown)   # trained on
  table = open(os.path.join(out, 'widen_study.md')).read()
  assert table == widen_study.to_markdown(result) and table.count('\n| ') == 3
  before = os.path.getmtime(os.path.join(out, 'runs', 'd48-scratch-seed0', 'metrics.jsonl'))
  assert widen_study.main(config, out) == 0
  assert os.path.getmtime(os.path.join(out, 'runs', 'd48-scratch-seed0', 'metrics.jsonl')) == before


@pytest.mark.parametrize('overrides, match', [
    ({'study.widths': '64,32'}, 'each must be wider than model.d_model=64'),
    ({'study.seeds': ''}, "study.seeds=''; valid"),
    ({'study.steps': 0}, 'study.steps=0'),
])
def test_bad_study_settings_are_one_line(tmp_path, overrides, match):
  config = common.with_overrides(widen_study_config.get_config(), overrides)
  with pytest.raises(ConfigError, match=match) as e:
    widen_study.main(config, str(tmp_path / 'out'))
  assert '\n' not in str(e.value) and not (tmp_path / 'out').exists()
