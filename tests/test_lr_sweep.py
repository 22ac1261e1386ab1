"""LR sweep (sharenet/studies/lr_sweep.py): optimum fit, and cells equal to train-loop runs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet import config_lib, train_lib
from sharenet.studies import common, lr_sweep


def sweep_config(overrides, steps=4):
  """A small transfer config whose schedule spans `steps` (what run_axis sets)."""
  from configs.mup import transfer
  c = transfer.get_config()
  c.model.num_layers, c.train.batch_size, c.train.seq_len = 1, 4, 16
  return common.with_overrides(c, {'model.d_model': 64, 'model.mlp_dim': 128,
                                   'train.steps': steps, 'train.warmup_steps': 2,
                                   'train.progress': False, **overrides})


def test_lr_sweep_optimum_is_quadratic_vertex():
  grid = [-9.0, -8.0, -7.0, -6.0, -5.0]
  losses = np.asarray([[(g + 6.7) ** 2 + 2.0] * 2 for g in grid])
  opt = lr_sweep.optimum(grid, losses)
  assert opt['fit_log2_lr'] == pytest.approx(-6.7) and not opt['at_edge']
  losses[0] = np.nan                             # a diverged cell is never the optimum
  assert lr_sweep.optimum(grid, losses)['grid_argmin_log2_lr'] == -7.0


@pytest.mark.slow
def test_lr_sweep_vmapped_cells_match_the_train_step_in_python():
  """Cell (lr, seed 1) of a muP model with a reparam is the loop's step driven in Python at
  train.lr = lr from init seed train.seed + 1 on the same batches."""
  c = sweep_config({'parametrization.kind': 'mup', 'parametrization.base_d_model': 32,
                    'transforms.reparam': 'weight_norm', 'train.seed': 3})
  toks = lr_sweep.batches(c, c.train.steps)
  lrs = [2.0 ** -8, 2.0 ** -6]
  final, val = lr_sweep.train_cells(c, lrs, 2, toks, lr_sweep.val_batch(c, 2), avg_last=1)
  ref = common.with_overrides(c, {'train.lr': lrs[1]})
  exp = train_lib.setup(ref, config_lib.validate(ref))
  state = train_lib.init_state(exp.model, exp.tx, jax.random.key(4), tr=exp.tr, pz=exp.pz)
  assert 'reparam' in state.params
  step = jax.jit(train_lib.make_train_step(exp))
  for b in toks:
    state, metrics = step(state, jnp.asarray(b))
  assert final[1, 1] == pytest.approx(float(metrics['loss']), rel=1e-5)
  assert abs(final[0, 1] - final[1, 1]) > 1e-3 and abs(final[1, 0] - final[1, 1]) > 1e-4
  assert np.all(np.isfinite(val))


@pytest.mark.slow
def test_lr_sweep_cell_with_transforms_equals_a_train_run(tmp_path):
  """Transforms (sigma-reparam with its power-iteration state, AGC) and grad_accum=2 inside a
  sweep: cell (lr, seed 0) ends at the loss train_lib.train_and_evaluate logs at train.lr=lr."""
  c = sweep_config({'transforms.reparam': 'sigma_reparam', 'transforms.updates': 'agc',
                    'train.grad_accum': 2, 'train.weight_decay': 0.1})
  toks = lr_sweep.batches(c, c.train.steps)
  lrs = [2.0 ** -9, 2.0 ** -6]
  final, _ = lr_sweep.train_cells(c, lrs, 1, toks, lr_sweep.val_batch(c, 2), avg_last=1)
  ref = common.with_overrides(c, {'train.lr': lrs[1], 'train.checkpoint_every': 100})
  out = train_lib.train_and_evaluate(ref, str(tmp_path))
  assert final[1, 0] == pytest.approx(out['loss'], rel=1e-5)
  assert abs(final[0, 0] - final[1, 0]) > 1e-3


def test_cells_resume_and_recompute_when_their_inputs_change(tmp_path, monkeypatch):
  """An interrupted sweep resumes: a rerun reads each (variant, x) row kept under OUT/cells
  instead of training it, and trains again a cell whose config changed (here its steps)."""
  calls = []

  def fake_train_cells(c, lrs, seeds, tokens, val, avg_last):
    calls.append((c.model.d_model, c.train.steps))
    loss = np.asarray([[(np.log2(lr) + 6.0) ** 2 + c.model.d_model / 1000] * seeds
                       for lr in lrs])
    return loss, loss + 0.1
  monkeypatch.setattr(lr_sweep, 'train_cells', fake_train_cells)
  monkeypatch.setattr(lr_sweep, 'batches', lambda config, steps: None)
  monkeypatch.setattr(lr_sweep, 'val_batch', lambda config, n: None)
  c = common.with_overrides(sweep_config({}), {'study.width_values': '32,64',
                                               'study.log2_lrs': '-8..-4', 'study.seeds': 1})
  cells = str(tmp_path / 'cells')
  first = lr_sweep.run_axis(c, 'width', log=lambda m: None, cells_dir=cells)
  n = len(calls)
  assert n == 2 * len(common.parse_list(c.study.width_variants, str))
  again = lr_sweep.run_axis(c, 'width', log=lambda m: None, cells_dir=cells)
  assert len(calls) == n and again == first                    # every cell read back
  longer = common.with_overrides(c, {'study.steps': c.study.steps + 1})
  lr_sweep.run_axis(longer, 'width', log=lambda m: None, cells_dir=cells)
  assert len(calls) == 2 * n                                   # every cell trained again
  lr_sweep.run_axis(c, 'width', log=lambda m: None)             # no cells_dir: always trains
  assert len(calls) == 3 * n
