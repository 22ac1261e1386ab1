"""KV across loops, model.kv_sharing=first (sharenet/models/kv_sharing.py): the decode cache of
the looped segment holds one loop (1/R), cached greedy decoding equals the full forward's argmax,
loop-by-loop inference with early exits equals the full forward at each exit depth, the full
forward equals a hand-written one (and differs from kv_sharing=none except at one loop), bad
input is one line, and train.py trains with it."""
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.train import experiment, workdir_io
from sharenet.main import eval_workdir
from sharenet.inference import generate as gen
from sharenet.inference import loop_by_loop as ri
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, accounting
from sharenet.models.lm import init_cache, init_variables, kv_cache_bytes_per_token
from sharenet.models.loops import Schedule

PROMPTS = ([3, 141, 59, 26, 5], [27, 18])
NEW = 5
SEQ_LEN = 32   # configs/tiny.py train.seq_len
PLANS = {
    # prelude + 3 loops of one set + coda; per-layer LoRA (k and v too) and untied norms
    'middle_cycle_lora': {'model.num_layers': 5, 'model.sharing.scheme': 'middle_cycle',
                          'model.sharing.num_unique': 3, 'model.sharing.lora_rank': 2,
                          'model.sharing.lora_targets': 'q,k,v', 'model.sharing.untie_norms': True},
    # values are the keys (the cache holds raw keys, placed again), QK-norm, GQA, flat lowering
    'cycle_values_are_keys': {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
                              'model.sharing.num_unique': 2, 'model.attention_sharing': 'kv_shared',
                              'model.norm.qk_norm': 'rms', 'model.num_kv_heads': 1,
                              'model.scan_lowering': 'flat'},
}
# One set looped twice, no norms, no positions, GELU: small enough to write out by hand.
HAND = {'model.num_layers': 2, 'model.sharing.scheme': 'universal', 'model.sharing.num_unique': 1,
        'model.norm.kind': 'none', 'model.position': 'none', 'model.mlp': 'gelu'}


def _cfg(tiny_config, overrides, kv='first'):
  return ModelConfig.from_experiment(tiny_config(**overrides, **{'model.kv_sharing': kv}))


def _variables(cfg, randomize):
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  return randomize(v) if 'per_layer' in v else v


@pytest.fixture(scope='module', params=list(PLANS))
def plan(request, tiny_config, randomized_per_layer):
  """(name, kv_sharing=first model, its variables); the per-layer parts randomised."""
  cfg = _cfg(tiny_config, PLANS[request.param])
  return request.param, DecoderLM(cfg), _variables(cfg, randomized_per_layer)


def test_cache_holds_one_loop_of_the_looped_segment(tiny_config):
  """1/R of the looped segment's cache (shapes and bytes), the prelude and coda untouched, at
  any decoding depth."""
  first = _cfg(tiny_config, PLANS['middle_cycle_lora'])
  none = _cfg(tiny_config, PLANS['middle_cycle_lora'], 'none')
  layers = lambda cfg, **kw: [c.k_BSKD.shape[0] for c in init_cache(cfg, 2, 8, **kw).layers]
  assert layers(none) == [1, 3, 1] and layers(first) == [1, 1, 1]   # R = 3 loops of K = 1
  per_layer = 2 * none.kv_heads * none.d_head * 4   # keys and values, float32
  assert kv_cache_bytes_per_token(none) == 5 * per_layer
  assert kv_cache_bytes_per_token(first) == 3 * per_layer
  flat = _cfg(tiny_config, PLANS['cycle_values_are_keys'])
  flat_none = _cfg(tiny_config, PLANS['cycle_values_are_keys'], 'none')
  assert layers(flat_none) == [4] and layers(flat) == [2]         # R = 2 loops of K = 2
  assert layers(flat_none, loops=5) == [10] and layers(flat, loops=5) == [2]
  assert kv_cache_bytes_per_token(flat_none) == 2 * kv_cache_bytes_per_token(flat)
  assert kv_cache_bytes_per_token(flat) == 2 * flat.kv_heads * flat.d_head * 4   # keys only
  assert kv_cache_bytes_per_token(flat, loops=5) == kv_cache_bytes_per_token(flat)
  # the later loops project no keys or values: (R - 1) K = 2 layers' k and v, 2 FLOPs a weight
  D, KD = none.d_model, none.kv_heads * none.d_head
  assert accounting.flops_per_token(none, 32, train=False) - \
      accounting.flops_per_token(first, 32, train=False) == 2 * 2 * (2 * D * KD)


