"""Mixture of LoRAs (model.moe.lora_experts = N; docs/experts.md).

"Improving Recursive Transformers with Mixture of LoRAs" (ModernALBERT, arXiv:2512.12880): N
LoRA experts of rank model.sharing.lora_rank on the shared feed-forward's kernels (the mlp_in /
mlp_out entries of model.sharing.lora_targets), chosen per token by a router, so a tied block
is modulated per token rather than per depth:

  y = x W + lora_scale * g_t x A_{e_t} B_{e_t},   e_t = argmax_e softmax(x_t W_r)_e

with one router per feed-forward reading its input x_t (the same choice for mlp_in and mlp_out).
Assumed here (the paper's text was not at hand, so these are this project's choices): top-1
routing; the gate g_t is 1 in the forward pass with the router probability's gradient
(straight-through: g = 1 + p - stop_gradient(p)), so the router learns as Switch's does
(arXiv:2101.03961, output scaled by p) while a token's update is exactly its expert's adapter,
which makes the merge into one adapter exact when every token picks the same expert
(sharenet/transforms/lora_merge.py). No load-balancing loss.

The experts and the router are parameters of the block ('params', tied where the block is tied):
'lora_experts_a' (N, in..., r) and 'lora_experts_b' (N, r, out...), role lora on a leading
'experts' stack axis, initialised as depth-wise LoRA (model.sharing.lora_zero); 'lora_router'
(N, D), role router. All N experts' factors are run, masked by the route (r is small: N r (in +
out) per token), and FLOPs count them so (models/accounting.py).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet.models.params import param

BRANCH = 'mlp'


def route(module: nn.Module, cfg, x_BTD: jax.Array) -> jax.Array:
  """Each token's gates over the N experts (B, T, N): g at its argmax expert, 0 elsewhere."""
  N, D = cfg.moe.lora_experts, cfg.d_model
  w_ND = param(module, 'lora_router', (N, D), ('experts', 'embed'), 'router', std=D ** -0.5,
               dtype=jnp.dtype(cfg.param_dtype), num_in=1, branch=BRANCH)
  logits_BTN = jnp.einsum('btd,nd->btn', x_BTD.astype(jnp.float32), w_ND.astype(jnp.float32))
  probs_BTN = jax.nn.softmax(logits_BTN, axis=-1)
  onehot_BTN = jax.nn.one_hot(jnp.argmax(logits_BTN, axis=-1), N, dtype=probs_BTN.dtype)
  p_BT = jnp.sum(probs_BTN * onehot_BTN, axis=-1)
  gate_BT = 1.0 + p_BT - jax.lax.stop_gradient(p_BT)   # 1 forward, dp backward
  return (onehot_BTN * gate_BT[..., None]).astype(jnp.dtype(cfg.dtype))


def delta(dense: nn.Module, x_bI: jax.Array, route_bN: jax.Array, in_shape: tuple[int, ...],
          out_shape: tuple[int, ...]) -> jax.Array:
  """lora_scale * sum_e route_e x A_e B_e for rows x (batch..., fan_in) -> (batch..., fan_out);
  `dense` is the models/layers.py Dense whose kernel the experts adapt."""
  d = dense
  N, r = route_bN.shape[-1], d.lora_rank
  fan_in = x_bI.shape[-1]
  in_axes, out_axes = tuple(d.in_axes), tuple(d.out_axes)
  zeros = nn.initializers.zeros   # one factor starts at zero, so every expert's delta does
  a_init = dict(init=zeros) if d.lora_zero == 'a' else dict(std=fan_in ** -0.5)
  b_init = dict(std=r ** -0.5) if d.lora_zero == 'a' else dict(init=zeros)
  a = param(d, 'lora_experts_a', (N,) + in_shape + (r,), ('experts',) + in_axes + ('lora',),
            'lora', **a_init, dtype=d.param_dtype, num_in=len(in_shape), branch=d.branch)
  b = param(d, 'lora_experts_b', (N, r) + out_shape, ('experts', 'lora') + out_axes, 'lora',
            **b_init, dtype=d.param_dtype, num_in=1, branch=d.branch,
            writes=d.role == 'writer')
  xa_bNR = jnp.einsum('...i,nir->...nr', x_bI, a.reshape(N, fan_in, r).astype(d.dtype))
  xa_bNR = xa_bNR * route_bN[..., None].astype(d.dtype)
  return d.lora_scale * jnp.einsum('...nr,nro->...o', xa_bNR,
                                   b.reshape(N, r, -1).astype(d.dtype))
