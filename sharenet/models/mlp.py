"""Feed-forward block: SwiGLU, GeGLU, GELU or SELU, optionally with a norm on the hidden
pre-activations.

`model.mlp_tied` is Causal Energy Minimization's gated MLP with shared up / down projections
(Xu, Couturier, Ruhle, Rajmohan, Hensman, arXiv:2605.07588): the down projection is the
nonlinear input projection transposed, out = W^T (f(W x) * V x) with W = wi_gate, V = wi_up
(SwiGLU: f = silu; GeGLU: gelu), or out = W^T f(W x) with W = wi (gelu, selu); no 'wo'. At
y = x it is minus the gradient in y of the element-wise energy E(y | x) = -sum_i (V x)_i
F((W y)_i), F' = f, the gate's input held fixed (our derivation from the paper's abstract, which
states the energy reading; checked numerically in tests/models/test_cem.py).

`model.mlp = selu` is the self-normalizing network of Klambauer et al. ("Self-Normalizing Neural
Networks", arXiv:1706.02515): h = selu(x W_in) with selu(z) = lambda z (z > 0),
lambda alpha (e^z - 1) (z <= 0), lambda ~ 1.0507, alpha ~ 1.6733 (their eq. 2), whose mapping of
(mean, variance) has the fixed point (0, 1) when the weights have zero mean and variance 1/fan_in
(their section "Initialization": LeCun normal). That is the default SP init of every Dense here
(normal with std 1/sqrt(fan_in), recorded as the leaf's init_std), so SELU needs no init of its
own; with `model.norm.kind=none` it is the paper's normalization-free baseline. jax.nn.selu
carries the paper's constants. Under u-muP it stays as is (already unit-scaled at the fixed
point).

`model.norm.pre_activation` (layernorm | rmsnorm) is part 1 of Normalize-and-Project (Lyle et
al., "Normalization and effective learning rates in reinforcement learning", NeurIPS 2024,
arXiv:2407.01800): a normalization layer before each nonlinearity, so the loss no longer
depends on the scale of the kernel feeding it. GELU: h = gelu(N(x W_in)). SwiGLU: the gate
nonlinearity silu and the product gate * value are both nonlinear in the input projections,
so each input projection gets its own norm, h = silu(N_g(x W_gate)) * N_u(x W_up), and the
MLP output is invariant to the scale of W_gate and of W_up. The norms' gains (and LayerNorm
offsets) are hidden-width vectors with role norm_in on branch 'mlp'.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sharenet.models import lora_experts, unit_scale
from sharenet.models.config import ModelConfig
from sharenet.models.layers import Dense, dense_apply, sow_l1
from sharenet.models.norms import Norm
from sharenet.models.params import PER_LAYER


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up, with a hand-written backward: d gate = dh up s (1 + gate (1 - s)),
  d up = dh gate s (s = sigmoid(gate), computed once). The same function as autodiff's; its
  backward is one elementwise pass where autodiff's is several (the two product-rule terms of
  silu summed separately): 2.5 % of the d=256 train step in a one-core XLA:CPU A/B
  (docs/performance.md, "CPU speed against PyTorch eager"). Reverse mode only (custom_vjp)."""
  return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
  return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dh):
  gate, up = res
  s = jax.nn.sigmoid(gate)
  silu = gate * s
  return dh * up * (s + silu * (1 - s)), dh * silu


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)

BRANCH = 'mlp'


