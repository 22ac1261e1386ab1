"""Recurrent depth and trained exits (sharenet/train/sampled_depth.py, models/recurrence.py).

A sampled-depth step equals a hand-unrolled run of the same depth (loss, and gradients through
the last k loops only); every depth runs one compiled train step; the depth is a pure function
of (seed, step), so a kill -9 resume is exact; exit_loss=all is the mean of the per-loop losses;
the lowerings see one model; bad input is one line.
"""
import json
import os
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models import scaling
from sharenet.train import experiment, sampled_depth, loop, trainer
from sharenet.parametrization import rules
from sharenet.inference import loop_by_loop as ri
from sharenet.errors import ConfigError
from sharenet.train.metrics import read_metrics
from sharenet.models import DecoderLM, ModelConfig, accounting, layout, param_table
from sharenet.models.block import Block, Shared, Stream
from sharenet.models.lm import init_cache, init_variables
from sharenet.models.loops import Schedule

TOKENS_BT1 = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
TINY = dict(vocab_size=64, d_model=16, num_heads=2, mlp_dim=32, remat='none')


def _cfg(num_layers=5, scheme='middle_cycle', num_unique=3, **recurrence_keys):
  """middle_cycle: a prelude layer, one set looped num_layers - 2 = 3 times, a coda."""
  return ModelConfig(**TINY, num_layers=num_layers,
                     sharing=dict(scheme=scheme, num_unique=num_unique),
                     recurrence=recurrence_keys)


def _model(cfg):
  model = DecoderLM(cfg)
  return model, init_variables(model, jax.random.key(0))


def _adapter_path(cfg):
  """The adapter's path (collection first), found by its axes, not by module names."""
  (path,) = [p for p, i in param_table(cfg).items() if 'inject' in i.axes]
  return path


def _hand(cfg, v, depth, k):
  """The model by hand: prelude, `depth` loops of the looped set with the injection (the
  first depth - k of them under stop_gradient), coda, head; mean next-token NLL."""
  model, block = DecoderLM(cfg), Block(cfg)
  sets = layout.unique_sets(v['params'], cfg)
  apply = lambda u, x: block.apply({'params': unflatten_dict({p: a[u] for p, a in sets.items()})},
                                   Stream(x), Shared(jnp.arange(8)))[0].x_BTD
  e = apply(0, model.apply(v, TOKENS_BT1[:, :-1], method='embed'))
  s = e if cfg.recurrence.init == 'embed' else jnp.zeros_like(e)
  for r in range(depth):
    if r == depth - k:
      s = jax.lax.stop_gradient(s)
    if cfg.recurrence.injection == 'add':
      s = s + e
    elif cfg.recurrence.injection == 'concat':
      s = jnp.concatenate([s, e], -1) @ flatten_dict(v)[_adapter_path(cfg)]
    s = apply(1, s)
  logits = model.apply(v, apply(2, s), method='head')
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS_BT1[:, 1:]))


@pytest.mark.slow
def test_every_sampled_depth_runs_one_compiled_step(tiny_config):
  config = tiny_config(**{'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
                          'model.sharing.num_unique': 2, 'model.recurrence.depth':
                          'poisson_lognormal', 'model.recurrence.mean': 3.0,
                          'model.recurrence.backprop': 1, 'model.recurrence.injection': 'add',
                          'train.batch_size': 2, 'train.seq_len': 16})
  mcfg = experiment.validate(config)
  exp = trainer.setup(config, mcfg)
  step = jax.jit(trainer.make_train_step(exp, loops=sampled_depth.step_loops(config.train, mcfg)))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  batch = jnp.asarray(np.arange(2 * 17).reshape(2, 17) % 251, jnp.int32)
  depths = [sampled_depth.sample_depth(mcfg, 0, s) for s in range(20)]
  for d in depths:
    state, metrics = step(state, batch, np.int32(d))
  assert np.isfinite(float(metrics['loss']))
  assert len(set(depths)) >= 3 and min(depths) >= 1
  assert step._cache_size() == 1


