"""Norm transfer (sharenet/studies/norm_transfer.py): the optima and their output norms."""
import math

import pytest

from configs import norm_transfer as nt_config
from sharenet.studies import common, norm_transfer


def _cell(w, d, b, lr, loss, norm):
  return {'width': w, 'tokens': d, 'batch': b, 'steps': d // (b * 64), 'log2_lr': lr,
          'val_loss': [loss], 'output_norm': [norm]}


def test_optima_take_the_least_loss_and_skip_diverged_cells_in_the_norm_range():
  cells = [_cell(32, 1024, 4, -12, 3.0, 10.0), _cell(32, 1024, 4, -11, 2.5, 20.0),
           _cell(32, 1024, 8, -11, 2.7, 15.0), _cell(32, 1024, 8, -10, math.nan, 900.0)]
  result = {'widths': [32], 'tokens': [1024], 'batches': [4, 8], 'log2_lrs': [-12, -11, -10],
            'seq_len': 64, 'optimizer': 'scion', 'parametrization': 'mup', 'seeds': 1,
            'cells': cells, 'runtime_s': 1.0}
  (best,) = norm_transfer.optima(result)
  assert (best['batch'], best['log2_lr'], best['norm']) == (4, -11, 20.0)
  assert (best['norm_min'], best['norm_max']) == (10.0, 20.0)
  table = norm_transfer.to_markdown(result)
  assert '| 32 | 1,024 | 4 | -11 | 2.500 | 20.0 | 10.0 - 20.0 |' in table
  assert 'over every cell: 2.00' in table


@pytest.mark.slow
def test_a_cell_row_trains_and_its_output_norm_grows_with_the_lr():
  """One width, data size and batch at 3 LRs (the real cells: the LR sweep's vmapped train
  step under Scion): each run trains tokens / (batch x seq_len) steps and the output norm after
  the last step grows with the LR (constrained Scion: the readout's step is lr x radius)."""
  c = common.with_overrides(nt_config.get_config(), {
      'study.widths': '32', 'study.tokens': '8192', 'study.batches': '4',
      'study.log2_lrs': '-13,-11,-9', 'study.val_windows': 4, 'train.progress': False})
  result = norm_transfer.run(c, log=lambda m: None)
  cells = result['cells']
  assert [x['steps'] for x in cells] == [32] * 3
  norms = [x['output_norm'][0] for x in cells]
  assert norms[0] < norms[1] < norms[2], norms
  assert all(math.isfinite(x['val_loss'][0]) for x in cells)
