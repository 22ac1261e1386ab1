"""The recursion study (sharenet/studies/recursion_study.py): equal-FLOPs steps, rows, table."""
import json
import os

import pytest

from configs import recursion_study as recursion_study_config
from sharenet.errors import ConfigError
from sharenet.studies import common, recursion_study

TINY = {'model.d_model': 32, 'model.num_layers': 5, 'model.num_heads': 2, 'model.mlp_dim': 64,
        'model.remat': 'none', 'train.batch_size': 4, 'train.seq_len': 32,
        'train.warmup_steps': 1, 'train.eval_batch_size': 256, 'study.base_steps': 4,
        'data.source': 'text'}


@pytest.fixture
def config(small_corpus):
  return common.with_overrides(recursion_study_config.get_config(),
                               {**TINY, 'data.path': small_corpus, 'study.seeds': '0'})


@pytest.mark.slow
def test_every_variant_trains_at_the_vanilla_flops_budget(config, tmp_path):
  out = str(tmp_path / 'study')
  assert recursion_study.main(config, out) == 0
  rows = {r['variant']: r for r in json.load(open(os.path.join(out, 'recursion_study.json')))}
  assert list(rows) == list(recursion_study.VARIANTS)
  budget = rows['vanilla']['train_flops']
  assert rows['vanilla']['steps'] == 4
  for v, r in rows.items():
    # steps = round(budget / FLOPs per step): within half a step of the budget
    per_step = r['flops_per_token'] * 4 * 32
    assert abs(r['train_flops'] - budget) <= per_step / 2, v
    assert r['eval_bits_per_byte'] > 0 and r['params_stack'] < r['params_unique']
  # MoR expert choice spends fewer FLOPs per token than the plain recursive model: more steps
  assert rows['mor_expert']['flops_per_token'] < rows['recursive']['flops_per_token']
  assert rows['mor_expert']['steps'] > rows['recursive']['steps']
  # sharing stores less: recursive (middle_cycle R=3, 1 + 1 + 1 of 5 layers), MASA, Q-K=V
  for v in ('recursive', 'masa', 'kv_shared'):
    assert rows[v]['params_stack'] < rows['vanilla']['params_stack'], v
  table = open(os.path.join(out, 'recursion_study.md')).read()
  assert '| mor_expert | MoR expert choice |' in table
  assert os.path.exists(os.path.join(out, 'recursion_study.png'))
  with pytest.raises(ConfigError, match="study.variants: 'mod' is unknown; valid: vanilla"):
    recursion_study.main(common.with_overrides(config, {'study.variants': 'mod'}), out)


def test_rows_of_a_renamed_variant_count_as_the_new_one():
  """Rows an older study wrote as qk_v (model.attention_sharing's old value) are kv_shared's."""
  row = {'variant': 'qk_v', 'seed': 0, 'what': 'Q-K=V projections', 'params_unique': 10,
         'params_stack': 8, 'flops_per_token': 1e6, 'steps': 3, 'eval_bits_per_byte': 2.0,
         'tokens_per_sec': None}
  assert recursion_study._key(row) == ('kv_shared', 0)
  assert '| kv_shared | Q-K=V projections |' in recursion_study.to_markdown([row])
