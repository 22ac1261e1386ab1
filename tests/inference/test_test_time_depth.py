"""Test-time depth and adaptive exits (issue 29 parts 2 and 4):
sharenet/inference/test_time_depth.py, exits.py,
loop_by_loop.py with sampling, generate.py at another depth, eval.py's flags.

Each exit criterion at a threshold where it never fires is full-depth decoding (greedy, and
sampled under a fixed seed), and where it always fires after the first loop it is the one-loop
model; decoding at another depth is the model of that depth; evaluation at the training depth
is plain evaluation; bad input is one ConfigError line naming the valid choices.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.inference import test_time_depth, exits
from sharenet.train import evaluation, perf
from sharenet.inference import generate as gen
from sharenet.inference import loop_by_loop as ri
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, accounting
from sharenet.models.lm import init_variables

K, R = 2, 3   # 2 sets looped 3 times
PROMPTS = ([3, 141, 59, 26, 5], [27, 18], [7])
NEW = 5
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, rng=jax.random.key(5))
NEVER = ('maxprob:1', 'entropy:0', 'entropy_change:0', 'kl:0', f'argmax_stable:{R}',
         'latent:0', 'cosine:1')


def _cfg(tiny_config, loops=R, **overrides):
  config = tiny_config(**{'model.num_layers': K * loops, 'model.sharing.scheme': 'cycle',
                          'model.sharing.num_unique': K, **overrides})
  return ModelConfig.from_config(config.model, config.train.seq_len)


def _model(tiny_config, loops=R, **overrides):
  model = DecoderLM(_cfg(tiny_config, loops, **overrides))
  return model, init_variables(model, jax.random.key(0))


@pytest.fixture(scope='module')
def cycle(tiny_config):
  return _model(tiny_config)


@pytest.mark.slow
@pytest.mark.parametrize('rule', NEVER)
@pytest.mark.parametrize('sampling', ['greedy', 'sampled'])
def test_never_firing_criterion_is_full_depth_decoding(cycle, rule, sampling):
  model, variables = cycle
  kw = SAMPLED if sampling == 'sampled' else dict(temperature=0.0)
  full = gen.generate(model, variables, PROMPTS, NEW, **kw).tokens
  out = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit=rule, **kw)
  assert out.exit_depths == [R] * len(PROMPTS)   # it never fired
  assert out.tokens == full


@pytest.mark.slow
@pytest.mark.parametrize('rule', ['entropy:1e9', 'entropy_change:1e9', 'kl:1e9',
                                  'argmax_stable:0', 'latent:1e9', 'cosine:-1'])
def test_always_firing_criterion_is_the_one_loop_model(cycle, rule):
  """A cycle model has no coda, so the prompt's keys at loop 1 do not depend on the depth the
  prefill ran at: exiting after every first loop is decoding at depth 1."""
  model, variables = cycle
  one_loop = gen.generate(model, variables, PROMPTS, NEW, temperature=0, loops=1).tokens
  out = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit=rule)
  assert out.exit_depths == [1.0] * len(PROMPTS) and out.mean_exit_depth == 1.0
  assert out.tokens == one_loop
  assert one_loop != gen.generate(model, variables, PROMPTS, NEW, temperature=0).tokens


def _reference_values(logits_RBV, h_RBD, h0_BD):
  """A numpy restatement of each criterion over R loops (exits.py's docstring; the recurrent-depth
  reference's entropy-diff, kl, argmax-stability and latent-diff, started as it starts them)."""
  R, B, V = logits_RBV.shape
  out = {k: [] for k in exits.CRITERIA}
  prev_logp, prev_entropy, prev_argmax, stable = np.full((B, V), -np.log(V)), np.full(B, 100.0), \
      np.full(B, -1), np.zeros(B, int)
  prev_h = h0_BD
  for r in range(R):
    z = logits_RBV[r] - logits_RBV[r].max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp)
    entropy = -(p * logp).sum(-1)
    argmax = logp.argmax(-1)
    stable = np.where(argmax == prev_argmax, stable + 1, 0)
    h = h_RBD[r]
    out['maxprob'].append(p.max(-1))
    out['entropy'].append(entropy)
    out['entropy_change'].append(np.abs(entropy - prev_entropy))
    out['kl'].append((p * (logp - prev_logp)).sum(-1))
    out['argmax_stable'].append(stable.astype(float))
    out['latent'].append(np.linalg.norm(h - prev_h, axis=-1) / np.linalg.norm(h, axis=-1))
    out['cosine'].append((h * prev_h).sum(-1) / np.linalg.norm(h, axis=-1) /
                         np.linalg.norm(prev_h, axis=-1))
    prev_logp, prev_entropy, prev_argmax, prev_h = logp, entropy, argmax, h
  return {k: np.stack(v) for k, v in out.items()}


