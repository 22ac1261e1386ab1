"""Routed decoding (sharenet/models/routed_decoding.py): Mixture-of-Recursions models generate
with recursion-wise KV caches. Token choice is causal, so cached greedy decoding equals the
full forward's argmax token for token; expert choice decodes by the router's BCE-trained
threshold, deterministically, and its caches hold a token only at the recursions it ran."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.config import compat
from sharenet.train import experiment, trainer
from sharenet.inference import generate as gen
from sharenet.inference import loop_by_loop as ri
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, routing
from sharenet.models.lm import init_cache
from sharenet.models.loops import Schedule
from sharenet.models.routed_decoding import RoutedCache

PROMPTS = ([3, 141, 59, 26, 5], [27, 18])   # two lengths: left padding in one batch
NEW = 6
SEQ_LEN = 32   # configs/tiny.py train.seq_len: the recomputation's padded width
TOKENS = [[3, 141, 59, 26, 5, 7, 200, 11]]
# token choice: middle_cycle (unique first and last layers around 1 set x 3 recursions), with
# loss-free balancing's bias set, so that decoding must read it; expert choice: a cycle of 2
# sets x 3 recursions at the default capacities 1, 2/3, 1/3.
TOKEN = {'model.num_layers': 5, 'model.sharing.scheme': 'middle_cycle',
         'model.sharing.num_unique': 3, 'model.routing.kind': 'token_choice',
         'model.routing.balancing': 'bias'}
EXPERT = {'model.num_layers': 6, 'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2,
          'model.routing.kind': 'expert_choice'}


def _experiment(tiny_config, overrides):
  """(model, effective variables) of a freshly initialised tiny config."""
  config = tiny_config(**overrides)
  exp = trainer.setup(config, experiment.validate(config))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  return exp.model, trainer.effective_params(state, exp.tr, exp.pz)


class Served:
  """A model, its variables and its jitted full forward and cached call."""

  def __init__(self, model, variables):
    self.model, self.variables = model, variables
    self.forward = jax.jit(lambda v, t: model.apply(v, t))
    self.cached = jax.jit(lambda v, t, c, p: model.apply(v, t, cache=c, positions_BT=p))

  def prefill(self, tokens, slots):
    """(logits, cache) of a cached forward of `tokens` (B, T) from an empty cache."""
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    return self.cached(self.variables, tokens, init_cache(self.model.cfg, B, slots), positions)


@pytest.fixture(scope='module')
def token(tiny_config):
  model, variables = _experiment(tiny_config, TOKEN)
  bias = jnp.asarray([0.0, 0.05, 0.1], jnp.float32)   # towards deeper exits
  balance = jax.tree.map(lambda _: bias, variables[routing.BALANCE])
  return Served(model, {**variables, routing.BALANCE: balance})


@pytest.fixture(scope='module')
def expert(tiny_config):
  return Served(*_experiment(tiny_config, EXPERT))


def _routed(served, cache) -> RoutedCache:
  entry = cache.layers[served.model.cfg.routed_segment]
  assert isinstance(entry, RoutedCache)
  return entry


def _assert_recursion_wise(served, cache, held_tokens):
  """Recursion r's K layers hold exactly the tokens that ran r: entries of the others are
  never written (zero in a fresh cache)."""
  cfg = served.model.cfg
  entry = _routed(served, cache)
  R = cfg.recursions
  depth_BS = np.asarray(entry.depth_BS)[:, :held_tokens]
  k_RKBSKD = np.asarray(entry.kv.k_BSKD).reshape((R, -1) + entry.kv.k_BSKD.shape[1:])
  for r in range(R):
    written_KBS = np.abs(k_RKBSKD[r, :, :, :held_tokens]).sum(axis=(-1, -2)) > 0
    assert np.array_equal(written_KBS, np.broadcast_to(depth_BS > r, written_KBS.shape)), r
  return depth_BS


def _greedy_by_recomputation(served, prompt, n):
  """argmax of the full (uncached) forward on the growing sequence, n times (right-padded to
  the training length: causal, so the padding changes no earlier logit)."""
  seq = list(prompt)
  for _ in range(n):
    tokens = np.zeros((1, SEQ_LEN), np.int32)
    tokens[0, :len(seq)] = seq
    logits = served.forward(served.variables, jnp.asarray(tokens))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


# ---- token choice: causal, so decoding is the full forward ----------------------------------

@pytest.mark.slow
def test_token_choice_cached_greedy_equals_full_forward_argmax(token):
  out = gen.generate(token.model, token.variables, PROMPTS, NEW, temperature=0.0)
  for prompt, tokens in zip(PROMPTS, out.tokens):
    assert tokens == _greedy_by_recomputation(token, prompt, NEW)
  assert len(set(out.tokens[0] + out.tokens[1])) > 1   # not a constant sequence


@pytest.mark.slow
def test_token_choice_prefill_routes_as_training_and_caches_recursion_wise(token):
  """The cached prefill's logits are the full forward's; each token's recursions are the ones
  training routes it through (capacity_r: the fraction running r, sown by the full forward);
  recursion r's cache holds only those tokens."""
  logits, cache = token.prefill(TOKENS, 8)
  full, sown = token.model.apply(token.variables, jnp.asarray(TOKENS), mutable=[routing.ROUTING])
  np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)
  depth_BS = _assert_recursion_wise(token, cache, 8)
  capacity = routing.collected(sown[routing.ROUTING])
  for r in range(token.model.cfg.recursions):
    assert np.mean(depth_BS > r) == pytest.approx(float(capacity[f'capacity_{r}']))
  assert len(np.unique(depth_BS)) > 1   # mixed depths: the masking matters