def _greedy_by_recomputation(model, variables, prompt, n, schedule=Schedule()):
  """argmax of the full forward on the growing sequence (right-padded: causal), n times."""
  forward = jax.jit(lambda v, t: model.apply(v, t, schedule=schedule))
  seq = list(prompt)
  for _ in range(n):
    tokens = np.zeros((1, SEQ_LEN), np.int32)
    tokens[0, :len(seq)] = seq
    seq.append(int(jnp.argmax(forward(variables, jnp.asarray(tokens))[0, len(seq) - 1])))
  return seq[len(prompt):]


@pytest.mark.slow
def test_cached_greedy_equals_full_forward(plan):
  name, model, variables = plan
  out = gen.generate(model, variables, PROMPTS, NEW, temperature=0.0)
  for prompt, tokens in zip(PROMPTS, out.tokens):
    assert tokens == _greedy_by_recomputation(model, variables, prompt, NEW)
  assert len(set(out.tokens[0] + out.tokens[1])) > 1   # not a constant sequence
  assert out.kv_bytes_per_token == kv_cache_bytes_per_token(model.cfg)
  if name == 'cycle_values_are_keys':   # decoding at another depth reads the same one loop
    deeper = gen.generate(model, variables, PROMPTS[:1], NEW, temperature=0.0, loops=3)
    assert deeper.tokens[0] == _greedy_by_recomputation(model, variables, PROMPTS[0], NEW,
                                                        Schedule(loops=3))


@pytest.mark.slow
def test_loop_by_loop_inference_never_exiting_is_generation(tiny_config, randomized_per_layer):
  """loop_by_loop.py with a slot holding one loop's rows: a criterion that never fires
  decodes what generate.py decodes (prelude, coda, LoRA and untied norms included)."""
  cfg = _cfg(tiny_config, PLANS['middle_cycle_lora'])
  model, variables = DecoderLM(cfg), _variables(cfg, randomized_per_layer)
  out = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit_threshold=1.0)
  assert out.tokens == gen.generate(model, variables, PROMPTS, NEW, temperature=0.0).tokens
  assert out.mean_exit_depth == 3


@pytest.mark.slow
def test_early_exits_equal_the_full_forward_at_each_exit_depth(tiny_config):
  """Only the first loop's keys and values reach other tokens, so with no coda a token's logits
  after loop r do not depend on where the tokens before it exited: each emitted token is the
  argmax of the full forward at the depth its criterion (maxprob) picks from that forward."""
  cfg = _cfg(tiny_config, {'model.num_layers': 6, 'model.sharing.scheme': 'cycle',
                           'model.sharing.num_unique': 2})   # R = 3
  model = DecoderLM(cfg)
  variables = init_variables(model, jax.random.key(0))
  threshold, n = 0.05, 8   # exits at every depth for these weights (asserted below)
  out = ri.generate_early_exit(model, variables, PROMPTS, n, exit=f'maxprob:{threshold}')
  depths = []
  for prompt, tokens in zip(PROMPTS, out.tokens):
    seq = np.zeros((1, SEQ_LEN), np.int32)
    seq[0, :len(prompt) + n] = prompt + tokens
    probs = [jax.nn.softmax(model.apply(variables, jnp.asarray(seq), schedule=Schedule(loops=r))
                            [0], axis=-1) for r in (1, 2, 3)]
    for i, token in enumerate(tokens):
      t = len(prompt) - 1 + i
      d = next((r for r in (1, 2) if float(probs[r - 1][t].max()) >= threshold), 3)
      assert token == int(jnp.argmax(probs[d - 1][t])), (prompt, i, d)
      depths.append(d)
  assert len(set(depths)) > 1 and np.isclose(np.mean(depths), out.mean_exit_depth)


