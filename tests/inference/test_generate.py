"""Generation (sharenet/inference/generate.py): the KV-cached decode against full recomputation
under
every kind of sharing plan, the sampling filters on a hand-made distribution, and eval.py's
--prompt command line (output and one-line errors)."""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.inference import generate as gen
from sharenet.train import trainer
from sharenet.errors import ConfigError
from sharenet.models import ModelConfig
from sharenet.models.lm import init_cache
from sharenet.models.params import PER_LAYER

PROMPTS = ([3, 141, 59, 26, 5], [27, 18])   # two lengths: left padding in one batch
NEW = 6

PLANS = {
    'untied': {},
    'cycle_2x3': {'model.num_layers': 6, 'model.sharing.scheme': 'cycle',
                  'model.sharing.num_unique': 2},
    'cycle_flat': {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
                   'model.sharing.num_unique': 2, 'model.scan_lowering': 'flat'},
    'sequence_loop': {'model.num_layers': 4, 'model.sharing.scheme': 'sequence',
                      'model.sharing.num_unique': 2, 'model.scan_layers': False},
    'middle_cycle_lora': {'model.num_layers': 5, 'model.sharing.scheme': 'middle_cycle',
                          'model.sharing.num_unique': 3, 'model.sharing.lora_rank': 2,
                          'model.sharing.untie_norms': True},
    'explicit_learned': {'model.num_layers': 3, 'model.sharing.scheme': 'explicit',
                         'model.sharing.pattern': '0,1,0', 'model.position': 'learned',
                         'model.max_len': 64},
    'layernorm_l2qk_mup': {'model.norm.kind': 'layernorm', 'model.norm.qk_norm': 'l2',
                           'parametrization.kind': 'mup', 'model.num_kv_heads': 1},
    'fused_norm_kernels': {'model.kernels': 'pallas'},   # Pallas residual-add + norm (interpret)
    'umup_cycle': {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
                   'model.sharing.num_unique': 2, 'parametrization.kind': 'umup'},
    # SReT's sliced loops: the cache masks by slice, the full forward folds slices of 8
    # CEM: values are the keys (a K-only cache), W_O = W_Q^T, the tied MLP
    'cem_tied': {'model.attention_sharing': 'cem', 'model.mlp_tied': True},
    'cycle_sliced': {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
                     'model.sharing.num_unique': 2, 'model.loop_slices': '4,1'},
}
SEQ_LEN = 32   # configs/tiny.py train.seq_len


def _experiment(tiny_config, overrides, seed=0):
  """(model, effective variables) of a freshly initialized tiny config; the per-layer
  collection (LoRA factors, untied gains) is perturbed so that it matters."""
  config = tiny_config(**overrides)
  mcfg = ModelConfig.from_experiment(config)
  exp = trainer.setup(config, mcfg)
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(seed), exp.tr, exp.pz)
  params = dict(state.params)
  if PER_LAYER in params:
    leaves, treedef = jax.tree.flatten(params[PER_LAYER])
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    params[PER_LAYER] = jax.tree.unflatten(
        treedef, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
  state = state.replace(params=params)
  return exp.model, trainer.effective_params(state, exp.tr, exp.pz)


def _greedy_by_recomputation(forward, variables, prompt, n):
  """argmax of a full (uncached) `forward` (jitted model.apply) on the growing sequence, n
  times. The sequence is right-padded to the training length (causal: the padding does not
  change earlier logits; u-muP's attention output scale is the training length's, as in the
  cached pass)."""
  width = SEQ_LEN
  assert len(prompt) + n <= width
  seq = list(prompt)
  for _ in range(n):
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(seq)] = seq
    logits = forward(variables, jnp.asarray(tokens))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


