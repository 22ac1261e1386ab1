"""Causal Energy Minimization's weight-tied layers (Xu et al., arXiv:2605.07588):
model.attention_sharing=cem (values are the keys, W_O = W_Q^T; models/projections.py) and
model.mlp_tied (the down projection is the nonlinear input one transposed; models/mlp.py), each
against minus the gradient of its energy (the equivalence the paper states, derived here from
its abstract), their stored counts and FLOPs. Cached generation against recomputation:
tests/inference/test_generate.py (plan cem_tied)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from sharenet.models import DecoderLM, ModelConfig, accounting, init_variables
from sharenet.models.attention import CausalAttention
from sharenet.models.mlp import Mlp

D, H, F, T = 16, 2, 24, 6


def _cfg(**kw):
  base = dict(vocab_size=64, d_model=D, num_layers=2, num_heads=H, mlp_dim=F, remat='none',
              dtype='float64', param_dtype='float64')
  return ModelConfig(**base).derive(**kw)


@pytest.mark.slow
def test_cem_attention_is_a_gradient_step_on_the_interaction_energy():
  """out_t = -grad_y E_t(y) at y = x_t, E_t(y) = -(1/beta) sum_h log sum_{s<=t}
  exp(beta (W_Q,h y) . (W_K,h x_s)), the context x_{<=t} fixed (no positions, no QK-norm)."""
  with jax.enable_x64(True):
    cfg = _cfg(attention_sharing='cem', position='none')
    x = jax.random.normal(jax.random.key(0), (1, T, D), jnp.float64)
    module = CausalAttention(cfg)
    v = module.init(jax.random.key(1), x, jnp.arange(T))
    out = module.apply(v, x, jnp.arange(T))[0]
    p = flatten_dict(nn.unbox(v)['params'])
    assert set(k[0] for k in p) == {'q', 'k'}          # no v, no o
    wq, wk = np.asarray(p[('q', 'kernel')]), np.asarray(p[('k', 'kernel')])   # (D, H, Dh)
    beta = wq.shape[-1] ** -0.5

    def energy(y, t):
      keys_SHK = jnp.einsum('sd,dhk->shk', x[0, :t + 1], wk)
      logits_HS = beta * jnp.einsum('d,dhk,shk->hs', y, wq, keys_SHK)
      return -jnp.sum(jax.scipy.special.logsumexp(logits_HS, axis=-1)) / beta

    for t in range(T):
      # the attention's logits are float32 (kernels/attention.py einsum_f32)
      np.testing.assert_allclose(out[t], -jax.grad(energy)(x[0, t], t), rtol=1e-5, atol=1e-7)


def _antiderivative(f):
  """F(z) = integral_0^z f = z * integral_0^1 f(z u) du (Gauss-Legendre, 40 nodes)."""
  u, w = np.polynomial.legendre.leggauss(40)
  u, w = jnp.asarray((u + 1) / 2), jnp.asarray(w / 2)
  return lambda z: z * jnp.sum(w[None] * f(z[:, None] * u[None]), axis=-1)


@pytest.mark.parametrize('mlp', ['swiglu', 'gelu'])
def test_the_tied_mlp_is_a_gradient_step_on_the_element_wise_energy(mlp):
  """out = -grad_y E(y | x) at y = x, E = -sum_i (V x)_i F((W y)_i) (SwiGLU: W = wi_gate, V =
  wi_up, F' = silu; GELU: no gate, F' = gelu, tanh-approximate as flax's), the gate's input
  held fixed."""
  with jax.enable_x64(True):
    cfg = _cfg(mlp_tied=True, mlp=mlp)
    x = jax.random.normal(jax.random.key(0), (1, T, D), jnp.float64)
    module = Mlp(cfg)
    v = module.init(jax.random.key(1), x)
    out = module.apply(v, x)[0]
    p = flatten_dict(nn.unbox(v)['params'])
    assert ('wo', 'kernel') not in p
    if mlp == 'swiglu':
      W, V, f = p[('wi_gate', 'kernel')], p[('wi_up', 'kernel')], jax.nn.silu
    else:
      W, V, f = p[('wi', 'kernel')], None, lambda z: jax.nn.gelu(z, approximate=True)
    F_ = _antiderivative(f)

    def energy(y, x_t):
      gate = jnp.ones(F) if V is None else x_t @ V
      return -jnp.sum(gate * F_(y @ W))

    for t in range(T):
      np.testing.assert_allclose(out[t], -jax.grad(energy)(x[0, t], x[0, t]), rtol=1e-9,
                                 atol=1e-11)


def test_cem_stores_fewer_kernels_and_counts_the_tied_matmuls():
  kw = dict(dtype='float32', param_dtype='float32')
  plain, cem = _cfg(**kw), _cfg(attention_sharing='cem', mlp_tied=True, **kw)
  n = lambda c: accounting.params_unique(init_variables(DecoderLM(c), jax.random.key(0)))
  assert n(plain) - n(cem) == 2 * (2 * D * D + F * D)        # v, o and wo per layer
  # every matmul but the value projection still runs (W_Q^T and W^T are multiplied with)
  assert (accounting.matmul_params_per_layer(plain) - accounting.matmul_params_per_layer(cem)
          == D * D)
