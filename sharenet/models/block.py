"""Transformer block with pre / post / peri norm placement."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet.models.attention import BRANCH as ATTN, CausalAttention
from sharenet.models.config import ModelConfig
from sharenet.models.layers import sow_l1
from sharenet.models.mlp import BRANCH as MLP, Mlp
from sharenet.norms import PER_LAYER, Norm

ACT_AXES = ('activation_batch', 'activation_length', 'activation_embed')


class Block(nn.Module):
  """One layer; returns (x, None) so it can be the body of nn.scan."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD: jax.Array, positions_T: jax.Array):
    c = self.cfg

    def norm(name, branch, role='norm_in'):
      return Norm(c.norm, c.norm_eps, PER_LAYER if c.untie_norms else 'params',
                  param_dtype=jnp.dtype(c.param_dtype), dyt_alpha=c.dyt_alpha, role=role,
                  branch=branch, name=name)

    a, m = ATTN, MLP

    attn, mlp = CausalAttention(c, name='attn'), Mlp(c, name='mlp')
    if c.norm_placement == 'pre':      # x + f(N(x))
      x_BTD = x_BTD + attn(norm('attn_norm', a)(x_BTD), positions_T)
      x_BTD = x_BTD + mlp(norm('mlp_norm', m)(x_BTD))
    elif c.norm_placement == 'post':   # N(x + f(x))
      x_BTD = norm('attn_norm', a)(x_BTD + attn(x_BTD, positions_T))
      x_BTD = norm('mlp_norm', m)(x_BTD + mlp(x_BTD))
    else:                              # peri: x + N_out(f(N_in(x)))
      x_BTD = x_BTD + norm('attn_out_norm', a, 'norm_out')(
          attn(norm('attn_norm', a)(x_BTD), positions_T))
      x_BTD = x_BTD + norm('mlp_out_norm', m, 'norm_out')(mlp(norm('mlp_norm', m)(x_BTD)))
    sow_l1(self, 'residual', x_BTD)
    return nn.with_logical_constraint(x_BTD, ACT_AXES), None