def _poisson_lognormal_pmf(mean: float, sigma: float, kmax: int) -> np.ndarray:
  """P(depth = 1 + k), k = 0..kmax, of the reference sampler (Geiping et al., arXiv:2502.05171,
  `poisson-lognormal-filling`: tau ~ N(log(r) - sigma^2 / 2, sigma), depth = 1 + Poisson(e^tau),
  r = mean - 1), by integrating the Poisson pmf over the lognormal density of its rate."""
  from scipy import integrate, stats
  rate = stats.lognorm(s=sigma, scale=np.exp(np.log(mean - 1) - sigma ** 2 / 2))
  return np.array([integrate.quad(lambda lam: stats.poisson.pmf(k, lam) * rate.pdf(lam), 0,
                                  np.inf, limit=200)[0] for k in range(kmax + 1)])


def _chi2_p(draws: np.ndarray, pmf: np.ndarray) -> float:
  """Chi-square goodness of fit of integer draws (depth - 1) to `pmf`, the tail in one bin."""
  from scipy import stats
  k = len(pmf) - 1
  observed = np.bincount(np.minimum(draws, k), minlength=k + 1).astype(float)
  expected = np.append(pmf[:-1], 1 - pmf[:-1].sum()) * len(draws)
  return stats.chisquare(observed, expected).pvalue


@pytest.mark.slow
def test_sampled_depths_follow_the_reference_poisson_lognormal():
  """10,000 draws (backprop 1: no clamp) against the reference sampler's distribution, computed
  independently by numerical integration; a Poisson of the same mean without the lognormal
  rate (the wrong model) is rejected by the same test."""
  from scipy import stats
  mean = 5.0
  cfg = _cfg(depth='poisson_lognormal', mean=mean, backprop=1)
  draws = np.array([sampled_depth.sample_depth(cfg, 11, s) for s in range(10_000)]) - 1
  pmf = _poisson_lognormal_pmf(mean, sampled_depth.SIGMA, 14)
  assert abs(pmf.sum() - 1) < 0.01 and abs(draws.mean() - (mean - 1)) < 0.1
  assert _chi2_p(draws, pmf) > 1e-3
  assert _chi2_p(draws, stats.poisson.pmf(np.arange(15), mean - 1)) < 1e-6


@pytest.mark.slow
def test_the_depth_is_a_pure_function_of_seed_and_step():
  cfg = _cfg(depth='poisson_lognormal', mean=6.0, backprop=2)
  draws = [sampled_depth.sample_depth(cfg, 3, s) for s in range(4000)]
  assert draws == [sampled_depth.sample_depth(cfg, 3, s) for s in range(4000)]
  assert draws != [sampled_depth.sample_depth(cfg, 4, s) for s in range(4000)]
  assert min(draws) == 2                                # clamped to backprop
  assert 5.8 < np.mean(draws) < 6.4                     # E[1 + Poisson(rate)] = mean (+ clamp)
  assert sampled_depth.sample_depth(_cfg(depth='fixed', mean=5.0, backprop=2), 0, 7) == 5