@pytest.mark.slow
@pytest.mark.parametrize('plan', list(PLANS))
def test_cached_greedy_equals_recomputation(tiny_config, plan):
  model, variables = _experiment(tiny_config, PLANS[plan])
  out = gen.generate(model, variables, PROMPTS, NEW, temperature=0.0)
  forward = jax.jit(model.apply)   # one program for every prompt
  for prompt, tokens in zip(PROMPTS, out.tokens):
    assert tokens == _greedy_by_recomputation(forward, variables, prompt, NEW)
  assert len(set(out.tokens[0] + out.tokens[1])) > 1   # not a constant sequence


def test_one_cache_per_applied_layer(tiny_config):
  """A cycle plan applying 2 sets 3 times keeps 6 caches, and the applications of one set
  hold different keys (their inputs differ)."""
  model, variables = _experiment(tiny_config, PLANS['cycle_2x3'])
  cache = init_cache(model.cfg, 1, 4)
  assert sum(c.k_BSKD.shape[0] for c in cache.layers) == 6
  _, cache = model.apply(variables, jnp.array([[1, 2, 3, 4]]), cache=cache,
                         positions_BT=jnp.arange(4, dtype=jnp.int32)[None])
  (k_LBSKD,) = [c.k_BSKD for c in cache.layers]
  assert int(cache.index) == 4
  # layers 0, 2, 4 apply set 0: same weights, different caches
  assert not np.allclose(k_LBSKD[0], k_LBSKD[2]) and not np.allclose(k_LBSKD[2], k_LBSKD[4])
  assert np.all(np.abs(np.asarray(k_LBSKD)).sum(axis=(1, 3, 4)) > 0)   # every slot written


def test_sampling_reproducible_and_seed_dependent(tiny_config):
  model, variables = _experiment(tiny_config, {})
  run = functools.partial(gen.generate, model, variables, PROMPTS, 12, temperature=1.0,
                          top_k=50, top_p=0.95)
  a, b, c = (run(rng=jax.random.key(s)).tokens for s in (0, 0, 1))
  assert a == b
  assert a != c
  greedy = gen.generate(model, variables, PROMPTS, 12, temperature=0.0).tokens
  assert gen.generate(model, variables, PROMPTS, 12, temperature=0.0,
                      rng=jax.random.key(7)).tokens == greedy


def test_end_token_stops_a_sequence(tiny_config):
  model, variables = _experiment(tiny_config, {})
  (greedy,) = gen.generate(model, variables, PROMPTS[:1], 8, temperature=0.0).tokens
  eos = greedy[3]
  out = gen.generate(model, variables, PROMPTS[:1], 8, temperature=0.0, eos_id=eos).tokens[0]
  assert out == greedy[:greedy.index(eos)]


def test_one_program_per_prompt_bucket(tiny_config):
  model, variables = _experiment(tiny_config, {})
  first = gen.generate(model, variables, [[1] * 5, [2] * 2], 4, temperature=0.0)
  same_bucket = gen.generate(model, variables, [[3] * 7, [4] * 8], 4, temperature=0.0)
  other_bucket = gen.generate(model, variables, [[3] * 9, [4] * 2], 4, temperature=0.0)
  assert first.compile_seconds > 0 and other_bucket.compile_seconds > 0
  assert same_bucket.compile_seconds == 0


# A hand-made distribution, deliberately not sorted by token id.
PROBS = np.array([0.15, 0.05, 0.5, 0.1, 0.2])


@pytest.mark.parametrize('top_k,top_p,kept', [
    (0, 1.0, [0, 1, 2, 3, 4]),
    (2, 1.0, [2, 4]),
    (3, 1.0, [0, 2, 4]),
    (0, 0.5, [2]),          # 0.5 alone reaches 0.5
    (0, 0.6, [2, 4]),       # 0.5 < 0.6 <= 0.7
    (0, 0.75, [0, 2, 4]),   # 0.7 < 0.75 <= 0.85
    (0, 0.01, [2]),         # always the most likely token
    (3, 0.6, [2, 4]),
])
def test_filters_keep_the_right_tokens_renormalized(top_k, top_p, kept):
  logits = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]
  probs = np.asarray(jax.nn.softmax(gen.filter_logits(logits, top_k, top_p)))[0]
  want = np.zeros_like(PROBS)
  want[kept] = PROBS[kept] / PROBS[kept].sum()
  np.testing.assert_allclose(probs, want, atol=1e-6)


