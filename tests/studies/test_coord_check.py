"""Coordinate check (sharenet/studies/coord_check.py): muP contrast and the train loop's step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.mup import coord_check as cc_config
from sharenet.train import experiment, trainer
from sharenet.studies import common, coord_check


@pytest.mark.slow
def test_coord_check_mup_flat_sp_grows():
  """Residual stream / MLP / attention output: flat in width under mup, growing under sp."""
  c = cc_config.get_config()
  c.model.num_layers, c.train.batch_size, c.train.seq_len = 1, 4, 16
  s = c.study
  s.steps, s.seeds, s.width_values, s.width_variants = 4, 1, '32,64,128', 'sp,mup'
  res = coord_check.run_axis(c, 'width', log=lambda m: None)
  worst = coord_check.summary(res)          # max |slope| over t >= 1
  # 1 layer at widths 32-128 lags the 64-512 tool run (<= 0.05 there). Measured here: mup
  # residual 0.08, mlp_out 0.15, others <= 0.05; sp residual slopes 0.38, 0.44, 0.52, 0.76.
  for a in ('residual', 'attn_out', 'mlp_out', 'mlp_hidden', 'embed_out'):
    assert worst['mup'][a] < 0.2, (a, worst['mup'])
  assert worst['mup']['residual'] < 0.12, worst['mup']
  sp_res = res['variants']['sp']['slopes']['residual']
  assert max(sp_res[1:]) > 0.5, sp_res
  # t = 0 is the same model for both (base width = 32 and mup init == sp init there).
  assert res['variants']['sp']['l1']['32']['residual'][0] == \
      res['variants']['mup']['l1']['32']['residual'][0]


@pytest.mark.slow
def test_muon_rms_change_from_init_grows_under_sp_only():
  """Muon with Moonlight's RMS scale (train.muon.scale=rms), study.statistic=delta, widths
  32-128 (1 layer, 4 steps at LR 1e-2): each step moves a hidden kernel's outputs by
  ~0.2 lr sqrt(fan_in) per coordinate under SP, so mean|x_t - x_0| of the residual stream,
  attention and MLP outputs grows with width (first-order slope 0.5; measured 2026-12-06:
  0.41, 0.53, 0.39), while Muon's muP divides that growth out (0.03, 0.05, 0.06); both max
  |slope| over t >= 1.
  The 64-256 check is docs/results/mup/muon/rms/coord_check/delta/."""
  c = cc_config.get_config()
  c.model.num_layers, c.train.batch_size, c.train.seq_len = 1, 4, 16
  c.train.optimizer, c.train.muon.scale = 'muon', 'rms'
  s = c.study
  s.steps, s.seeds, s.width_values, s.width_variants = 4, 1, '32,64,128', 'sp,mup'
  s.statistic = 'delta'
  res = coord_check.run_axis(c, 'width', log=lambda m: None)
  worst = coord_check.summary(res)
  for a in ('residual', 'attn_out', 'mlp_out'):
    assert worst['sp'][a] > 0.3 and worst['mup'][a] < 0.12, (a, worst)
  assert np.isnan(res['variants']['sp']['slopes']['residual'][0])   # 0 at init: no slope
  assert res['statistic'] == 'delta' and 'l1' not in res['variants']['sp']


@pytest.mark.slow
def test_coord_check_runs_the_train_step():
  """With a stateful reparam and grad_accum=2 the check's losses are those of the loop's step
  on the same fixed batch, and it records every activation once per step."""
  c = cc_config.get_config()
  c.model.num_layers, c.train.batch_size, c.train.seq_len = 1, 4, 16
  c = common.with_overrides(c, {'model.d_model': 64, 'model.mlp_dim': 192,
                                'parametrization.kind': 'mup', 'parametrization.base_d_model': 32,
                                'transforms.reparam': 'sigma_reparam', 'train.grad_accum': 2})
  toks = common.fixed_batch(c.data, c.train.batch_size, c.train.seq_len)
  runs, losses = coord_check.trajectories(c, 3, 1, toks)
  exp = trainer.setup(c, experiment.validate(c))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), tr=exp.tr, pz=exp.pz)
  assert state.tstate                         # power-iteration vectors the step must advance
  step = jax.jit(trainer.make_train_step(exp, grad_accum=2))
  want = []
  for _ in range(4):
    state, metrics = step(state, jnp.asarray(toks))
    want.append(float(metrics['loss']))
  np.testing.assert_allclose(losses[0], want, rtol=1e-6)
  assert want[-1] < want[0] - 0.1
  assert len(runs[0]) == 4 and {'residual', 'mlp_out', 'attn_out'} <= set(runs[0][0])


@pytest.mark.slow
@pytest.mark.parametrize('optimizer', ['muon', 'shampoo', 'shampoo_vanilla'])
def test_coord_check_optimizer_mup_is_flat(optimizer):
  """Width 32-128 under train.optimizer=muon / shampoo with that optimizer's muP
  (docs/optimizers.md): residual stream, attention and MLP outputs flat. Measured 2026-12-03
  (1 layer, 4 steps, max |slope| over t >= 1): muon mup residual 0.03, mlp_out 0.18, attn_out
  0.06; shampoo mup residual 0.05, mlp_out 0.18, attn_out 0.03. SP contrast: shampoo sp residual
  0.55, mlp_out 0.60 (grows, like Adam: the graft gives Adam's step; asserted); muon sp residual
  0.04 (flat already: optax's shape factor is the spectral scaling for uniformly widened hidden
  kernels, so muP differs from SP only on the Adam leaves; not asserted, not run).
  shampoo_vanilla (train.shampoo.graft=none, the second-order muP): see its measured values
  in docs/optimizers.md."""
  c = cc_config.get_config()
  c.model.num_layers, c.train.batch_size, c.train.seq_len = 1, 4, 16
  c.train.optimizer = optimizer.replace('_vanilla', '')
  if optimizer == 'shampoo_vanilla':
    c.train.shampoo.graft = 'none'
  s = c.study
  s.steps, s.seeds, s.width_values = 4, 1, '32,64,128'
  s.width_variants = 'sp,mup' if optimizer == 'shampoo' else 'mup'
  summary = coord_check.summary(coord_check.run_axis(c, 'width', log=lambda m: None))
  worst = summary['mup']
  for a in ('residual', 'attn_out', 'mlp_out', 'mlp_hidden', 'embed_out'):
    assert worst[a] < 0.2, (a, worst)
  assert worst['residual'] < 0.12, worst
  if optimizer == 'shampoo':
    assert summary['sp']['residual'] > 0.45 and summary['sp']['mlp_out'] > 0.45, summary['sp']


@pytest.mark.slow
def test_scion_mup_is_flat_and_its_sp_readout_grows():
  """train.optimizer=scion (sharenet/optim/scion.py), widths 32-128, study.statistic=delta
  (1 layer, 4 steps at LR 5e-4, max |slope| over t >= 1). Its muP (the width-scaled LMOs):
  every activation flat; measured 2026-12-07: embed_out 0.02, residual 0.01, attn_out 0.08,
  mlp_out 0.06, logits 0.08. Its SP (the unscaled LMOs): the readout's sign step moves the
  logits by ~fan_in (logits 0.85) and the l2-normalised embedding rows shrink
  (embed_out 0.52)."""
  c = cc_config.get_config()
  c.model.num_layers, c.train.batch_size, c.train.seq_len = 1, 4, 16
  c.train.optimizer, c.train.lr = 'scion', 5e-4
  s = c.study
  s.steps, s.seeds, s.width_values, s.width_variants = 4, 1, '32,64,128', 'sp,mup'
  s.statistic = 'delta'
  worst = coord_check.summary(coord_check.run_axis(c, 'width', log=lambda m: None))
  for a in ('residual', 'attn_out', 'mlp_out', 'mlp_hidden', 'embed_out', 'logits'):
    assert worst['mup'][a] < 0.2, (a, worst['mup'])
  assert worst['sp']['logits'] > 0.6 and worst['sp']['embed_out'] > 0.4, worst['sp']


@pytest.mark.slow
@pytest.mark.parametrize('graft', ['none', 'adam'])
def test_kfac_mup_is_flat_where_its_sp_moves(graft):
  """train.optimizer=kfac (sharenet/optim/kfac.py), configs/mup/coord_check_kfac.py at 1 layer:
  16 rows per step, widths 64-256 (the fixed-batch regime of the second-order muP), change from
  init, 4 steps at LR 1e-2, max |slope| over t >= 1. Measured 2026-12-07: graft=none (the
  second-order muP: LR constant, rho_A ~ fan_in, rho_G ~ 1/fan_out) muP residual 0.11, max
  0.14 (attn_logits); SP residual 0.59, logits 0.91, mlp_out 0.72. graft=adam (Adam's muP)
  muP residual 0.07, max 0.17 (logits); SP residual 0.89, attn_logits 1.42."""
  from configs.mup import coord_check_kfac
  c = coord_check_kfac.get_config()
  c.model.num_layers = 1
  c.train.kfac.graft = graft
  worst = coord_check.summary(coord_check.run_axis(c, 'width', log=lambda m: None))
  for a in ('residual', 'attn_out', 'mlp_out', 'mlp_hidden', 'embed_out', 'logits'):
    assert worst['mup'][a] < 0.2, (a, worst['mup'])
  assert worst['sp']['residual'] > 0.45 and worst['sp']['logits'] > 0.6, worst['sp']


def test_steps_table_has_a_row_per_variant_and_activation():
  """coord_check_steps.md: one row per variant and principal activation, one column per step,
  the slopes as the JSON holds them (activations a variant lacks are left out)."""
  slopes = {'sp': {'residual': [0.0, 0.25, 0.5], 'attn_out': [0.0, 0.1, 0.2],
                   'mlp_out': [0.1, 0.3, 0.6], 'logits': [0.0, 1.0, 2.0]},
            'mup': {'residual': [0.0, 0.01, -0.02]}}
  result = {'width': {'xs': [64, 128], 'variants': {v: {'slopes': s} for v, s in slopes.items()}},
            'runtime_s': 1.0}
  lines = coord_check.steps_markdown(result).splitlines()
  assert lines[2] == '| variant | activation | t=0 | t=1 | t=2 |'
  rows = [line for line in lines if line.startswith(('| sp', '| mup'))]
  assert rows == ['| sp | residual | +0.00 | +0.25 | +0.50 |',
                  '| sp | attn_out | +0.00 | +0.10 | +0.20 |',
                  '| sp | mlp_out | +0.10 | +0.30 | +0.60 |',
                  '| mup | residual | +0.00 | +0.01 | -0.02 |']


def _tiny(**overrides):
  """configs/mup/coord_check.py at width 32, 2 layers, batch 2 x 8, with `overrides`."""
  c = cc_config.get_config()
  c.train.batch_size, c.train.seq_len = 2, 8
  return common.with_overrides(c, {'model.d_model': 32, 'model.mlp_dim': 96, **overrides})


@pytest.mark.slow
def test_delta_is_the_change_of_each_activation_from_init():
  """study.statistic=delta: mean|x_t - x_0| of the logits equals the same mean of a plain
  forward of the model at init and after t train-loop steps (muP: forward multipliers in
  play); the t = 0 values are 0; every activation has one value per use, as under l1 (the
  order of uses: test_sown_activations_match_their_scalars_use_by_use)."""
  c = _tiny(**{'parametrization.kind': 'mup', 'parametrization.base_d_model': 16})
  toks = common.fixed_batch(c.data, c.train.batch_size, c.train.seq_len)
  runs, losses = coord_check.trajectories(c, 2, 1, toks, 'delta')
  l1_runs, l1_losses = coord_check.trajectories(c, 2, 1, toks, 'l1')
  np.testing.assert_array_equal(losses, l1_losses)          # the same training either way
  exp = trainer.setup(c, experiment.validate(c))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(c.train.seed), tr=exp.tr,
                               pz=exp.pz)
  step = jax.jit(trainer.make_train_step(exp))
  logits = []
  for _ in range(3):
    v = trainer.effective_params(state, exp.tr, exp.pz)
    logits.append(np.asarray(exp.model.apply(v, jnp.asarray(toks[:, :-1])), np.float64))
    state, _ = step(state, jnp.asarray(toks))
  for t in range(3):
    want = np.mean(np.abs(logits[t] - logits[0]))
    np.testing.assert_allclose(runs[0][t]['logits'], [want], rtol=1e-4, atol=1e-7)
    assert set(runs[0][t]) == set(l1_runs[0][t])
    for name, vals in runs[0][t].items():
      assert vals.shape == l1_runs[0][t][name].shape, name   # one value per use, as l1
  assert runs[0][2]['logits'][0] > 0 and np.all(runs[0][0]['residual'] == 0)


_CYCLE = {'model.num_layers': 4, 'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2,
          'model.sharing.repeats': 0}


@pytest.mark.parametrize('overrides', [
    {},                                                            # cycle, nested scans
    {'model.scan_lowering': 'flat'},
    pytest.param({'model.moe.kind': 'sigma_moe', 'model.moe.num_experts': 4},   # experts in
                 marks=pytest.mark.slow),                                      # the shared block
    {'model.sharing.lora_rank': 2},                                # relaxed: depth-wise LoRA
], ids=['cycle', 'flat', 'sigma_moe', 'lora'])
@pytest.mark.slow
def test_sown_activations_match_their_scalars_use_by_use(overrides):
  """Inside layers.sow_activations() every sown scalar has its activation beside it: mean|x| of
  each use's row equals the scalar sown for that use (masked entries, the causal attention
  logits', are NaN), on a cycle plan whose shared blocks are applied twice, under
  each way the stack runs them. Outside the context only scalars are sown."""
  from sharenet.models.layers import INTERMEDIATES, sow_activations
  c = _tiny(**_CYCLE, **overrides)
  toks = jnp.asarray(common.fixed_batch(c.data, c.train.batch_size, c.train.seq_len))
  exp = trainer.setup(c, experiment.validate(c))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), tr=exp.tr, pz=exp.pz)
  plain = trainer.make_train_step(exp, mutable=[INTERMEDIATES])
  assert coord_check._activations(jax.jit(plain)(state, toks)[1][INTERMEDIATES]) == {}
  with sow_activations():
    inter = jax.jit(trainer.make_train_step(exp, mutable=[INTERMEDIATES]))(state, toks)[1][
        INTERMEDIATES]
  acts = coord_check._activations(inter)
  scalars = coord_check._flatten(inter)
  from_acts = coord_check._by_name({p: np.nanmean(np.abs(a), axis=1) for p, a in acts.items()})
  assert set(from_acts) == set(scalars) and len(scalars['residual']) == 4
  assert np.isnan(acts[next(p for p in acts if p[-1] == 'attn_logits')]).any()   # causal mask
  for name, vals in scalars.items():
    np.testing.assert_allclose(from_acts[name], vals, rtol=2e-5, err_msg=name)


def test_statistic_bad_input_is_one_line():
  """An unknown study.statistic, delta with micro-batches, a routed model (whose recursions sow
  nothing) or the Python-loop stack (which sows per stored set) is one ConfigError naming the
  valid choices."""
  from sharenet.errors import ConfigError
  c = _tiny(**{'study.statistic': 'l2'})
  with pytest.raises(ConfigError, match=r"study.statistic: unknown 'l2'; valid: l1, delta"):
    coord_check.run_axis(c, 'width')
  c = _tiny(**{'study.statistic': 'delta', 'train.grad_accum': 2})
  with pytest.raises(ConfigError, match=r'valid: train.grad_accum=1 \(got 2\)'):
    coord_check.run_axis(c, 'width')
  c = _tiny(**_CYCLE, **{'model.routing.kind': 'expert_choice'})   # was a KeyError traceback
  toks = common.fixed_batch(c.data, c.train.batch_size, c.train.seq_len)
  with pytest.raises(ConfigError, match=r'routing.kind=expert_choice records no activations of '
                     r'its routed recursions; valid: model.routing.kind=none'):
    coord_check.trajectories(c, 1, 1, toks)
  c = _tiny(**_CYCLE, **{'model.scan_layers': False})   # uses came out by stored set
  with pytest.raises(ConfigError, match=r'model.scan_layers=False records each stored set.s uses '
                     r'apart, not in applied order; valid: model.scan_layers=True'):
    coord_check.trajectories(c, 1, 1, toks)


def test_mean_change_skips_masked_entries_and_keeps_a_divergence():
  """'delta' per use: entries NaN at init (outside a mask) are left out; a NaN that appears
  later (a diverged run) is not hidden."""
  x0 = np.array([[1.0, np.nan, 3.0], [0.0, 0.0, 0.0]])
  x = np.array([[2.0, np.nan, 1.0], [1.0, np.nan, 1.0]])
  out = coord_check._mean_change(x, x0)
  assert out[0] == 1.5 and np.isnan(out[1])