# ---- expert choice: per-token threshold at decode time --------------------------------------

@pytest.mark.slow
def test_expert_choice_generation_runs_and_is_deterministic(expert):
  run = functools.partial(gen.generate, expert.model, expert.variables, PROMPTS, NEW)
  greedy = run(temperature=0.0)
  assert [len(t) for t in greedy.tokens] == [NEW, NEW]
  assert run(temperature=0.0).tokens == greedy.tokens
  a, b = (run(temperature=1.0, rng=jax.random.key(3)).tokens for _ in range(2))
  assert a == b
  # recursion-wise: fewer bytes than every token at every recursion, at least recursion 0's
  per_layer = 2 * expert.model.cfg.kv_heads * expert.model.cfg.d_head * 4
  assert 2 * per_layer <= greedy.kv_bytes_per_token < 6 * per_layer


def test_expert_choice_cache_is_recursion_wise_and_incremental(expert):
  """Recursion 0 (capacity 1) holds every token, later recursions those the threshold kept;
  decoding the last tokens one at a time gives the one-shot prefill's logits and depths; and
  the entries a recursion hides are never read (junk there changes nothing)."""
  logits, cache = expert.prefill(TOKENS, 8)
  depth_BS = _assert_recursion_wise(expert, cache, 8)
  assert depth_BS.min() >= 1 and len(np.unique(depth_BS)) > 1
  P = 5
  _, part = expert.prefill([TOKENS[0][:P]], 8)
  for t in range(P, 8):
    step_logits, part = expert.cached(expert.variables, jnp.asarray([[TOKENS[0][t]]]), part,
                                      jnp.asarray([[t]], jnp.int32))
    np.testing.assert_allclose(step_logits[:, 0], logits[:, t], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(_routed(expert, part).depth_BS, _routed(expert, cache).depth_BS)
  # junk in every hidden entry (slot s at recursion r with depth_s <= r, and the empty slots)
  _, part = expert.prefill([TOKENS[0][:P]], 8)
  entry, R = _routed(expert, part), expert.model.cfg.recursions
  hidden_RBS = np.arange(R)[:, None, None] >= np.asarray(entry.depth_BS)[None]
  hidden_L11S11 = np.repeat(hidden_RBS, entry.kv.k_BSKD.shape[0] // R, axis=0)[..., None, None]
  junk = lambda a: jnp.where(hidden_L11S11, 1e3 * jax.random.normal(jax.random.key(1), a.shape),
                             a)
  dirty = part._replace(layers=tuple(
      e._replace(kv=jax.tree.map(junk, e.kv)) if isinstance(e, RoutedCache) else e
      for e in part.layers))
  step = lambda c: expert.cached(expert.variables, jnp.asarray([[TOKENS[0][P]]]), c,
                                 jnp.asarray([[P]], jnp.int32))[0]
  np.testing.assert_array_equal(step(dirty), step(part))


def test_expert_choice_at_capacity_one_decodes_as_it_trains(tiny_config):
  """With every capacity 1 training keeps every token at every recursion, and so does the
  decode rule: the cached prefill equals the full forward (h <- h + g f(h) alike)."""
  served = Served(*_experiment(tiny_config, {**EXPERT, 'model.num_layers': 4,
                                             'model.routing.capacity': '1,1'}))
  logits, cache = served.prefill(TOKENS, 8)
  np.testing.assert_allclose(logits, served.forward(served.variables, jnp.asarray(TOKENS)),
                             rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(_routed(served, cache).depth_BS) == 2)


# ---- KV bytes per token ---------------------------------------------------------------------

def test_kv_bytes_per_token_counts_the_recursions_each_token_ran(token):
  """The unique first and last layers hold every token; the routed segment's K layers per
  recursion a token ran."""
  cfg = token.model.cfg
  _, cache = token.prefill(TOKENS, 8)
  depth_BS = np.asarray(_routed(token, cache).depth_BS)
  per_layer = 2 * cfg.kv_heads * cfg.d_head * 4
  want = (2 + 1 * depth_BS.mean()) * per_layer   # K = 1 set per recursion
  assert float(gen.kv_cache_bytes_held(token.model, cache)) == pytest.approx(want)


# ---- bad input: one line --------------------------------------------------------------------

def test_routed_generation_is_declared_and_bad_input_is_one_line(token, tiny_config):
  compat.check_action('generation', tiny_config(**TOKEN))   # works: no refusal left
  model, variables = token.model, token.variables
  plain = DecoderLM(model.cfg.derive(routing=dict(kind='none', balancing='loss')))
  tokens, positions = jnp.asarray([[1, 2]]), jnp.asarray([[0, 1]], jnp.int32)
  cases = [
      lambda: gen.generate(model, variables, PROMPTS, 2, loops=2),       # a test-time depth
      lambda: ri.generate_early_exit(model, variables, PROMPTS, 2),      # loop-by-loop serving
      lambda: model.apply(variables, tokens, cache=init_cache(plain.cfg, 1, 4),
                          positions_BT=positions),                       # an unrouted cache
      lambda: model.apply(variables, tokens, cache=init_cache(model.cfg, 1, 4),
                          positions_BT=positions, schedule=Schedule(loops=2)),
  ]
  for case in cases:
    with pytest.raises(ConfigError) as e:
      case()
    assert '\n' not in str(e.value) and 'valid' in str(e.value)