class Mlp(nn.Module):
  """x -> W_out act(W_in x), act gelu or selu; SwiGLU gates with a second input projection."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD: jax.Array, masa: dict[str, jax.Array] | None = None,
               select_BTD: jax.Array | None = None) -> jax.Array:
    """`masa`: {kernel name: atoms} (models/masa.py) forms those kernels from shared atoms.
    `select_BTD` (model.norm.placement=moeut): what the Mixture-of-LoRAs router reads instead
    of x (the normed stream, where the kernels read the un-normalised one)."""
    c = self.cfg
    masa = masa or {}
    dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    r_in = c.sharing.lora_rank if 'mlp_in' in c.sharing.lora_targets else 0
    r_out = c.sharing.lora_rank if 'mlp_out' in c.sharing.lora_targets else 0

    # Mixture of LoRAs (models/lora_experts.py): one route per token for both LoRA targets
    n_experts = c.moe.lora_experts if r_in or r_out else 0
    route_BTN = (lora_experts.route(self, c, x_BTD if select_BTD is None else select_BTD)
                 if n_experts else None)

    def dense_in(name):
      return lambda x: dense_apply(
          Dense((c.mlp_dim,), ('embed',), ('mlp',), branch=BRANCH, lora_rank=r_in,
                lora_scale=c.sharing.lora_scale, lora_zero=c.sharing.lora_zero,
                use_bias=c.bias_on('mlp_in'), dtype=dt, param_dtype=pdt, dense_grad=c.dense_grad,
                lora_experts=n_experts, name=name, **c.mpo_args('mlp_in')), x,
          masa.get(name), route_BTN if r_in else None)

    def pre_act(name):   # identity unless model.norm.pre_activation is set
      if c.norm.pre_activation == 'none':
        return lambda h: h
      return Norm(c.norm.pre_activation, c.norm.eps,
                  PER_LAYER if c.sharing.untie_norms else 'params',
                  axis_name='mlp', param_dtype=pdt, role='norm_in', branch=BRANCH, name=name)

    gated = c.mlp in ('swiglu', 'geglu')
    if c.mlp == 'swiglu':
      gate = pre_act('gate_norm')(dense_in('wi_gate')(x_BTD))
      up = pre_act('up_norm')(dense_in('wi_up')(x_BTD))
      # u-muP's unit-scaled nonlinearities (models/unit_scale.py) under parametrization umup
      h_BTF = unit_scale.silu_glu(up, gate) if c.umup_ops else swiglu(gate, up)
    elif c.mlp == 'geglu':   # Gemma's: tanh-approximate GELU of the gate times the value
      gate = pre_act('gate_norm')(dense_in('wi_gate')(x_BTD))
      up = pre_act('up_norm')(dense_in('wi_up')(x_BTD))
      h_BTF = nn.gelu(gate, approximate=True) * up
    else:
      h = pre_act('pre_act_norm')(dense_in('wi')(x_BTD))
      if c.mlp == 'selu':
        h_BTF = jax.nn.selu(h)
      else:
        h_BTF = unit_scale.gelu(h) if c.umup_ops else nn.gelu(h)
    h_BTF = checkpoint_name(h_BTF, 'mlp_hidden')
    sow_l1(self, 'mlp_hidden', h_BTF)
    h_BTF = nn.with_logical_constraint(h_BTF, ('activation_batch', 'activation_length',
                                               'activation_mlp'))
    if c.mlp_tied:   # CEM's tied MLP: the down projection is the nonlinear one transposed
      w_DF = nn.unbox(self.variables['params']['wi_gate' if gated else 'wi']['kernel'])
      out = h_BTF.astype(dt) @ w_DF.T.astype(dt)
    else:
      out = dense_apply(Dense((c.d_model,), ('mlp',), ('embed',), role='writer', branch=BRANCH,
                              lora_rank=r_out, lora_scale=c.sharing.lora_scale,
                              lora_zero=c.sharing.lora_zero, use_bias=c.bias_on('mlp_out'),
                              dtype=dt, param_dtype=pdt, dense_grad=c.dense_grad,
                              lora_experts=n_experts, name='wo', **c.mpo_args('mlp_out')),
                        h_BTF, masa.get('wo'), route_BTN if r_out else None)
    sow_l1(self, 'mlp_out', out)
    return checkpoint_name(out, 'mlp_out')
