"""The sharing-methods study (sharenet/studies/sharing_methods_study.py): each variant fitted to
the cycle's stored parameters, rows with the one-loop evaluation of the looped ones, the table."""
import json
import os

import pytest

from configs import sharing_methods_study as study_config
from sharenet.errors import ConfigError
from sharenet.studies import common, sharing_methods_study as study

TINY = {'model.d_model': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'train.steps': 3,
        'train.batch_size': 4, 'train.seq_len': 32, 'train.warmup_steps': 1,
        'train.checkpoint_every': 3, 'train.eval_batch_size': 256, 'data.source': 'text'}


@pytest.fixture
def config(small_corpus):
  return common.with_overrides(study_config.get_config(),
                               {**TINY, 'data.path': small_corpus, 'study.seeds': '0'})


@pytest.mark.slow
def test_knobs_fit_the_cycle_budget(config):
  """untied stores 2 of the 4 layers (exactly the cycle's count); the bank lands within one
  column (and its mappings) of it, MASA at 2 atoms; CEM and MPO buy layers with it."""
  budget = study.stored(common.with_overrides(config, study.CYCLE))
  fitted = {v: study.variant_config(config, v, budget) for v in ('untied', 'bank', 'masa',
                                                                   'cem', 'mpo')}
  assert fitted['untied'].model.num_layers == 2 and study.stored(fitted['untied']) == budget
  bank = study.stored(fitted['bank'])
  assert abs(bank - budget) <= 32 + 7 and fitted['bank'].model.bank.size % 32 == 0
  assert fitted['masa'].model.masa.atoms == 2
  # CEM's tied layer stores 2 of a plain layer's 7 kernel-widths fewer: 3 layers for 2 sets;
  # MPO's full-bond centres hold one set of kernels, so the budget buys more than 4 layers
  assert fitted['cem'].model.num_layers == 3 and fitted['mpo'].model.num_layers > 4
  for v in ('cem', 'mpo'):   # the closest layer count: one more or one fewer is farther
    n = fitted[v].model.num_layers
    gap = abs(study.stored(fitted[v]) - budget)
    for other in (n - 1, n + 1):
      c = common.with_overrides(fitted[v], {'model.num_layers': other})
      assert abs(study.stored(c) - budget) >= gap


@pytest.mark.slow
def test_every_variant_runs_and_the_study_writes_rows_and_the_table(config, tmp_path):
  """Every variant trains (3 steps) and the looped ones are evaluated at one loop (a variant
  the table refuses at another depth once stopped the study there)."""
  out = str(tmp_path / 'study')
  assert study.main(config, out) == 0
  rows = {r['variant']: r for r in json.load(open(os.path.join(out,
                                                                'sharing_methods_study.json')))}
  assert list(rows) == list(study.VARIANTS)
  for v, r in rows.items():
    assert ('eval_loss_1_loop' in r) == (v in study.LOOPED), v
  table = open(os.path.join(out, 'sharing_methods_study.md')).read()
  assert table == study.to_markdown(list(rows.values()))
  assert os.path.exists(os.path.join(out, 'sharing_methods_study.png'))
  assert study.main(config, out) == 0   # a rerun finds every row and trains nothing


def test_an_unknown_variant_is_one_line(config, tmp_path):
  with pytest.raises(ConfigError, match=r"study.variants: 'loopy' is unknown; valid: untied") \
      as e:
    study.main(common.with_overrides(config, {'study.variants': 'loopy'}), str(tmp_path))
  assert '\n' not in str(e.value)