def test_criteria_values():
  """Each criterion's value over 4 loops equals a numpy restatement, and it fires exactly at its
  value (the threshold traced). Rows 0-1 keep one argmax over loops 2-4 (one logit raised), so
  argmax_stable counts up there."""
  rng = np.random.default_rng(0)
  R, B, V, D = 4, 4, 11, 8
  logits = rng.normal(size=(R, B, V)) * 2
  logits[1:, :2, 3] += 10.0
  h0 = rng.normal(size=(B, D))
  h = h0 + np.cumsum(rng.normal(size=(R, B, D)) * 0.5, axis=0)
  want = _reference_values(logits, h, h0)
  assert list(want['argmax_stable'][:, 0]) == [0, 0, 1, 2]
  measure = jax.jit(exits.measure, static_argnums=0)
  fires = jax.jit(exits.fires, static_argnums=0)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  for name in exits.CRITERIA:
    track, prev = exits.start(B, V), h0
    for r in range(R):
      logp = jax.nn.log_softmax(f32(logits[r]), axis=-1)
      value, track = measure(name, logp, f32(h[r]), f32(prev), track)
      prev = h[r]
      np.testing.assert_allclose(np.asarray(value), want[name][r], rtol=1e-5, atol=1e-6,
                                 err_msg=f'{name} loop {r + 1}')
      v = float(value[0])
      up = name in exits.SIMILARITIES or name == 'argmax_stable'
      for t in (v - 1e-4 * max(abs(v), 1), v + 1e-4 * max(abs(v), 1)):
        if name in exits.SIMILARITIES and t >= 1:
          continue
        got = bool(fires(name, jnp.float32(t), value)[0])
        assert got == ((v >= t) if up else (v <= t)), (name, r, t)


# Huginn's design (Geiping et al., arXiv:2502.05171): a prelude, a core looped R times that the
# prelude's output re-enters by concat injection, from a random initial state, and a coda.
RECURRENT = {'model.num_layers': K * R + 2, 'model.sharing.scheme': 'middle_cycle',
             'model.sharing.num_unique': K + 2, 'model.recurrence.injection': 'concat',
             'model.recurrence.init': 'normal'}


@pytest.fixture(scope='module')
def recurrent(tiny_config):
  return _model(tiny_config, **RECURRENT)


@pytest.mark.slow
@pytest.mark.parametrize('sampling', ['greedy', 'sampled'])
def test_never_firing_criteria_on_a_recurrent_depth_model(recurrent, sampling):
  """Loop-by-loop decoding carries the injected stream and draws each request's initial state
  as its row in the full forward: with no exit firing it is full-depth `generate`, for every
  criterion, in a static batch and under depth-wise batching (2 slots for 3 requests)."""
  model, variables = recurrent
  kw = SAMPLED if sampling == 'sampled' else dict(temperature=0.0)
  full = gen.generate(model, variables, PROMPTS, NEW, **kw).tokens
  for rule in NEVER:
    out = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit=rule, **kw)
    assert out.exit_depths == [R] * len(PROMPTS), rule
    assert out.tokens == full, rule
  served = ri.DepthwiseScheduler(model, variables, num_slots=2, max_new_tokens=NEW,
                                 num_positions=16, exit='kl:0', **kw).run(PROMPTS)
  assert served.tokens == full


@pytest.mark.slow
def test_recurrent_depth_exits_agree_across_schedulers(recurrent):
  """Firing criteria on the recurrent-depth model: every token exits after the first loop at an
  always-firing threshold, and the static batch and depth-wise batching emit the same sampled
  tokens at the same depths for a criterion that fires at different loops."""
  model, variables = recurrent
  first = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit='argmax_stable:0')
  assert first.exit_depths == [1.0] * len(PROMPTS)
  static = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit='cosine:0.5', **SAMPLED)
  served = ri.DepthwiseScheduler(model, variables, num_slots=2, max_new_tokens=NEW,
                                 num_positions=16, exit='cosine:0.5', **SAMPLED).run(PROMPTS)
  assert 1 < static.mean_exit_depth < R
  assert served.tokens == static.tokens and served.exit_depths == static.exit_depths