@pytest.mark.slow
def test_differs_from_none_except_at_one_loop(plan):
  """Not a silent no-op: the later loops change the logits (from the first position on: its
  only value is the first loop's); one loop (R = 1) has no later loop to share with."""
  _, model, variables = plan
  none = DecoderLM(model.cfg.derive(kv_sharing='none'))
  tokens = jnp.asarray([[3, 141, 59, 26, 5, 9, 2, 6]])
  first_BTV, none_BTV = model.apply(variables, tokens), none.apply(variables, tokens)
  assert float(jnp.min(jnp.max(jnp.abs(first_BTV - none_BTV), axis=-1))) > 1e-3
  one = Schedule(loops=1)
  np.testing.assert_allclose(model.apply(variables, tokens, schedule=one),
                             none.apply(variables, tokens, schedule=one), rtol=1e-5, atol=1e-5)


def _hand_forward(p, tokens_BT, share: bool, scale: float):
  """Embedding -> two loops of one block (x + attn(x), then x + mlp(x)) -> readout, written
  out; `share`: the second loop's attention reads the first loop's keys and values."""
  block = jax.tree.map(lambda a: a[0], p['stack']['segment_0']['level']['block'])
  a, m = block['attn'], block['mlp']
  T = tokens_BT.shape[1]
  causal_TT = np.tril(np.ones((T, T), bool))

  def attn(xq_BTD, xkv_BTD):
    q = jnp.einsum('btd,dhk->bthk', xq_BTD, a['q']['kernel'])
    k = jnp.einsum('btd,dhk->bthk', xkv_BTD, a['k']['kernel'])
    v = jnp.einsum('btd,dhk->bthk', xkv_BTD, a['v']['kernel'])
    logits = jnp.where(causal_TT, jnp.einsum('bthk,bshk->bhts', q, k) * scale, -jnp.inf)
    out = jnp.einsum('bhts,bshk->bthk', jax.nn.softmax(logits, axis=-1), v)
    return jnp.einsum('bthk,hkd->btd', out, a['o']['kernel'])

  mlp = lambda x: jax.nn.gelu(x @ m['wi']['kernel']) @ m['wo']['kernel']
  x0 = p['embed']['embedding'][tokens_BT]
  x1 = x0 + attn(x0, x0)
  x1 = x1 + mlp(x1)
  x2 = x1 + attn(x1, x0 if share else x1)   # the first loop's keys and values came from x0
  x2 = x2 + mlp(x2)
  return x2 @ p['readout']['kernel']


@pytest.mark.slow
def test_full_forward_and_gradient_equal_hand_computation(tiny_config):
  cfg = _cfg(tiny_config, HAND)
  model, variables = DecoderLM(cfg), init_variables(DecoderLM(cfg), jax.random.key(3))
  tokens = jnp.asarray([[5, 17, 200, 3, 99, 42], [1, 2, 3, 4, 5, 6]])
  with jax.default_matmul_precision('highest'):
    hand = _hand_forward(variables['params'], tokens, True, cfg.attn_mult)
    np.testing.assert_allclose(model.apply(variables, tokens), hand, rtol=1e-4, atol=1e-4)
    unshared = _hand_forward(variables['params'], tokens, False, cfg.attn_mult)
    assert float(jnp.max(jnp.abs(hand - unshared))) > 1e-2
    # the gradient reaches the first loop's key and value projections through the later loop
    w_BTV = jax.random.normal(jax.random.key(4), hand.shape)
    g = jax.grad(lambda v: jnp.sum(model.apply(v, tokens) * w_BTV))(variables)
    g_hand = jax.grad(lambda p: jnp.sum(_hand_forward(p, tokens, True, cfg.attn_mult) * w_BTV))(
        variables['params'])
  for got, want in zip(jax.tree.leaves(g['params']), jax.tree.leaves(g_hand)):   # float32 sums
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize('lowering', [{'model.scan_lowering': 'flat'},
                                      {'model.scan_layers': False}])
