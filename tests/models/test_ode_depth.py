"""model.recurrence.ode_step: the looped segment as Euler steps of one ODE (models/block.py,
models/loops.py), against a restatement through the role table: with pre-norm blocks and no
biases each branch is linear in its writer kernel, so x + h f(x) is the plain model with every
writer kernel of the looped blocks scaled by h."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, init_variables, param_table
from sharenet.models.config import ModelConfig
from sharenet.models.loops import Schedule

BASE = dict(d_model=16, num_heads=2, mlp_dim=32, num_layers=6, vocab_size=32, mlp='gelu',
            dtype='float64', param_dtype='float64',
            sharing={'scheme': 'middle_cycle', 'num_unique': 4})   # U0 (A B) x 2 U5: R = 2
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 7)))


def _cfg(ode, **kw):
  return ModelConfig(**{**BASE, 'recurrence': {'ode_step': ode}, **kw})


def _scaled_writers(cfg, variables, h):
  """`variables` with the looped segment's writer kernels multiplied by h."""
  table = param_table(cfg)
  flat = flatten_dict(variables)
  for path, info in table.items():
    if info.role == 'writer' and info.in_block and 'segment_1' in path:
      flat[path] = flat[path] * h
  return unflatten_dict(flat)


@pytest.mark.slow
@pytest.mark.parametrize('loops,no_grad', [(2, 0), (1, 0), (4, 0), (1, 1), (3, 2)])
def test_the_step_is_the_trained_depth_over_the_loops_run(loops, no_grad):
  """At n = no_grad + loops loops the ODE model is the plain model at n loops with the looped
  writers scaled by R / n (and at the plan's R, the plain model itself)."""
  with jax.enable_x64(True):
    ode, plain = _cfg(True), _cfg(False)
    v = init_variables(DecoderLM(ode), jax.random.key(0))
    schedule = Schedule(loops=loops, no_grad=no_grad)
    got = DecoderLM(ode).apply(v, TOKENS, schedule=schedule)
    h = 2 / (loops + no_grad)
    want = DecoderLM(plain).apply(_scaled_writers(plain, v, h), TOKENS, schedule=schedule)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    if h != 1:   # the step changes the function there
      assert np.abs(np.asarray(got) - np.asarray(
          DecoderLM(plain).apply(v, TOKENS, schedule=schedule))).max() > 1e-4
    np.testing.assert_allclose(DecoderLM(ode).apply(v, TOKENS), DecoderLM(plain).apply(
        v, TOKENS), rtol=1e-12)


def test_a_traced_prefix_takes_its_step():
  """A sampled depth's no-grad prefix is a traced count: the step R / (p + n) is traced too."""
  with jax.enable_x64(True):
    ode, plain = _cfg(True), _cfg(False)
    v = init_variables(DecoderLM(ode), jax.random.key(0))
    f = jax.jit(lambda p: DecoderLM(ode).apply(v, TOKENS, schedule=Schedule(loops=1,
                                                                            no_grad=p)))
    want = DecoderLM(plain).apply(_scaled_writers(plain, v, 2 / 4), TOKENS,
                                  schedule=Schedule(loops=1, no_grad=3))
    np.testing.assert_allclose(f(jnp.asarray(3, jnp.int32)), want, rtol=1e-10, atol=1e-12)


def test_without_a_looped_segment_it_is_one_line():
  with pytest.raises(ConfigError, match=r'with model.recurrence.ode_step=True: recurrence and exits loop the plan') as e:
    _cfg(True, sharing={'scheme': 'untied', 'num_unique': 0})
  assert '\n' not in str(e.value)