@pytest.mark.slow
def test_exit_loss_all_is_the_mean_of_the_per_loop_losses():
  """Three loops: the exits are the model evaluated at depths 1, 2, 3 (the coda included;
  depth r + 1 run as one loop after a traced prefix of r: one program for the three)."""
  cfg = _cfg(depth='fixed', mean=3.0)
  model, v = _model(cfg)
  nll = jax.jit(lambda v, r: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      model.apply(v, TOKENS_BT1[:, :-1], schedule=Schedule(loops=1, no_grad=r)),
      TOKENS_BT1[:, 1:])))
  per_loop = np.asarray([nll(v, jnp.int32(r)) for r in (0, 1, 2)])
  loss = jax.jit(lambda v: sampled_depth.loss(model, v, TOKENS_BT1, None,
                                           sampled_depth.StepLoops((1.0, 1.0, 1.0)), 0))
  got, aux = loss(v)
  np.testing.assert_allclose(got, per_loop.mean(), rtol=1e-5)
  np.testing.assert_allclose([aux[f'exit_loss_{j}'] for j in (1, 2, 3)], per_loop, rtol=1e-5)
  assert sampled_depth.exit_weights('all', cfg) == (1.0, 1.0, 1.0)
  assert sampled_depth.exit_weights('1,0,3', cfg) == (1.0, 0.0, 3.0)
  # A sampled depth 3 with k = 2 (the same parameters): its exits are loops 2 and 3.
  sampled = DecoderLM(_cfg(depth='poisson_lognormal', mean=3.0, backprop=2))
  _, aux = jax.jit(lambda v, d: sampled_depth.loss(sampled, v, TOKENS_BT1, d,
                                                sampled_depth.StepLoops((1.0, 1.0)), 0))(
      v, jnp.int32(3))
  np.testing.assert_allclose([aux['exit_loss_1'], aux['exit_loss_2']], per_loop[1:], rtol=1e-5)


@pytest.mark.slow
def test_sampled_step_equals_the_hand_unrolled_depth():
  """loss_fn at a traced depth 4 (k = 2) = the hand-unrolled model of 4 loops (concat injection,
  zero state); its gradient is that of the last 2 loops (the prelude's through the injection)."""
  cfg = _cfg(depth='poisson_lognormal', mean=3.0, backprop=2, injection='concat', init='zeros')
  model, v = _model(cfg)
  loss = lambda v, d: trainer.loss_fn(v, {}, TOKENS_BT1, d, model=model,
                                        loops=sampled_depth.StepLoops())[0]
  got, g = jax.jit(jax.value_and_grad(loss))(v, jnp.int32(4))
  want, g_want = jax.jit(jax.value_and_grad(lambda v: _hand(cfg, v, 4, 2)))(v)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), g, g_want)
  assert bool(jnp.any(g['params']['embed']['embedding'] != 0))


def test_a_traced_depth_differentiates_with_masa_atoms():
  """MASA atoms (read by every loop, outside the stored sets) with a traced no-grad prefix:
  the train step's gradient traces (abstractly)."""
  cfg = ModelConfig(**TINY, num_layers=5, sharing=dict(scheme='middle_cycle', num_unique=3),
                    masa=dict(atoms=2), recurrence=dict(depth='poisson_lognormal', mean=3.0,
                                                        backprop=1, injection='add'))
  model = DecoderLM(cfg)
  v = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
  grad = jax.grad(lambda v, d: trainer.loss_fn(v, {}, TOKENS_BT1, d, model=model)[0])
  g = jax.eval_shape(grad, v, jax.ShapeDtypeStruct((), jnp.int32))
  assert jax.tree.map(lambda a: a.shape, g) == jax.tree.map(lambda a: a.shape, v)


@pytest.fixture(scope='module')
def concat_normal():
  """A concat-injected model starting from noise: (cfg, model, variables, its logits)."""
  cfg = _cfg(injection='concat', init='normal')
  model, v = _model(cfg)
  return cfg, model, v, jax.jit(model.apply)(v, TOKENS_BT1)


