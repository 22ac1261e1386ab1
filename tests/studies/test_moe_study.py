"""The experts study (sharenet/studies/moe_study.py): parameter fit, equal-FLOPs steps, rows,
table and plot."""
import json
import math
import os

import pytest

from configs import moe_study as moe_study_config
from sharenet.errors import ConfigError
from sharenet.studies import common, moe_study

TINY = {'model.d_model': 16, 'model.num_heads': 2, 'model.mlp_dim': 32, 'model.num_layers': 4,
        'train.batch_size': 2, 'train.seq_len': 16, 'train.warmup_steps': 1,
        'train.eval_batch_size': 16, 'data.eval_tokens': 512, 'data.source': 'text',
        'study.base_steps': 2, 'study.expert_dim': 8, 'study.top_k': 2}


@pytest.fixture
def config(small_corpus):
  return common.with_overrides(moe_study_config.get_config(),
                               {**TINY, 'data.path': small_corpus, 'study.seeds': '0'})


@pytest.mark.slow
def test_fit_matches_untied_params_and_flops_budget(config):
  """The G=2 models are fitted to the untied model's stored params within half a unit of
  their fitted key; every run's steps spend the untied budget within half a step."""
  runs = moe_study.plan(config, ['untied', 'dense_universal', 'moeut', 'moeut_ffn'])
  target = runs[0]['params_target']
  assert target == moe_study.stored_params(config)   # the base config is the untied model
  tokens = 2 * 16
  for r in runs:
    if r['variant'] in moe_study.FIT:   # a unit of the key: the fit's own two (cached) points
      key = moe_study.FIT[r['variant']]
      start = {'dense_universal': 32, 'moeut': 2, 'moeut_ffn': 2}[r['variant']]
      at = lambda n: moe_study.stored_params(common.with_overrides(r['config'], {key: n}))
      assert abs(r['params_unique'] - target) <= (at(start + 1) - at(start)) / 2, r['variant']
    if 'flops' in r['comparisons']:
      spent = r['steps'] * r['flops_per_token'] * tokens
      assert abs(spent - r['budget']) <= r['flops_per_token'] * tokens / 2, r['variant']
    if 'params' in r['comparisons']:
      assert r['steps'] == 2
  by = {(r['variant'], tuple(r['comparisons'])): r for r in runs}
  assert ('untied', ('params', 'flops')) in by   # its steps are the budget: one run, both
  # the widened dense G=2 model costs more per token, the MoE ones less
  assert by['dense_universal', ('flops',)]['steps'] < 2 <= by['moeut_ffn', ('flops',)]['steps']
  assert by['moeut_ffn', ('flops',)]['flops_per_token'] < runs[0]['flops_per_token']
  # the whole MoEUT layer: SwitchHead's experts and selectors join the fitted stack
  (full,) = [r for r in runs if r['variant'] == 'moeut']
  assert full['config'].model.moe.attention == 'switchhead'
  assert full['config'].model.norm.placement == 'moeut'
  assert full['fitted']['model.moe.num_experts'] < \
      by['moeut_ffn', ('flops',)]['fitted']['model.moe.num_experts']


@pytest.mark.slow
def test_study_writes_rows_table_and_plot(config, tmp_path):
  out = str(tmp_path / 'study')
  config = common.with_overrides(config, {'study.variants': 'moeut_ffn', 'study.base_steps': 3})
  assert moe_study.main(config, out) == 0
  rows = json.load(open(os.path.join(out, 'results.json')))
  assert [(r['variant'], r['steps'], r['comparisons']) for r in rows] == [
      ('moeut_ffn', 3, ['params']), ('moeut_ffn', 4, ['flops'])]
  for r in rows:
    assert math.isfinite(r['eval_loss']), r
    if 'flops' in r['comparisons']:
      assert abs(r['train_flops'] - r['budget_flops']) <= r['flops_per_token'] * 2 * 16 / 2
    summary = json.load(open(os.path.join(out, 'runs', f"{r['variant']}-{r['steps']}steps-seed0",
                                          'config.json')))
    assert summary['params_unique'] == r['params_unique']
    assert summary['flops_per_token'] == pytest.approx(r['flops_per_token'])
  table = open(os.path.join(out, 'table.md')).read()
  assert table.count('| moeut_ffn |') == 2 and 'Equal training FLOPs' in table
  assert os.path.getsize(os.path.join(out, 'plot.png')) > 0
  with pytest.raises(ConfigError, match="study.variants: 'dense' is unknown; valid: untied"):
    moe_study.main(common.with_overrides(config, {'study.variants': 'dense'}), out)