@pytest.mark.slow
def test_lowerings_agree_and_sow(tiny_config, lowering):
  """Flat and the Python loop compute the nested function; a coordinate check's intermediates
  come back in the lowering's layout (as without kv sharing)."""
  base = {'model.num_layers': 4, 'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2}
  nested = _cfg(tiny_config, base)
  other = _cfg(tiny_config, {**base, **lowering})
  v = init_variables(DecoderLM(other), jax.random.key(0))
  tokens = jnp.asarray([[3, 141, 59, 26, 5, 9]])
  if 'model.scan_lowering' in lowering:   # the same stored tree
    np.testing.assert_allclose(DecoderLM(other).apply(v, tokens),
                               DecoderLM(nested).apply(v, tokens), rtol=1e-5, atol=1e-5)
  shapes = lambda cfg: jax.tree.map(jnp.shape, DecoderLM(cfg).apply(
      v, tokens, mutable=['intermediates'])[1])
  assert shapes(other) == shapes(other.derive(kv_sharing='none'))


@pytest.mark.parametrize('overrides,match', [
    ({'model.kv_sharing': 'all'}, "model.kv_sharing='all' is unknown; valid: none, first"),
    ({'model.kv_sharing': 'first'}, 'untied'),   # the tiny config's plan shares nothing
    ({'model.kv_sharing': 'first', 'model.num_layers': 4, 'model.sharing.scheme': 'sequence',
      'model.sharing.num_unique': 2}, 'sequence'),
    ({'model.kv_sharing': 'first', 'model.sharing.scheme': 'cycle',
      'model.sharing.num_unique': 1, 'model.routing.kind': 'token_choice'}, 'routing'),
    ({'model.kv_sharing': 'first', 'model.sharing.scheme': 'cycle',
      'model.sharing.num_unique': 1, 'model.recurrence.depth': 'poisson_lognormal',
      'model.recurrence.mean': 2.0, 'model.recurrence.backprop': 1}, 'no-grad prefix'),
])
def test_bad_input_is_one_line(tiny_config, overrides, match):
  config = tiny_config(**overrides)
  for check in (experiment.validate, ModelConfig.from_experiment):   # table, then the model
    with pytest.raises(ConfigError, match=match) as e:
      check(config)
    assert '\n' not in str(e.value)


def test_a_no_grad_prefix_at_a_fixed_depth_is_refused(tiny_config):
  base = {'model.num_layers': 4, 'model.sharing.scheme': 'universal',
          'model.sharing.num_unique': 1, 'model.kv_sharing': 'first'}
  with pytest.raises(ConfigError, match='a no-grad prefix would hold the first loop') as e:
    ModelConfig.from_experiment(tiny_config(**base, **{'model.recurrence.backprop': 2}))
  assert '\n' not in str(e.value)
  assert ModelConfig.from_experiment(tiny_config(**base, **{'model.recurrence.backprop': 4}))


@pytest.mark.slow
def test_train_cli_and_generation_report(tmp_path, train_cmd, subprocess_env):
  """train.py trains a kv_sharing=first model (one step); generation from its workdir reports
  the cache's bytes per token, 1/R of the looped segment's."""
  workdir = str(tmp_path / 'run')
  flags = ['--config.model.kv_sharing=first', '--config.model.num_layers=4',
           '--config.model.sharing.scheme=cycle', '--config.model.sharing.num_unique=2',
           '--config.train.steps=1', '--config.train.eval_every=1',
           '--config.train.checkpoint_every=1']
  out = subprocess.run(train_cmd(workdir, *flags), env=dict(subprocess_env),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'loss' in json.loads(out.stdout.strip().splitlines()[-1])
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['model']['kv_sharing'] == 'first'
  (row,) = eval_workdir.generate_from_workdir(
      workdir, None, {}, ['ab'], max_new_tokens=3, temperature=0.0, top_k=0, top_p=1.0, seed=0,
      num_samples=1, eos_id=None)
  cfg = ModelConfig.from_experiment(workdir_io.load_config(workdir))
  assert row['kv_bytes_per_token'] == kv_cache_bytes_per_token(cfg) == \
      kv_cache_bytes_per_token(cfg.derive(kv_sharing='none')) // 2