@pytest.mark.parametrize('loops', [1, R + 1])
def test_decoding_at_another_depth_is_the_model_of_that_depth(cycle, tiny_config, loops):
  """generate(loops=n) (Schedule(loops=n) with a cache of n loops) = the n-loop model, which
  holds the same stored sets; loops=R is the plan."""
  model, variables = cycle
  other = DecoderLM(_cfg(tiny_config, loops))
  want = gen.generate(other, variables, PROMPTS, NEW, temperature=0).tokens
  assert gen.generate(model, variables, PROMPTS, NEW, temperature=0, loops=loops).tokens == want
  assert gen.generate(model, variables, PROMPTS, NEW, temperature=0, loops=R).tokens == \
      gen.generate(model, variables, PROMPTS, NEW, temperature=0).tokens


def test_exits_up_to_a_deeper_depth(cycle):
  """--exit with --depth 4 (> R = 3): never firing is decoding at depth 4, sampled."""
  model, variables = cycle
  want = gen.generate(model, variables, PROMPTS, NEW, loops=R + 1, **SAMPLED).tokens
  out = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit='kl:0', depth=R + 1,
                               **SAMPLED)
  assert out.exit_depths == [R + 1] * len(PROMPTS) and out.tokens == want


RELAXED = {'model.sharing.scheme': 'middle_cycle', 'model.sharing.num_unique': K + 2,
           'model.num_layers': K * R + 2, 'model.sharing.lora_rank': 2,
           'model.sharing.lora_targets': 'q,v,mlp_in', 'model.sharing.untie_norms': True}


@pytest.mark.slow
def test_relaxed_model_exits_sampled_at_a_shallower_depth(tiny_config, randomized_per_layer):
  """middle_cycle with depth-wise LoRA and untied norms (randomised so that loops differ):
  a never-firing criterion with --depth 2 is sampled decoding at depth 2 (the first two loops'
  LoRA and norms, then the coda); the continuous scheduler draws the same tokens."""
  config = tiny_config(**RELAXED)
  model = DecoderLM(ModelConfig.from_config(config.model, config.train.seq_len))
  variables = randomized_per_layer(init_variables(model, jax.random.key(0)))
  want = gen.generate(model, variables, PROMPTS, NEW, loops=2, **SAMPLED).tokens
  assert want != gen.generate(model, variables, PROMPTS, NEW, **SAMPLED).tokens
  out = ri.DepthwiseScheduler(model, variables, num_slots=2, max_new_tokens=NEW,
                              num_positions=16, exit='entropy:0', depth=2, **SAMPLED).run(PROMPTS)
  assert out.tokens == want and out.exit_depths == [2.0] * len(PROMPTS)


@pytest.mark.parametrize('rule', ['latent:0.6', 'kl:0.2'])
def test_scheduler_and_static_batch_agree_on_sampled_exits(cycle, rule):
  """Mid-threshold exits (mixed depths), sampled: the continuous scheduler (2 slots, refills)
  and the lock-step batch emit the same tokens at the same depths (a request's draws and exits
  depend on the request only)."""
  model, variables = cycle
  batch = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit=rule, **SAMPLED)
  assert 1 < batch.mean_exit_depth < R and np.ptp(batch.exit_depths) > 0
  sched = ri.DepthwiseScheduler(model, variables, num_slots=2, max_new_tokens=NEW,
                                num_positions=16, exit=rule, **SAMPLED).run(PROMPTS)
  assert sched.tokens == batch.tokens and sched.exit_depths == batch.exit_depths


def test_depths_at_the_training_depth_equal_plain_eval(cycle, tiny_config, text_cfg, tmp_path):
  model, variables = cycle
  plain = evaluation.evaluate(model, variables, text_cfg, 16, 4)
  rows = evaluation.evaluate_depths(model, variables, text_cfg, 16, 4, [1, R])
  assert [r['depth'] for r in rows] == [1, R]
  assert rows[1]['eval_loss'] == plain['eval_loss']
  assert rows[1]['eval_bits_per_byte'] == plain['eval_bits_per_byte']
  assert rows[0]['eval_loss'] != plain['eval_loss']
  # FLOPs at depth n: the n-loop model's (accounting's count), forward only.
  for r in rows:
    assert r['flops_per_token'] == pytest.approx(
        accounting.flops_per_token(_cfg(tiny_config, r['depth']), 16, train=False), rel=1e-12)
  assert perf.flops_per_token_at_depth(model.cfg, 16, R, train=True) == \
      accounting.flops_per_token(model.cfg, 16)
  test_time_depth.plot_depths(rows, R, str(tmp_path / 'plot.png'))
  assert (tmp_path / 'plot.png').stat().st_size > 0


