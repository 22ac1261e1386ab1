"""The rank study (sharenet/studies/rank_study.py): a recursive conversion of a trained untied
model at depth-wise LoRA ranks, evaluated without uptraining."""
import json
import os

import pytest

from configs import rank_study as rank_study_config
from sharenet.train import loop
from sharenet.errors import ConfigError
from sharenet.studies import common, rank_study


@pytest.fixture(scope='module')
def source(tmp_path_factory):
  """A tiny untied run of 4 layers, 3 steps (d_model 32: rank 32 keeps every residual)."""
  import conftest
  workdir = str(tmp_path_factory.mktemp('rank') / 'src')
  loop.train_and_evaluate(conftest.make_tiny_config(**{
      'model.num_layers': 4, 'train.steps': 3, 'train.checkpoint_every': 3}), workdir)
  return workdir


@pytest.mark.slow
def test_full_rank_is_the_source_and_rank_zero_is_not(source, tmp_path):
  """At full rank (d_model) the converted model's eval loss is the source's; at rank 0 (the
  plain recursive model) it differs; each LoRA rank adds stored parameters; the json, table and
  plot are written, and a rerun converts nothing."""
  config = common.with_overrides(rank_study_config.get_config(), {
      'study.source': source, 'study.ranks': '0,4,32', 'study.eval_tokens': 2048})
  out = str(tmp_path / 'study')
  assert rank_study.main(config, out) == 0
  result = json.load(open(os.path.join(out, 'rank_study.json')))
  src, rows = result['source'], {r['rank']: r for r in result['rows']}
  assert rows[32]['eval_loss'] == pytest.approx(src['eval_loss'], abs=1e-4)
  assert abs(rows[0]['eval_loss'] - src['eval_loss']) > 1e-3
  assert rows[0]['params_unique'] < rows[4]['params_unique'] < rows[32]['params_unique']
  assert rows[0]['params_unique'] < src['params_unique']
  table = open(os.path.join(out, 'rank_study.md')).read()
  assert table.count('\n| ') == 5 and os.path.getsize(os.path.join(out, 'rank_study.png')) > 0
  before = os.path.getmtime(os.path.join(out, 'runs', 'rank4', 'config.json'))
  assert rank_study.main(config, out) == 0
  assert os.path.getmtime(os.path.join(out, 'runs', 'rank4', 'config.json')) == before


def test_bad_source_or_rank_is_one_line(tmp_path):
  config = common.with_overrides(rank_study_config.get_config(),
                                 {'study.source': str(tmp_path)})
  with pytest.raises(ConfigError, match='is not a workdir') as e:
    rank_study.main(config, str(tmp_path / 'out'))
  assert '\n' not in str(e.value)
