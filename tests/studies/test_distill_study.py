"""The distillation study (sharenet/studies/distill_study.py): a trained untied teacher, its
recursive conversions, each uptrained with cross entropy and with distillation."""
import json
import os

import pytest

from configs import distill_study as distill_study_config
from sharenet.errors import ConfigError
from sharenet.studies import common, distill_study

TINY = {'study.teacher_steps': 4, 'study.steps': 3, 'study.ranks': '2,32', 'study.seeds': '0,1',
        'study.eval_tokens': 2048, 'train.batch_size': 2, 'train.seq_len': 32,
        'model.d_model': 32, 'model.mlp_dim': 64, 'model.num_heads': 2}


@pytest.mark.slow
def test_the_study_uptrains_every_cell_once(tmp_path):
  """One row per rank x method x seed; at full rank (d_model) the conversion is the teacher;
  the kd students distil (their rows differ from the ce students'); seeds change the data
  order; the table regenerates from the JSON; a rerun trains nothing."""
  config = common.with_overrides(distill_study_config.get_config(), TINY)
  out = str(tmp_path / 'study')
  assert distill_study.main(config, out) == 0
  result = json.load(open(os.path.join(out, 'distill_study.json')))
  rows = {(r['rank'], r['method'], r['seed']): r['eval_loss'] for r in result['rows']}
  assert len(rows) == 2 * 2 * 2
  teacher = result['teacher']['eval_loss']
  assert result['converted']['32']['eval_loss'] == pytest.approx(teacher, abs=1e-4)
  assert abs(result['converted']['2']['eval_loss'] - teacher) > 1e-3
  assert rows[2, 'ce', 0] != rows[2, 'kd', 0] and rows[2, 'ce', 0] != rows[2, 'ce', 1]
  metrics = [json.loads(l) for l in open(os.path.join(out, 'runs', 'rank2-kd-seed0',
                                                      'metrics.jsonl'))]
  assert any('distill_kd' in m for m in metrics)
  assert not any('distill_kd' in m for m in map(json.loads, open(
      os.path.join(out, 'runs', 'rank2-ce-seed0', 'metrics.jsonl'))))
  table = open(os.path.join(out, 'distill_study.md')).read()
  assert table == distill_study.to_markdown(result) and table.count('\n| ') == 3
  before = os.path.getmtime(os.path.join(out, 'runs', 'rank2-kd-seed1', 'metrics.jsonl'))
  assert distill_study.main(config, out) == 0
  assert os.path.getmtime(os.path.join(out, 'runs', 'rank2-kd-seed1', 'metrics.jsonl')) == before


@pytest.mark.parametrize('overrides, match', [
    ({'study.ranks': '-1'}, r"study.ranks='-1'; valid: LoRA ranks >= 0"),
    ({'study.seeds': ''}, "study.seeds=''; valid"),
    ({'study.steps': 0}, 'study.steps=0; valid: >= 1'),
    ({'model.sharing.scheme': 'cycle'}, 'the teacher is the untied model'),
])
def test_bad_study_settings_are_one_line(tmp_path, overrides, match):
  config = common.with_overrides(distill_study_config.get_config(), overrides)
  with pytest.raises(ConfigError, match=match) as e:
    distill_study.main(config, str(tmp_path / 'out'))
  assert '\n' not in str(e.value) and not (tmp_path / 'out').exists()
