"""The compute ladder (sharenet/studies/ladder.py) and the width split
(sharenet/studies/width_split.py): the fits restated on exact laws, the budget rule, a tiny
ladder end to end, and bad ladders as one line."""
import json
import os

import numpy as np
import pytest

from configs import ladder as ladder_config
from sharenet.errors import ConfigError
from sharenet.studies import common, ladder, width_split


def test_the_fit_recovers_an_exact_law_and_predicts_its_next_point():
  """Points of L = 1.7 + 30 x^-0.4: the fit returns E and alpha to 1e-4 and
  the held-out rung's prediction is the law's value there."""
  xs = [1e5, 3e5, 1e6, 3e6, 1e7]
  law = lambda x: 1.7 + 30.0 * x ** -0.4
  fit = ladder.fit_power(xs, [law(x) for x in xs])
  assert fit['E'] == pytest.approx(1.7, abs=1e-4) and fit['alpha'] == pytest.approx(0.4, abs=1e-4)
  rungs = [{'params_stored': x, 'params_applied': 2 * x, 'flops': 6 * x * 20 * x,
            'loss': law(x)} for x in xs]
  f = ladder.fits(rungs)
  assert abs(f['stored']['relative_error']) < 1e-5
  assert f['stored']['actual'] == law(xs[-1])
  # FLOPs = 120 x^2: the same law in x^2, alpha halves
  assert f['flops']['all']['alpha'] == pytest.approx(0.2, abs=1e-4)


def test_the_budget_grows_with_the_applied_parameters():
  """steps = ceil(tokens_per_param x applied params / tokens per step); a shared plan at the
  same width applies (and so trains on) the untied plan's parameters."""
  config = ladder_config.get_config()
  plans = ladder.plans(config.study)
  per_step = config.train.batch_size * config.train.seq_len
  for w in (64, 128):
    u = ladder.rung_config(config, plans['untied'], w, 48)
    c = ladder.rung_config(config, plans['cycle'], w, 48)
    su, sc = ladder.sizes_of(u), ladder.sizes_of(c)
    assert u.train.steps == int(np.ceil(2.0 * su['applied'] / per_step))
    assert sc['applied'] == su['applied'] and sc['stored'] < su['stored']
    assert c.train.steps == u.train.steps and u.parametrization.base_d_model == 48


def test_the_width_split_restates_an_additive_sweep():
  """A sweep L_n(lr) = c_n + (lr + 7)^2 is all width-stable (share 1, optimum -7, no offset);
  one whose optimum moves with width (L_n = (lr - a_n)^2) is not, and each width's offset from
  the stable optimum is its own optimum minus the stable one."""
  lrs = [-10.0, -9.0, -8.0, -7.0, -6.0, -5.0, -4.0]
  xs = [64, 128, 256]
  def sweep(loss):
    cells = {str(x): {'final_loss': [[loss(x, l)] * 2 for l in lrs],
                      'fit_log2_lr': lrs[int(np.argmin([loss(x, l) for l in lrs]))]}
             for x in xs}
    return {'log2_lrs': lrs, 'cells': cells}
  stable = width_split.split(sweep(lambda x, l: 3.0 - 0.1 * np.log2(x) + (l + 7) ** 2), xs)
  assert stable['stable_share'] == pytest.approx(1.0)
  assert stable['stable_optimum_log2_lr'] == pytest.approx(-7.0)
  assert [w['offset_log2'] for w in stable['widths']] == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)
  assert stable['level_fall'] == pytest.approx(0.2)
  a = {64: -6.0, 128: -7.0, 256: -8.0}
  moving = width_split.split(sweep(lambda x, l: (l - a[x]) ** 2), xs)
  assert moving['stable_share'] < 0.9
  L = np.asarray([[(l - a[x]) ** 2 for l in lrs] for x in xs])
  centred = L - L.mean(1, keepdims=True)
  rest = centred - centred.mean(0)
  assert moving['stable_share'] == pytest.approx(1 - (rest ** 2).sum() / (centred ** 2).sum())
  assert [w['offset_log2'] for w in moving['widths']] == pytest.approx(
      [a[x] - moving['stable_optimum_log2_lr'] for x in xs])


@pytest.mark.parametrize('overrides, match', [
    ({'study.widths': '64,64,128'}, 'the rungs must grow'),
    ({'study.widths': '64,128'}, 'number at least 3'),
    ({'study.widths': '48,64,66,96'}, 'not divisible by model.num_heads'),
    ({'study.plans': 'untied,nope'}, "study.plans names \\['nope'\\]"),
])
def test_bad_ladders_are_one_line(tmp_path, overrides, match):
  config = common.with_overrides(ladder_config.get_config(), overrides)
  with pytest.raises(ConfigError, match=match) as e:
    ladder.main(config, str(tmp_path / 'out'))
  assert '\n' not in str(e.value) and not (tmp_path / 'out').exists()


@pytest.mark.slow
def test_a_tiny_ladder_runs_fits_and_resumes(tmp_path):
  """Four rungs of one plan: a row per rung with its budget, the fits with the held-out
  prediction, the table regenerates from the JSON, and a rerun reads every cell back."""
  config = common.with_overrides(ladder_config.get_config(), {
      'study.plans': 'cycle', 'study.widths': '16,24,32,48', 'study.tokens_per_param': 0.2,
      'study.log2_lrs': '-8..-6', 'study.val_windows': 4, 'study.avg_last': 2,
      'model.num_layers': 2, 'train.seq_len': 32, 'train.batch_size': 4})
  out = str(tmp_path / 'ladder')
  result = ladder.main(config, out)
  rungs = result['plans']['cycle']['rungs']
  assert [r['width'] for r in rungs] == [16, 24, 32, 48]
  assert all(b['flops'] > a['flops'] and b['steps'] >= a['steps'] for a, b in zip(rungs, rungs[1:]))
  fit = result['plans']['cycle']['fits']['flops']
  assert fit['actual'] == rungs[-1]['loss'] and np.isfinite(fit['predicted'])
  saved = json.load(open(os.path.join(out, 'ladder.json')))
  assert open(os.path.join(out, 'ladder.md')).read() == ladder.to_markdown(saved)
  assert os.path.getsize(os.path.join(out, 'ladder_frontier.png')) > 0
  cells = os.path.join(out, 'cells')
  stamps = {n: os.path.getmtime(os.path.join(cells, n)) for n in os.listdir(cells)}
  ladder.main(config, out)
  assert stamps == {n: os.path.getmtime(os.path.join(cells, n)) for n in os.listdir(cells)}
