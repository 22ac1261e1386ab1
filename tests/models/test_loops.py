"""The loop runner (sharenet/models/loops.py): schedules of a looped segment, lowerings.

Every lowering of the runner is compared with the others elsewhere (tests/models/test_lm.py,
models/test_sublayer_sharing.py, models/test_structure.py); here: another depth per call, the
no-grad prefix
(its value, its gradient, one program for every traced prefix, nothing stored for it), the
per-loop streams, and the refusals.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.errors import ConfigError
from sharenet.models.config import ModelConfig
from sharenet.models.lm import DecoderLM, init_variables
from sharenet.models.loops import PER_LOOP, Schedule
from sharenet.models.params import PER_LAYER

TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)


def _model(num_layers=4, lowering='nested', **sharing):
  cfg = ModelConfig(vocab_size=64, d_model=16, num_heads=2, mlp_dim=32, num_layers=num_layers,
                    sharing=dict(scheme='cycle', num_unique=2, **sharing), scan_lowering=lowering,
                    dtype='float32', param_dtype='float32')
  model = DecoderLM(cfg)
  return model, init_variables(model, jax.random.key(0))


@pytest.fixture(scope='module')
def cycle():
  return _model()


def test_default_schedule_is_the_plan(cycle):
  model, v = cycle
  np.testing.assert_array_equal(model.apply(v, TOKENS),
                                model.apply(v, TOKENS, schedule=Schedule(loops=2)))


@pytest.mark.parametrize('loops', [1, 3])
def test_another_depth_equals_the_model_of_that_depth(cycle, loops):
  """Two stored sets run 1 or 3 times = the cycle model of 2 or 6 applied layers holding the
  same sets (its params tree is the same: only the loop count differs)."""
  model, v = cycle
  deeper, v_deep = _model(num_layers=2 * loops)
  assert jax.tree.map(jnp.shape, v_deep) == jax.tree.map(jnp.shape, v)
  np.testing.assert_allclose(model.apply(v, TOKENS, schedule=Schedule(loops=loops)),
                             deeper.apply(v, TOKENS), rtol=1e-6, atol=1e-6)


def _stream_after(model, v, loops):
  return model.apply(v, model.apply(v, TOKENS, method='embed'), jnp.arange(TOKENS.shape[1]),
                     schedule=Schedule(loops=loops), method='trunk')


@pytest.mark.slow
def test_no_grad_prefix_value_and_gradient(cycle):
  """Schedule(no_grad=p, loops=n): the value of p + n loops; the gradient of n loops applied
  to the (constant) stream after p loops."""
  model, v = cycle
  loss = lambda logits: jnp.mean(jnp.sin(logits))
  f = lambda v: loss(model.apply(v, TOKENS, schedule=Schedule(loops=2, no_grad=3)))

  def reference(v):
    x = jax.lax.stop_gradient(_stream_after(model, v, 3))
    x = model.apply(v, x, jnp.arange(TOKENS.shape[1]), schedule=Schedule(loops=2),
                    method='trunk')
    return loss(model.apply(v, x, method='head'))

  np.testing.assert_allclose(f(v), loss(model.apply(v, TOKENS, schedule=Schedule(loops=5))),
                             rtol=1e-6)
  got, want = jax.grad(f)(v), jax.grad(reference)(v)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)
  # Untied readout and no prelude: the embedding reaches the loss only through the prefix.
  assert not model.cfg.tie_embeddings
  assert not np.any(np.asarray(got['params']['embed']['embedding']))


@pytest.mark.slow
def test_traced_prefix_is_one_program(cycle):
  model, v = cycle
  step = jax.jit(jax.grad(lambda v, p: jnp.mean(
      model.apply(v, TOKENS, schedule=Schedule(loops=1, no_grad=p)))))
  static = jax.grad(lambda v: jnp.mean(model.apply(v, TOKENS,
                                                   schedule=Schedule(loops=1, no_grad=2))))(v)
  for p in (0, 2, 5):
    g = step(v, jnp.int32(p))
  assert step._cache_size() == 1
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               step(v, jnp.int32(2)), static)


def test_no_grad_prefix_stores_nothing(cycle):
  """The backward pass's temporaries do not grow with the prefix (nothing of it is saved)."""
  model, v = cycle

  def temp_bytes(p):
    f = jax.grad(lambda v: jnp.mean(model.apply(v, TOKENS, schedule=Schedule(1, no_grad=p))))
    return jax.jit(f).lower(v).compile().memory_analysis().temp_size_in_bytes

  def temp_full(n):
    f = jax.grad(lambda v: jnp.mean(model.apply(v, TOKENS, schedule=Schedule(n))))
    return jax.jit(f).lower(v).compile().memory_analysis().temp_size_in_bytes

  assert temp_bytes(8) <= temp_bytes(1) * 1.05 < temp_full(9)


def test_collected_streams(cycle):
  model, v = cycle
  x = model.apply(v, TOKENS, method='embed')
  pos = jnp.arange(TOKENS.shape[1])
  out, state = model.apply(v, x, pos, schedule=Schedule(loops=3, collect=True), method='trunk',
                           mutable=[PER_LOOP])
  (streams,) = jax.tree.leaves(state[PER_LOOP])
  assert streams.shape == (3,) + x.shape
  np.testing.assert_array_equal(streams[-1], out)
  np.testing.assert_allclose(streams[0], _stream_after(model, v, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_lowerings_store_and_initialise_alike():
  """nested and flat (and their loops) are one computation on one stored tree."""
  nested, v = _model(num_layers=6, lora_rank=2, untie_norms=True)
  flat, v_flat = _model(num_layers=6, lowering='flat', lora_rank=2, untie_norms=True)
  jax.tree.map(np.testing.assert_array_equal, v, v_flat)
  v[PER_LAYER] = jax.tree.map(lambda a: a + 0.01, v[PER_LAYER])   # non-zero LoRA B
  np.testing.assert_allclose(nested.apply(v, TOKENS), flat.apply(v, TOKENS), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(nested.apply(v, TOKENS, schedule=Schedule(loops=2, no_grad=1)),
                             flat.apply(v, TOKENS), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_refusals():
  lora, v = _model(num_layers=4, lora_rank=2)
  with pytest.raises(ConfigError, match='per-layer parts'):
    lora.apply(v, TOKENS, schedule=Schedule(loops=3))
  with pytest.raises(ConfigError, match='per-layer parts'):
    lora.apply(v, TOKENS, schedule=Schedule(loops=1, no_grad=jnp.int32(1)))
  untied = DecoderLM(ModelConfig(vocab_size=64, d_model=16, num_heads=2, mlp_dim=32,
                                 num_layers=2, dtype='float32'))
  with pytest.raises(ConfigError, match='exactly one looped cycle segment'):
    untied.apply(init_variables(untied, jax.random.key(0)), TOKENS, schedule=Schedule(loops=2))
  model, v = _model()
  with pytest.raises(ConfigError, match='valid: loops >= 1'):
    model.apply(v, TOKENS, schedule=Schedule(loops=0))
  routed = DecoderLM(model.cfg.derive(routing=dict(kind='token_choice')))
  v = init_variables(routed, jax.random.key(0))
  with pytest.raises(ConfigError, match='a loop schedule .* of a routed model'):
    routed.apply(v, TOKENS, schedule=Schedule(loops=1))