def test_bad_input_is_one_line(cycle, tiny_config):
  model, variables = cycle
  untied = DecoderLM(_cfg(tiny_config, **{'model.sharing.scheme': 'untied',
                                         'model.sharing.num_unique': 0}))
  lora = ModelConfig.from_config(tiny_config(**RELAXED).model, 32)
  umup_config = tiny_config(**{'model.num_layers': K * R, 'model.sharing.scheme': 'cycle',
                               'model.sharing.num_unique': K, 'parametrization.kind': 'umup'})
  umup = ModelConfig.from_experiment(umup_config)
  cases = [
      (lambda: test_time_depth.check_depth(umup, 1), 'which the depth changes; valid: a model'),
      (lambda: test_time_depth.check_depth(umup, R), 'which the depth changes; valid: a model'),
      (lambda: exits.parse('confidence:0.9'), 'unknown criterion; valid: maxprob:T'),
      (lambda: exits.parse('kl'), 'valid: maxprob:T'),
      (lambda: exits.parse('kl:abc'), 'not a number'),
      (lambda: exits.parse('maxprob:1.5'), 'bad threshold; valid'),
      (lambda: exits.parse('latent:-0.1'), 'bad threshold; valid'),
      (lambda: exits.parse('argmax_stable:1.5'), 'bad threshold; valid'),
      (lambda: exits.parse('cosine:-1.5'), 'bad threshold; valid'),
      (lambda: exits.parse('cosine:1.5'), 'bad threshold; valid'),
      (lambda: test_time_depth.check_flags('1,2', 2, None, False), 'exclude each other; valid'),
      (lambda: test_time_depth.check_flags('1,2', None, None, True), 'valid: --depth N'),
      (lambda: test_time_depth.check_flags(None, None, 'kl:0.1', False), 'valid: with --prompt'),
      (lambda: test_time_depth.parse_depths('1,x'), 'valid: comma-separated'),
      (lambda: test_time_depth.parse_depths('0,2'), 'valid: distinct loop counts >= 1'),
      (lambda: test_time_depth.check_depth(model.cfg, 0), 'valid: an integer >= 1'),
      (lambda: test_time_depth.check_depth(untied.cfg, 2, '--depths'), 'looped cycle segment'),
      (lambda: test_time_depth.looped_shape(untied.cfg, '--exit'), 'looped cycle segment'),
      (lambda: test_time_depth.check_depth(lora, R + 1), f'valid: 1 .. {R}'),
      (lambda: gen.generate(model, variables, PROMPTS, 2, loops=0), 'valid: an integer >= 1'),
      (lambda: gen.generate(untied, {}, PROMPTS, 2, loops=2), 'looped cycle segment'),
      (lambda: ri.generate_early_exit(model, variables, PROMPTS, 2, exit='top:1'),
       'unknown criterion'),
      (lambda: ri.generate_early_exit(model, variables, PROMPTS, 2, exit='kl:0.1',
                                      exit_threshold=0.5), 'valid: one of them'),
      (lambda: ri.generate_early_exit(model, variables, PROMPTS, 2, exit='kl:0.1', depth=0),
       'valid: an integer >= 1'),
      (lambda: ri.generate_early_exit(model, variables, PROMPTS, 2, temperature=-1),
       'temperature'),
  ]
  for fn, match in cases:
    with pytest.raises(ConfigError, match=match.replace('.', r'\.')) as e:
      fn()
    assert '\n' not in str(e.value)


@pytest.mark.slow
def test_workdir_refusals_come_before_restoring(tiny_config, tmp_path):
  """eval.py's library side refuses from config.json alone (the workdir holds no checkpoint,
  so anything that got as far as restoring would fail differently)."""
  from sharenet.main import eval_workdir
  for scheme, unique in (('untied', 0), ('cycle', K)):
    workdir = tmp_path / scheme
    workdir.mkdir()
    config = tiny_config(**{'model.num_layers': K * R, 'model.sharing.scheme': scheme,
                            'model.sharing.num_unique': unique})
    (workdir / 'config.json').write_text(json.dumps(config.to_dict()))
    gen_kw = dict(max_new_tokens=2, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                  num_samples=1, eos_id=None)
    cases = [
        (lambda: eval_workdir.generate_from_workdir(str(workdir), None, {}, ['ab'], **gen_kw,
                                                   exit='maxprob:2'), 'bad threshold'),
        (lambda: eval_workdir.evaluate_workdir_depths(str(workdir), None, {}, [0]),
         'looped cycle segment' if scheme == 'untied' else 'valid: an integer >= 1'),
        (lambda: eval_workdir.generate_from_workdir(str(workdir), None, {}, ['ab'], **gen_kw,
                                                   depth=0),
         'looped cycle segment' if scheme == 'untied' else 'valid: an integer >= 1')]
    if scheme == 'untied':
      cases.append((lambda: eval_workdir.generate_from_workdir(
          str(workdir), None, {}, ['ab'], **gen_kw, exit='kl:0.1'),
          'needs exactly one looped cycle segment'))
    for fn, match in cases:
      with pytest.raises(ConfigError, match=match) as e:
        fn()
      assert '\n' not in str(e.value) and 'checkpoint' not in str(e.value)


