"""train.watch (sharenet/train/watch.py): per role, stored set and applied layer statistics in
the log rows, each kind checked against a direct computation."""
import os

import jax
import numpy as np
import pytest

from sharenet.errors import ConfigError
from sharenet.models import layout, param_table, streams
from sharenet.train import experiment, trainer
from sharenet.train.metrics import read_metrics

CYCLE = {'model.num_layers': 4, 'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2,
         'model.sharing.lora_rank': 2, 'model.sharing.lora_targets': 'q,v'}


def _rms(x):
  x = np.asarray(x, np.float64)
  return np.sqrt(np.mean(x * x))


def _traced_watch_metrics(config):
  """The metrics of `config`'s watched step from init, evaluated abstractly."""
  exp = trainer.setup(config, experiment.validate(config))
  state = jax.eval_shape(lambda: trainer.init_state(exp.model, exp.tx, jax.random.key(0),
                                                    tr=exp.tr, pz=exp.pz))
  _, m = jax.eval_shape(trainer.make_train_step(exp, watch=True), state,
                        jax.ShapeDtypeStruct((2, 17), 'int32'))
  return m


@pytest.mark.slow
def test_the_watched_step_restates_in_numpy(tiny_config):
  """One watched step of a cycle with depth-wise LoRA: each kind of row (param, grad, update,
  ratio per stored set; per applied layer for LoRA; outside the blocks; the residual stream
  after every applied layer) equals its numpy computation, and the state is the plain step's."""
  config = tiny_config(**CYCLE, **{'train.lr': 0.05, 'train.warmup_steps': 0})
  exp = trainer.setup(config, experiment.validate(config))
  cfg = exp.model.cfg
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), tr=exp.tr, pz=exp.pz)
  batch = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)
  plain, _ = jax.jit(trainer.make_train_step(exp))(state, batch)
  new, m = jax.jit(trainer.make_train_step(exp, watch=True))(state, batch)
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(new.params)):
    np.testing.assert_array_equal(a, b)
  grads = jax.grad(lambda p: trainer.loss_fn(p, state.tstate, batch, model=exp.model,
                                             tr=exp.tr, pz=exp.pz)[0])(state.params)
  table = param_table(cfg)
  reader = [i for i in table.values() if i.in_block and i.local[-2:] == ('q', 'kernel')][0]
  sets = {n: layout.unique_sets(t['params'], cfg)[reader.local]
          for n, t in (('old', state.params), ('new', new.params), ('grad', grads))}
  for u in range(2):
    key = f'reader/set{u}'
    # every reader of set u: q, k, v, mlp_in kernels of that set
    readers = [p for p, i in table.items() if i.in_block and i.role == 'reader' and
               p[0] == 'params']
    def group(tree):
      views = layout.unique_sets(tree['params'], cfg)
      return np.concatenate([np.ravel(views[table[p].local][u]) for p in readers])
    np.testing.assert_allclose(m[f'watch/param_rms/{key}'], _rms(group(new.params)), rtol=1e-5)
    np.testing.assert_allclose(m[f'watch/grad_rms/{key}'], _rms(group(grads)), rtol=1e-4)
    upd = group(new.params) - group(state.params)
    np.testing.assert_allclose(m[f'watch/update_rms/{key}'], _rms(upd), rtol=1e-4)
    np.testing.assert_allclose(m[f'watch/update_ratio/{key}'],
                               _rms(upd) / _rms(group(state.params)), rtol=1e-4)
    assert _rms(upd) > 1e-3 * _rms(group(state.params))   # a real update, not a zero
  assert sets['grad'].shape[0] == 2
  lora = layout.applied_per_layer(new.params['per_layer'], cfg)
  for layer in range(4):
    got = m[f'watch/param_rms/lora/layer{layer}']
    want = _rms(np.concatenate([np.ravel(v[layer]) for p, v in lora.items()
                                if p[-1].startswith('lora')]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(m['watch/param_rms/embedding'],
                             _rms(new.params['params']['embed']['embedding']), rtol=1e-5)
  _, h, _ = streams.apply(exp.model, trainer.effective(state.params, state.tstate, exp.tr,
                                                       exp.pz), batch[:, :-1])
  for layer in range(4):
    np.testing.assert_allclose(m[f'watch/residual_rms/layer{layer}'], _rms(h[layer]),
                               rtol=1e-5)


@pytest.mark.slow
def test_per_use_rows_split_a_shared_sets_gradient(tiny_config):
  """A cycle of 2 sets over 4 layers (with depth-wise LoRA): the untied view's gradient at each
  use sums over a set's uses to the plain model's gradient of the set's effective weights, and
  use_grad_rms / use_grad_share equal their numpy computation from it (shares sum to 1)."""
  from sharenet.models import DecoderLM
  from sharenet.train import evaluation
  config = tiny_config(**CYCLE)
  exp = trainer.setup(config, experiment.validate(config))
  cfg = exp.model.cfg
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), tr=exp.tr, pz=exp.pz)
  batch = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)
  _, m = jax.jit(trainer.make_train_step(exp, watch=True))(state, batch)
  variables = trainer.effective(state.params, state.tstate, exp.tr, exp.pz)
  loss = lambda model, v: evaluation.mean_nll(evaluation.token_nll(model, v, batch)[0], batch)
  tied = layout.unique_sets(jax.grad(lambda v: loss(exp.model, v))(variables)['params'], cfg)
  ucfg, untied = layout.to_untied(variables, cfg)
  per_use = layout.unique_sets(jax.grad(lambda v: loss(DecoderLM(ucfg), v))(untied)['params'],
                               ucfg)   # untied: set l is applied layer l
  table = param_table(cfg)
  writers = sorted({i.local for i in table.values()
                    if i.in_block and i.role == 'writer' and i.path[0] == 'params'})
  index = list(cfg.plan.index)
  assert index == [0, 1, 0, 1]
  for u in range(2):
    layers = [l for l in range(4) if index[l] == u]
    for p in writers:   # the uses' gradients add up to the set's
      np.testing.assert_allclose(sum(np.asarray(per_use[p][l]) for l in layers), tied[p][u],
                                 rtol=2e-4, atol=1e-7)
    g = {l: np.concatenate([np.ravel(per_use[p][l]) for p in writers]) for l in layers}
    total = sum(g.values())
    shares = []
    for l in layers:
      np.testing.assert_allclose(m[f'watch/use_grad_rms/writer/layer{l}'], _rms(g[l]),
                                 rtol=1e-4)
      shares.append(float(m[f'watch/use_grad_share/writer/layer{l}']))
      np.testing.assert_allclose(shares[-1], g[l] @ total / (total @ total), rtol=1e-4,
                                 atol=1e-6)
    assert sum(shares) == pytest.approx(1.0, abs=1e-5)
  assert not any('use_grad' in k and '/lora/' in k for k in m)   # per-layer parts: no sets