@pytest.mark.slow
def test_the_flat_lowering_sees_one_model(concat_normal):
  cfg, _, v, want = concat_normal
  flat = DecoderLM(cfg.derive(scan_lowering='flat'))
  np.testing.assert_allclose(jax.jit(flat.apply)(v, TOKENS_BT1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_python_loop_sees_one_model(concat_normal):
  """Its tree differs (one module per set, the adapter on the stack): the sets are copied by
  metadata, the adapter by its axes. Another depth runs the same schedule code everywhere."""
  cfg, _, v, want = concat_normal
  loop_cfg = cfg.derive(scan_layers=False)
  loop = DecoderLM(loop_cfg)
  shapes = jax.eval_shape(lambda: init_variables(loop, jax.random.key(0)))
  params = layout.from_unique_sets(shapes['params'], layout.unique_sets(v['params'], cfg),
                                   loop_cfg)
  flat = flatten_dict({'params': {**params, **{k: a for k, a in v['params'].items()
                                               if k != 'stack'}}})
  flat[_adapter_path(loop_cfg)] = flatten_dict(v)[_adapter_path(cfg)]
  np.testing.assert_allclose(jax.jit(loop.apply)(unflatten_dict(flat), TOKENS_BT1), want,
                             rtol=1e-5, atol=1e-5)


def test_the_normal_state_is_keyed_by_the_rng(concat_normal):
  """Training's per-step rng draws the state: the same key the same logits, another key (or
  none: evaluation's fixed key) others."""
  _, model, v, want = concat_normal
  keyed = jax.jit(lambda v, key: model.apply(v, TOKENS_BT1, rngs={'recurrence': key}))
  a, b = (keyed(v, jax.random.key(i)) for i in (1, 2))
  np.testing.assert_array_equal(a, keyed(v, jax.random.key(1)))
  assert not np.allclose(a, b) and not np.allclose(a, want)


def test_the_normal_state_has_the_reference_scale():
  """The reference's like-init: a normal truncated to 3 std, of the init std, times the
  embedding scale (recpre `initialize_state`); restated with scipy's truncated normal."""
  from scipy import stats
  from sharenet.models import recurrence
  e_BTD = jnp.zeros((4, 64, 64))
  positions_BT = jnp.arange(64)[None]
  cfg = _cfg(injection='add', init='normal').derive(embed_init_std=0.5, embed_scale=2.0)
  x = np.asarray(recurrence.initial_state(cfg, e_BTD, jax.random.key(3), positions_BT))
  assert np.abs(x).max() <= 3 * 0.5 * 2.0 + 1e-6
  assert abs(x.std() - stats.truncnorm(-3, 3).std() * 0.5 * 2.0) < 0.02
  unscaled = recurrence.initial_state(cfg.derive(embed_scale=1.0), e_BTD, jax.random.key(3),
                                      positions_BT)
  np.testing.assert_allclose(x, 2.0 * np.asarray(unscaled), rtol=1e-6)


@pytest.mark.slow
def test_micro_batches_draw_fresh_initial_states():
  """Under train.grad_accum = 2 each micro-batch draws its own noise: with the same tokens in
  both halves, the step's loss is the mean of the two micro-batch losses, which differ."""
  cfg = _cfg(injection='add', init='normal')
  model, v = _model(cfg)
  loops = sampled_depth.StepLoops(None, 7)
  batch = jnp.concatenate([TOKENS_BT1, TOKENS_BT1])
  loss = lambda micro: trainer.loss_fn(v, {}, TOKENS_BT1, model=model, loops=loops, step=5,
                                       micro=micro)[0]
  l0, l1 = float(loss(0)), float(loss(1))
  assert l0 != l1
  tx = optax.sgd(0.0)
  state = trainer.TrainState(jnp.asarray(5, jnp.int32), v, tx.init(v), {})
  _, metrics = trainer.train_step(state, batch, model=model, tx=tx, grad_accum=2, loops=loops)
  np.testing.assert_allclose(float(metrics['loss']), (l0 + l1) / 2, rtol=1e-6)


@pytest.mark.slow
def test_cached_decoding_sees_the_same_model(concat_normal):
  """Prefill and one cached step equal the full forward (injection, `normal` state keyed by
  row and absolute position)."""
  cfg, model, v, full = concat_normal
  step = jax.jit(lambda v, x, cache, pos: model.apply(v, x, cache=cache, positions_BT=pos))
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  pre, cache = step(v, TOKENS_BT1[:, :8], init_cache(cfg, 2, 16), positions)
  np.testing.assert_allclose(pre, full[:, :8], rtol=1e-5, atol=1e-5)
  nxt, _ = step(v, TOKENS_BT1[:, 8:], cache, jnp.full((2, 1), 8))
  np.testing.assert_allclose(nxt[:, 0], full[:, 8], rtol=1e-5, atol=1e-5)


def test_executed_flops_count_every_loop_and_backward_through_k():
  cfg = _cfg(depth='poisson_lognormal', mean=3.0, backprop=2, injection='add')
  plain = _cfg()
  T, head = 16, 2 * 16 * 64
  nominal = accounting.flops_per_token(plain, T)
  assert sampled_depth.executed_flops_per_token(plain, T, 3) == pytest.approx(nominal)
  loop_fwd = (accounting.flops_per_token(plain, T, train=False) - head) / 5   # 1 of 5 layers
  step = sampled_depth.executed_flops_per_token(cfg, T, 6) - sampled_depth.executed_flops_per_token(
      cfg, T, 5)
  assert step == pytest.approx(loop_fwd)   # a no-grad loop: forward only
  exits = sampled_depth.executed_flops_per_token(plain, T, 3, exits=3)
  assert exits > nominal


@pytest.mark.slow
def test_the_adapter_is_a_hidden_matrix_to_mup():
  cfg = ModelConfig(**{**TINY, 'd_model': 32, 'num_heads': 4, 'mlp_dim': 64}, num_layers=5,
                    sharing=dict(scheme='middle_cycle', num_unique=3),
                    recurrence=dict(injection='concat', init='zeros'))
  info = param_table(cfg)[_adapter_path(cfg)]
  assert (info.role, info.axes, info.shape, info.segment) == ('writer', ('inject', 'embed'),
                                                              (64, 32), cfg.recurrent_segment)
  pz = rules.Parametrization(cfg.derive(
      parametrization=scaling.Settings(kind='mup', base_d_model=16, base_num_heads=2)))
  rule = pz.rules[_adapter_path(cfg)]
  assert (rule.role, rule.lr_mult, rule.fan_in_mult) == ('hidden', 0.5, 2.0)


REFUSED = [
    (dict(mean=0.5), 'depth below 1'),
    (dict(depth='fixed', mean=2.5), 'whole number'),
    (dict(depth='poisson_lognormal', mean=3.0), 'needs backprop'),
    (dict(depth='poisson_lognormal', mean=2.0, backprop=3), 'exceed the mean depth'),
    (dict(injection='none', init='zeros'), 'injection=none'),
    (dict(depth='magic'), 'valid: fixed, poisson_lognormal'),
    (dict(injection='gate'), 'valid: none, add, concat'),
]


@pytest.mark.parametrize('keys,message', REFUSED)
def test_bad_recurrence_is_one_line(keys, message):
  with pytest.raises(ConfigError, match=message) as e:
    _cfg(**keys)
  assert '\n' not in str(e.value)


def test_recurrence_needs_a_plain_looped_segment():
  for kw, message in ((dict(scheme='untied', num_unique=0), 'which it lacks'),
                      (dict(scheme='sequence', num_unique=2), 'which it lacks')):
    with pytest.raises(ConfigError, match=message):
      _cfg(num_layers=4, injection='add', **kw)
  with pytest.raises(ConfigError, match='per-layer parts'):
    ModelConfig(**TINY, num_layers=4, sharing=dict(scheme='cycle', num_unique=2, lora_rank=2),
                recurrence=dict(depth='poisson_lognormal', mean=2.0, backprop=1))
  with pytest.raises(ConfigError, match='routing picks'):
    ModelConfig(**TINY, num_layers=4, sharing=dict(scheme='cycle', num_unique=2),
                routing=dict(kind='token_choice'), recurrence=dict(injection='add'))
  cfg = _cfg(injection='add')
  model, v = _model(cfg)
  assert ri.check_recursive(model, v).loops == 3   # served (tests/inference/test_test_time_depth.py)


@pytest.mark.parametrize('value,message', [('2,1', '2 weights for 3'), ('first', 'unknown'),
                                           ('1,-1,1', 'negative')])
def test_bad_exit_loss_is_one_line(value, message):
  with pytest.raises(ConfigError, match=message):
    sampled_depth.exit_weights(value, _cfg())
  with pytest.raises(ConfigError, match='no looped segment'):
    sampled_depth.exit_weights('all', _cfg(num_layers=4, scheme='untied', num_unique=0))


@pytest.mark.slow
def test_train_py_refuses_a_depth_below_one(tmp_path, train_cmd, subprocess_env):
  res = subprocess.run(train_cmd(str(tmp_path), '--config.model.recurrence.mean=0.5'),
                       env=subprocess_env, capture_output=True, text=True)
  assert res.returncode == 2
  lines = res.stderr.strip().splitlines()
  assert len(lines) == 1 and 'model.recurrence.mean=0.5' in lines[0] and 'valid' in lines[0]


RESUME = {'train.steps': 12, 'train.checkpoint_every': 6, 'model.num_layers': 4,
          'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2,
          'model.recurrence.depth': 'poisson_lognormal', 'model.recurrence.mean': 3.0,
          'model.recurrence.backprop': 1, 'model.recurrence.injection': 'add',
          'model.recurrence.init': 'normal', 'train.exit_loss': 'all'}


@pytest.mark.slow
def test_resume_after_kill_is_exact(tmp_path, tiny_config, train_cmd, subprocess_env, losses):
  """A sampled-depth run killed -9 after its step-6 checkpoint resumes to the uninterrupted
  losses and depths; its rows log each step's depth and executed FLOPs (MFU counts them)."""
  ref_dir, workdir = str(tmp_path / 'ref'), str(tmp_path / 'killed')
  loop.train_and_evaluate(tiny_config(**RESUME), ref_dir)
  flags = [f'--config.{k}={v}' for k, v in RESUME.items()]
  proc = subprocess.Popen(train_cmd(workdir, *flags), env=subprocess_env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt = os.path.join(workdir, 'checkpoints', '6')
  deadline = time.time() + 300
  while not os.path.isdir(ckpt) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert os.path.isdir(ckpt), 'the run never wrote its step-6 checkpoint'
  assert proc.returncode == -signal.SIGKILL, 'the run ended before it was killed'
  res = subprocess.run(train_cmd(workdir, *flags), env=subprocess_env, check=True,
                       capture_output=True, text=True)
  assert 'resumed from checkpoint at step 6' in res.stdout
  assert 'eval_loss' in json.loads(res.stdout.splitlines()[-1])
  ref, resumed = losses(ref_dir), losses(workdir)
  assert [resumed[s] for s in range(7, 13)] == [ref[s] for s in range(7, 13)]
  rows = {r['step']: r for r in read_metrics(ref_dir) if 'loss' in r}
  depths = [rows[s]['depth'] for s in range(1, 13)]
  assert depths == [sampled_depth.sample_depth(experiment.validate(tiny_config(**RESUME)), 0, s)
                    for s in range(12)]
  assert len({rows[s]['executed_flops_per_token'] for s in rows}) > 1
  assert all(np.isfinite(rows[s]['mfu_vs_matmul']) and 'exit_loss_1' in rows[s] for s in rows)
  killed = {r['step']: r['depth'] for r in read_metrics(workdir) if 'loss' in r}
  assert [killed[s] for s in range(1, 13)] == depths
  # Evaluation runs the rounded mean (3 loops), not the plan's R = 2 (sampled_depth.eval_schedule).
  from sharenet.main import eval_workdir
  final = [r for r in read_metrics(ref_dir) if 'eval_loss' in r][-1]['eval_loss']
  at = {r['depth']: r['eval_loss']
        for r in eval_workdir.evaluate_workdir_depths(ref_dir, None, None, [2, 3])}
  assert at[3] == pytest.approx(final, rel=1e-5) and at[2] != pytest.approx(final, rel=1e-3)