def test_sample_frequencies_follow_the_filtered_distribution():
  n = 20000
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (n, 5))
  tokens = np.asarray(gen.sample(logits, jax.random.key(0), 1.0, top_k=2))
  counts = np.bincount(tokens, minlength=5) / n
  np.testing.assert_allclose(counts, [0, 0, 0.5 / 0.7, 0, 0.2 / 0.7], atol=0.015)
  assert np.all(np.asarray(gen.sample(logits[:3] * 5, jax.random.key(1), 0.0)) == 2)  # greedy


def test_bad_settings_are_config_errors(tiny_config):
  model, variables = _experiment(tiny_config, {'model.position': 'learned',
                                               'model.max_len': 16})
  for kwargs, match in [
      (dict(prompts=[[]]), 'empty'),
      (dict(prompts=[[1] * 12], max_new_tokens=5), 'max_len=16'),
      (dict(temperature=-0.5), 'temperature'),
      (dict(top_p=0.0), 'top_p'),
      (dict(top_k=-1), 'top_k'),
      (dict(prompts=[[300]]), 'vocab_size'),
  ]:
    args = dict(prompts=[[1, 2]], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
      gen.generate(model, variables, args.pop('prompts'), args.pop('max_new_tokens'), **args)


def test_buckets_and_left_padding():
  assert [gen.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
  tokens, positions = gen.left_pad([[7, 8, 9], [5]], 4)
  assert tokens.tolist() == [[0, 7, 8, 9], [0, 0, 0, 5]]
  assert positions.tolist() == [[-1, 0, 1, 2], [-1, -1, -1, 0]]
  assert gen.decode(gen.encode('né') + [0xff]) == 'né\\xff'


# ----------------------------------------------------------------------------- 2-device mesh

MESH_PLAN = {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
             'model.sharing.num_unique': 2}
MESHES = {'tensor=2': (1, 1, 2), 'fsdp=2': (1, 2, 1), 'data=2': (2, 1, 1)}


def _mesh_tokens(tiny_config, mesh_sizes=None):
  """Greedy and sampled tokens of a cycle model, its params sharded over `mesh_sizes`
  ((data, fsdp, tensor)) under the logical rules, or on one device (None)."""
  import contextlib
  from sharenet.train import sharding
  from sharenet.models.lm import logical_axes
  model, variables = _experiment(tiny_config, MESH_PLAN)
  ctx = contextlib.nullcontext()
  if mesh_sizes is not None:
    c = tiny_config(**MESH_PLAN)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh_sizes
    mesh, rules = sharding.make_mesh(c.mesh), sharding.rules_of(c.mesh)
    specs = sharding.param_specs(logical_axes(model), variables, mesh, rules)
    variables = jax.tree.map(lambda x, s: jax.device_put(x, jax.NamedSharding(mesh, s)),
                             variables, specs)
    split = [x for x in jax.tree.leaves(variables) if x.sharding.shard_shape(x.shape) != x.shape]
    assert bool(split) == (mesh_sizes != (2, 1, 1))   # data=2: replicated params
    ctx = sharding.activate(mesh, rules)
  with ctx:
    greedy = gen.generate(model, variables, PROMPTS, 8, temperature=0.0).tokens
    sampled = gen.generate(model, variables, PROMPTS, 8, temperature=1.0, top_k=40,
                           rng=jax.random.key(3)).tokens
  return {'greedy': greedy, 'sampled': sampled}


@pytest.mark.slow
def test_two_devices_give_the_tokens_of_one(tiny_config, repo_root, subprocess_env, tmp_path):
  out = tmp_path / 'tokens.json'
  env = dict(subprocess_env)
  env['XLA_FLAGS'] = env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2'
  res = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                       text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  got = json.loads(out.read_text())
  want = _mesh_tokens(tiny_config)
  for name in MESHES:
    assert got[name] == want, name


# ----------------------------------------------------------------------------- command line


@pytest.fixture(scope='module')
def workdir(tmp_path_factory, train_cmd, subprocess_env):
  """A tiny model trained for 20 steps."""
  wd = str(tmp_path_factory.mktemp('gen') / 'run')
  res = subprocess.run(train_cmd(wd, '--config.train.steps=20'), env=dict(subprocess_env),
                       capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  return wd


def _eval(repo_root, env, *flags):
  return subprocess.run([sys.executable, os.path.join(repo_root, 'eval.py'), *flags],
                        env=dict(env), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_prints_json_matching_the_library(workdir, repo_root, subprocess_env, tmp_path):
  prompt_file = tmp_path / 'prompts.txt'
  prompt_file.write_text('def fib(\nThe\n')
  res = _eval(repo_root, subprocess_env, f'--workdir={workdir}',
              f'--prompt_file={prompt_file}', '--max_new_tokens=12', '--temperature=0',
              '--num_samples=2')
  assert res.returncode == 0, res.stderr[-2000:]
  rows = [json.loads(line) for line in res.stdout.splitlines()]
  assert [(r['prompt'], r['sample']) for r in rows] == [
      ('def fib(', 0), ('def fib(', 1), ('The', 0), ('The', 1)]
  assert all(r['num_tokens'] == 12 and r['tokens_per_sec'] > 0 for r in rows)
  from sharenet.main import eval_workdir
  loaded = eval_workdir.load_for_generation(workdir)
  want = gen.generate(loaded.model, loaded.variables, [gen.encode('def fib('),
                                                       gen.encode('The')], 12, temperature=0)
  assert [r['text'] for r in rows] == [gen.decode(want.tokens[i]) for i in (0, 0, 1, 1)]

  res = _eval(repo_root, subprocess_env, f'--workdir={workdir}', '--prompt=ab',
              '--max_new_tokens=16', '--temperature=0.8', '--top_k=40', '--top_p=0.95',
              '--seed=3', '--num_samples=2')
  assert res.returncode == 0, res.stderr[-2000:]
  rows = [json.loads(line) for line in res.stdout.splitlines()]
  assert len(rows) == 2 and all(isinstance(r['text'], str) for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize('case', ['empty_prompt', 'too_long', 'no_checkpoint',
                                  'negative_temperature'])
def test_cli_bad_input_is_one_line_exit_2(case, workdir, repo_root, subprocess_env, tmp_path):
  wd, flags = workdir, []
  if case == 'empty_prompt':
    flags, match = ['--prompt='], 'empty prompt'
  elif case == 'too_long':
    flags, match = ['--prompt=' + 'a' * 2100], 'max_len=2048'
  elif case == 'no_checkpoint':
    wd = str(tmp_path)
    with open(os.path.join(workdir, 'config.json')) as f, \
        open(os.path.join(wd, 'config.json'), 'w') as g:
      g.write(f.read())
    flags, match = ['--prompt=ab'], 'holds no checkpoint'
  else:
    flags, match = ['--prompt=ab', '--temperature=-1'], 'temperature'
  res = _eval(repo_root, subprocess_env, f'--workdir={wd}', '--max_new_tokens=4', *flags)
  assert res.returncode == 2, res.stderr[-2000:]
  lines = res.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error:') and match in lines[0], lines


if __name__ == '__main__':   # the 2-device subprocess of test_two_devices_give_the_tokens_of_one
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import conftest
  assert jax.device_count() == 2, jax.devices()
  result = {name: _mesh_tokens(conftest.make_tiny_config, sizes)
            for name, sizes in MESHES.items()}
  with open(sys.argv[1], 'w') as f:
    json.dump(result, f)