def test_an_untied_model_has_no_per_use_rows(tiny_config):
  config = tiny_config()
  m = _traced_watch_metrics(config)
  assert any(k.startswith('watch/grad_rms/') for k in m)
  assert not any(k.startswith('watch/use_grad') for k in m)


@pytest.mark.slow
def test_watch_rows_appear_at_log_steps_only(tmp_path, tiny_config):
  """train.py with train.watch: every log row carries the watch rows, their parameter RMS is
  the saved checkpoint's, and the update RMS is the difference of two saved steps."""
  from sharenet.train import loop, workdir_io
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(tiny_config(**{**CYCLE, 'train.steps': 4, 'train.log_every': 2,
                                         'train.watch': True, 'train.checkpoint_every': 1,
                                         'train.keep_checkpoints': 5}), workdir)
  rows = [r for r in read_metrics(workdir) if 'loss' in r]
  assert [r['step'] for r in rows] == [2, 4]
  assert all(sum(k.startswith('watch/') for k in r) > 20 for r in rows)
  assert all('watch/use_grad_share/writer/layer2' in r for r in rows)
  config = workdir_io.load_config(workdir)
  params = {}
  for step in (3, 4):
    state, _, exp = workdir_io.restore_state(config, workdir, step=step)
    params[step] = state.params
  cfg = exp.model.cfg
  new = layout.unique_sets(params[4]['params'], cfg)
  old = layout.unique_sets(params[3]['params'], cfg)
  wo = [p for p in new if p[-2:] == ('wo', 'kernel')][0]
  table = param_table(cfg)
  writers = [i.local for i in table.values() if i.in_block and i.role == 'writer' and
             i.path[0] == 'params']
  for u in range(2):
    cat = lambda views: np.concatenate([np.ravel(views[p][u]) for p in writers])
    assert rows[1][f'watch/param_rms/writer/set{u}'] == pytest.approx(_rms(cat(new)), rel=1e-5)
    assert rows[1][f'watch/update_rms/writer/set{u}'] == pytest.approx(
        _rms(cat(new) - cat(old)), rel=1e-4)
  assert wo in new


