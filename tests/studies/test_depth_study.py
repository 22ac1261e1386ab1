"""The depth study (sharenet/studies/depth_study.py): equal-FLOPs steps, rows, tables, plot."""
import json
import math
import os

import pytest

from configs import depth_study as depth_study_config
from sharenet.errors import ConfigError
from sharenet.studies import common, depth_study

TINY = {'model.d_model': 32, 'model.num_heads': 2, 'model.mlp_dim': 64,
        'train.batch_size': 4, 'train.seq_len': 32, 'train.warmup_steps': 1,
        'train.eval_batch_size': 64, 'data.eval_tokens': 2048, 'data.source': 'text',
        'study.base_steps': 2, 'study.depths': '1,3', 'study.prompts': 2,
        'study.prompt_len': 8, 'study.new_tokens': 4, 'study.decode_repeats': 1}


@pytest.fixture
def config(small_corpus):
  return common.with_overrides(depth_study_config.get_config(),
                               {**TINY, 'data.path': small_corpus, 'study.seeds': '0'})


@pytest.mark.slow
def test_sampled_depth_steps_spend_the_budget(config):
  """Each variant's steps spend the fixed-depth model's budget within half a step; a sampled
  depth with gradient through 2 of 3 mean loops costs less per token, so it takes more steps."""
  base = common.with_overrides(config, depth_study.overrides('recursive', config.study))
  per_token = depth_study.step_flops(base)(0)
  tokens = 4 * 32
  budget = 10 * per_token * tokens
  assert depth_study.steps_for(base, budget) == (10, per_token)
  for v in ('sampled', 'sampled_inject', 'mor_expert'):
    c = common.with_overrides(config, depth_study.overrides(v, config.study))
    steps, mean = depth_study.steps_for(c, budget)
    assert abs(steps * mean * tokens - budget) <= depth_study.step_flops(c)(steps) * tokens / 2
    assert mean < per_token and steps > 10, v


@pytest.mark.slow
def test_study_writes_rows_tables_and_plot(config, tmp_path):
  out = str(tmp_path / 'study')
  config = common.with_overrides(config, {'study.variants': 'recursive,mor_expert'})
  assert depth_study.main(config, out) == 0
  rows = {r['variant']: r for r in json.load(open(os.path.join(out, 'depth_study.json')))}
  assert list(rows) == ['recursive', 'mor_expert']
  budget = rows['recursive']['train_flops']
  for v, r in rows.items():
    assert abs(r['train_flops'] - budget) <= r['flops_per_token'] * 4 * 32, v
    assert math.isfinite(r['eval_loss']) and r['decode']['tokens_per_sec'] > 0, v
    assert r['decode']['tokens'] == 2 * 4
  depths = {d['depth']: d for d in rows['recursive']['depths']}
  assert sorted(depths) == [1, 3]
  # the trained depth (3) is the plan: the train loop's own final evaluation
  assert depths[3]['eval_loss'] == pytest.approx(rows['recursive']['eval_loss'], rel=1e-5)
  assert depths[1]['flops_per_token'] < depths[3]['flops_per_token']
  assert 'depths' not in rows['mor_expert']
  kv = {v: rows[v]['decode']['kv_bytes_per_token'] for v in rows}
  kv_first = rows['recursive']['decode_kv_first']['kv_bytes_per_token']
  # 5 cached layers; kv_sharing=first holds prelude + one loop + coda = 3; MoR fewer than 5
  assert kv['recursive'] == pytest.approx(kv_first * 5 / 3)
  assert kv['mor_expert'] < kv['recursive']
  table = open(os.path.join(out, 'depth_study.md')).read()
  assert '| recursive_kv_first |' in table and '| mor_expert |' in table
  assert 'trained only' in table   # MoR: its trained depth only
  assert os.path.getsize(os.path.join(out, 'depth_study.png')) > 0
  with pytest.raises(ConfigError, match="study.variants: 'mod' is unknown; valid: vanilla"):
    depth_study.main(common.with_overrides(config, {'study.variants': 'mod'}), out)


def test_study_mean_must_be_the_plans_loops(config, tmp_path):
  with pytest.raises(ConfigError, match=r'study.mean=4 must equal the plan\'s loops R=3'):
    depth_study.main(common.with_overrides(config, {'study.mean': 4}), str(tmp_path))
