"""LR sweep (sharenet/studies/lr_sweep.py): optimum fit, and cells equal to train-loop runs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet import errors
from sharenet.train import experiment, loop, trainer
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
  exp = trainer.setup(ref, experiment.validate(ref))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(4), tr=exp.tr, pz=exp.pz)
  assert 'reparam' in state.params
  step = jax.jit(trainer.make_train_step(exp))
  for b in toks:
    state, metrics = step(state, jnp.asarray(b))
  assert final[1, 1] == pytest.approx(float(metrics['loss']), rel=1e-5)
  assert abs(final[0, 1] - final[1, 1]) > 1e-3 and abs(final[1, 0] - final[1, 1]) > 1e-4
  assert np.all(np.isfinite(val))


@pytest.mark.slow
def test_lr_sweep_cell_with_transforms_equals_a_train_run(tmp_path):
  """Transforms (sigma-reparam with its power-iteration state, AGC) and grad_accum=2 inside a
  sweep: cell (lr, seed 0) ends at the loss loop.train_and_evaluate logs at train.lr=lr."""
  c = sweep_config({'transforms.reparam': 'sigma_reparam', 'transforms.updates': 'agc',
                    'train.grad_accum': 2, 'train.weight_decay': 0.1})
  toks = lr_sweep.batches(c, c.train.steps)
  lrs = [2.0 ** -9, 2.0 ** -6]
  final, _ = lr_sweep.train_cells(c, lrs, 1, toks, lr_sweep.val_batch(c, 2), avg_last=1)
  ref = common.with_overrides(c, {'train.lr': lrs[1], 'train.checkpoint_every': 100})
  out = loop.train_and_evaluate(ref, str(tmp_path))
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
  # one more width (same base, 32) trains only its own cells: the others (longer's) are shared
  wider = common.with_overrides(longer, {'study.width_values': '32,64,128'})
  lr_sweep.run_axis(wider, 'width', log=lambda m: None, cells_dir=cells)
  assert len(calls) == 3 * n + n // 2 and {d for d, _ in calls[3 * n:]} == {128}


def test_a_cell_written_with_the_whole_config_is_read_back_and_rewritten(tmp_path, monkeypatch):
  """Cells written before the study's selection keys left the fingerprint (the whole config
  fingerprinted) are read back, then rewritten under the current fingerprint."""
  import json
  monkeypatch.setattr(lr_sweep, 'batches', lambda config, steps: None)
  monkeypatch.setattr(lr_sweep, 'val_batch', lambda config, n: None)
  monkeypatch.setattr(lr_sweep, 'train_cells', lambda *a: pytest.fail('trained a kept cell'))
  c = common.with_overrides(sweep_config({}), {'study.width_values': '32',
                                               'study.width_variants': 'sp',
                                               'study.log2_lrs': '-8..-6', 'study.seeds': 1})
  cell_c = common.with_overrides(c, {**common.point_overrides('width', 32, c.study),
                                     'parametrization.kind': 'sp',
                                     'parametrization.base_d_model': 32,
                                     'train.steps': c.study.steps})
  legacy = {'config': experiment.to_json(cell_c), 'log2_lrs': [-8.0, -7.0, -6.0]}
  row = {**lr_sweep.optimum([-8.0, -7.0, -6.0], np.asarray([[3.0], [2.0], [3.0]])),
         'final_loss': [[3.0], [2.0], [3.0]], 'val_loss': [[3.0], [2.0], [3.0]], 'seconds': 1}
  cells = tmp_path / 'cells'
  cells.mkdir()
  path = cells / 'width-sp-32.json'
  path.write_text(json.dumps({'fingerprint': common._fingerprint(legacy), 'row': row}))
  out = lr_sweep.run_axis(c, 'width', log=lambda m: None, cells_dir=str(cells))
  assert out['variants']['sp']['cells']['32'] == row
  assert json.loads(path.read_text())['fingerprint'] != common._fingerprint(legacy)
  assert lr_sweep.run_axis(c, 'width', log=lambda m: None, cells_dir=str(cells)) == out


def test_beyond_width_axes_set_their_key_and_read_their_own_batches(monkeypatch):
  """batch / steps / weight_decay / warmup (configs/mup/transfer_beyond.py): each point changes
  only its train key, at d_model = fixed_width with muP's base at base_width; a batch or steps
  point trains on that many sequences and steps of the loop's stream; wd_scale multiplies the
  weight_decay point and is refused on another axis."""
  from configs.mup import transfer_beyond
  seen = []

  def fake_train_cells(c, lrs, seeds, tokens, val, avg_last):
    seen.append((c.train.batch_size, c.train.steps, c.train.weight_decay, c.train.warmup_steps,
                 c.parametrization.wd_mode, tokens.shape[:2], c.model.d_model,
                 c.parametrization.base_d_model))
    loss = np.asarray([[(np.log2(lr) + 7.0) ** 2] * seeds for lr in lrs])
    return loss, loss
  monkeypatch.setattr(lr_sweep, 'train_cells', fake_train_cells)
  monkeypatch.setattr(lr_sweep, 'val_batch', lambda config, n: None)
  c = common.with_overrides(transfer_beyond.get_config(), {
      'study.steps': 6, 'study.fixed_width': 32, 'study.base_width': 16,
      'study.batch_values': '2,4', 'study.steps_values': '3,5', 'study.warmup_values': '0,2',
      'study.weight_decay_values': '0,0.5', 'study.batch_variants': 'mup',
      'study.steps_variants': 'mup', 'study.warmup_variants': 'sp',
      'study.weight_decay_variants': 'mup,mup:wd_mode=independent:wd_scale=0.25'})
  d = (32, 16)
  b0, wd0, w0 = c.train.batch_size, c.train.weight_decay, c.train.warmup_steps
  res = lr_sweep.run_axis(c, 'batch', log=lambda m: None)
  assert seen == [(b, 6, wd0, w0, 'auto', (6, b), *d) for b in (2, 4)]
  assert res['variants']['mup']['optimum_slope_log2_per_doubling'] == pytest.approx(0.0, abs=1e-9)
  seen.clear()
  lr_sweep.run_axis(c, 'steps', log=lambda m: None)
  assert seen == [(b0, s, wd0, w0, 'auto', (s, b0), *d) for s in (3, 5)]
  seen.clear()
  lr_sweep.run_axis(c, 'warmup', log=lambda m: None)
  assert seen == [(b0, 6, wd0, w, 'auto', (6, b0), *d) for w in (0, 2)]
  seen.clear()
  res = lr_sweep.run_axis(c, 'weight_decay', log=lambda m: None)
  assert [s[2:5] for s in seen] == [(0.0, w0, 'auto'), (0.5, w0, 'auto'),
                                    (0.0, w0, 'independent'), (0.125, w0, 'independent')]
  assert res['variants']['mup']['optimum_slope_log2_per_doubling'] is None   # one x > 0
  bad = common.with_overrides(c, {'study.batch_variants': 'mup:wd_scale=0.5'})
  with pytest.raises(errors.ConfigError, match='only the weight_decay axis'):
    lr_sweep.run_axis(bad, 'batch', log=lambda m: None)


def test_slope_per_doubling_skips_zero_points():
  assert lr_sweep.slope_per_doubling([0, 1, 2, 4], [9.0, -7.0, -7.5, -8.0]) == pytest.approx(-0.5)
  assert lr_sweep.slope_per_doubling([0, 2], [1.0, 2.0]) is None


def test_shift_table_keeps_every_sweep_and_row():
  """results_tables' transfer_shifts.md: two sweeps under one label both keep their rows."""
  def sweep(axis, xs, fits):
    return {axis: {'xs': xs, 'variants': {'mup': {
        'optimum_shift_log2': max(fits) - min(fits), 'any_at_edge': False,
        'optimum_slope_log2_per_doubling': lr_sweep.slope_per_doubling(xs, fits)}}}}
  text = lr_sweep.shift_table([('adamw', sweep('width', [64, 128], [-7.0, -7.5])),
                               ('adamw', sweep('warmup', [0, 5, 20], [-7.0, -7.0, -6.0]))])
  rows = text.strip().splitlines()[2:]
  assert [r.split(' | ')[1] for r in rows] == ['width', 'warmup']
  assert '| 0.50 | -0.50 |' in rows[0] and '| 1.00 | +0.50 |' in rows[1]