def test_a_routed_model_is_watched_without_residual_rows(tiny_config):
  """Mixture-of-Recursions: the parameter rows, and no residual rows (no stream is every
  layer's); traced only."""
  config = tiny_config(**{'model.routing.kind': 'expert_choice', 'model.sharing.scheme': 'cycle',
                          'model.sharing.num_unique': 1, 'model.num_layers': 3})
  m = _traced_watch_metrics(config)
  assert any(k.startswith('watch/grad_rms/') for k in m)
  assert not any(k.startswith('watch/residual_rms/') for k in m)


def test_watch_composes_with_hidden_state_distillation(tiny_config):
  """A watched step of a student matched to its teacher's streams (both read through the untied
  view, sharenet/models/streams.py) keeps the residual rows beside distill_hidden; traced only."""
  from sharenet.models import init_variables
  from sharenet.train import distill
  config = tiny_config()
  exp = trainer.setup(config, experiment.validate(config))
  state = jax.eval_shape(lambda: trainer.init_state(exp.model, exp.tx, jax.random.key(0),
                                                    tr=exp.tr, pz=exp.pz))
  teacher_vars = jax.eval_shape(lambda: init_variables(exp.model, jax.random.key(0)))
  teacher = distill.Distill(exp.model, 1.0, 0.5, ((1, 1),), 1.0, True)
  _, m = jax.eval_shape(trainer.make_train_step(exp, teacher=teacher, watch=True), state,
                        jax.ShapeDtypeStruct((2, 17), 'int32'), teacher_vars)
  assert {'distill_hidden', 'watch/residual_rms/layer0', 'watch/residual_rms/layer1'} <= set(m)


def test_watch_refuses_what_has_no_fixed_layers(tmp_path, tiny_config):
  from sharenet.train import loop
  with pytest.raises(ConfigError, match='train.watch names its rows by applied layer') as e:
    loop.train_and_evaluate(tiny_config(**{'train.watch': True, 'model.scan_layers': False}),
                            str(tmp_path / 'run'))
  assert '\n' not in str(e.value) and not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_watch_plot_draws_the_rows(tmp_path, tiny_config):
  """python -m sharenet.studies.watch_plot --workdir DIR: a PNG of every kind; a run without
  watch rows is one line."""
  from sharenet.studies import watch_plot
  from sharenet.train import loop
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(tiny_config(**{'train.steps': 2, 'train.log_every': 1,
                                         'train.watch': True}), workdir)
  data = watch_plot.series(read_metrics(workdir))
  assert set(data) == set(watch_plot.KINDS) and data['residual_rms']['layer1'][0] == [1, 2]
  path = watch_plot.plot(workdir)
  assert path == os.path.join(workdir, 'watch.png') and os.path.getsize(path) > 0
  plain = str(tmp_path / 'plain')
  loop.train_and_evaluate(tiny_config(**{'train.steps': 1}), plain)
  with pytest.raises(ConfigError, match='has no watch rows') as e:
    watch_plot.plot(plain)
  assert '\n' not in str(e.value)