@pytest.mark.slow
def test_eval_cli(tmp_path, tiny_config, subprocess_env, repo_root):
  """eval.py on a universal model (trained in this process): --depths at the training depth
  prints plain eval's loss, writes the plot; --prompt --exit prints mean_exit_loops; --depth
  with --depths is one line."""
  from sharenet.train import loop
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(tiny_config(**{
      'model.num_layers': 3, 'model.sharing.scheme': 'universal',
      'model.sharing.num_unique': 1, 'train.steps': 2, 'train.seq_len': 16,
      'train.eval_batch_size': 64}), workdir)
  run = lambda *a: subprocess.run([sys.executable, os.path.join(repo_root, 'eval.py'),
                                   f'--workdir={workdir}', *a], capture_output=True, text=True,
                                  env=subprocess_env, timeout=300)
  # train.py's final evaluation (metrics.jsonl, unrounded), which plain eval.py equals: the same
  # evaluation.evaluate on the same checkpoint, accumulated on the host in float64.
  from sharenet.train.metrics import read_metrics
  plain = [r for r in read_metrics(workdir) if 'eval_loss' in r][-1]
  out = run('--depths', '1,3')
  rows = [json.loads(line) for line in out.stdout.strip().splitlines()]
  assert [r['depth'] for r in rows] == [1, 3], out.stderr
  assert rows[1]['eval_loss'] == plain['eval_loss']
  assert rows[0]['flops_per_token'] < rows[1]['flops_per_token']
  assert os.path.getsize(os.path.join(workdir, test_time_depth.PLOT)) > 0
  gen_out = run('--prompt', 'ab', '--max_new_tokens', '3', '--exit', 'entropy:0',
                '--temperature', '0.7', '--top_k', '20')
  row = json.loads(gen_out.stdout.strip().splitlines()[-1])
  assert row['mean_exit_loops'] == 3 and row['num_tokens'] == 3, gen_out.stderr
  bad = run('--depths', '1,2', '--depth', '2')
  assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
  assert 'exclude each other' in bad.stderr


@pytest.mark.slow
def test_exits_on_a_trained_recurrent_depth_model(tmp_path, tiny_config, subprocess_env,
                                                  repo_root):
  """eval.py --exit on a model trained with concat injection and a random initial state: every
  criterion at a never-firing threshold prints what full-depth generation prints (two sampled
  continuations per prompt, so two rows with their own noise), and eval.py --exit kl:0.01 runs."""
  from sharenet.main import eval_workdir
  from sharenet.train import loop
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(tiny_config(**{**RECURRENT, 'train.steps': 2, 'train.seq_len': 16,
                                         'train.eval_batch_size': 64}), workdir)
  kw = dict(max_new_tokens=4, temperature=0.8, top_k=0, top_p=1.0, seed=3, num_samples=2,
            eos_id=None)
  text = lambda rows: [r['text'] for r in rows]
  full = eval_workdir.generate_from_workdir(workdir, None, {}, ['ab', 'the'], **kw)
  for rule in NEVER:
    rows = eval_workdir.generate_from_workdir(workdir, None, {}, ['ab', 'the'], **kw, exit=rule)
    assert text(rows) == text(full), rule
    assert [r['mean_exit_loops'] for r in rows] == [R] * 4, rule
  out = subprocess.run([sys.executable, os.path.join(repo_root, 'eval.py'), f'--workdir={workdir}',
                        '--prompt', 'ab', '--max_new_tokens', '3', '--exit', 'kl:0.01'],
                       capture_output=True, text=True, env=subprocess_env, timeout=300)
  row = json.loads(out.stdout.strip().splitlines()[-1])
  assert row['exit'] == 'kl:0.01' and 1 <= row['mean_exit_loops'] <= R, out.stderr
