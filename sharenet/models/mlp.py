"""Feed-forward block: SwiGLU or GELU."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sharenet.models import unit_scale
from sharenet.models.config import ModelConfig
from sharenet.models.layers import Dense, sow_l1

BRANCH = 'mlp'


class Mlp(nn.Module):
  """x -> W_out act(W_in x); SwiGLU gates with a second input projection."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    c = self.cfg
    dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    r_in = c.lora_rank if 'mlp_in' in c.lora_targets else 0
    r_out = c.lora_rank if 'mlp_out' in c.lora_targets else 0

    def dense_in(name):
      return Dense((c.mlp_dim,), ('embed',), ('mlp',), branch=BRANCH, lora_rank=r_in,
                   lora_scale=c.lora_scale, use_bias=c.reader_bias, dtype=dt, param_dtype=pdt,
                   name=name)

    if c.umup_ops:   # u-muP's unit-scaled nonlinearities (models/unit_scale.py)
      h_BTF = (unit_scale.silu_glu(dense_in('wi_up')(x_BTD), dense_in('wi_gate')(x_BTD))
               if c.mlp == 'swiglu' else unit_scale.gelu(dense_in('wi')(x_BTD)))
    elif c.mlp == 'swiglu':
      h_BTF = nn.silu(dense_in('wi_gate')(x_BTD)) * dense_in('wi_up')(x_BTD)
    else:
      h_BTF = nn.gelu(dense_in('wi')(x_BTD))
    h_BTF = checkpoint_name(h_BTF, 'mlp_hidden')
    sow_l1(self, 'mlp_hidden', h_BTF)
    h_BTF = nn.with_logical_constraint(h_BTF, ('activation_batch', 'activation_length',
                                               'activation_mlp'))
    out = Dense((c.d_model,), ('mlp',), ('embed',), role='writer', branch=BRANCH, lora_rank=r_out,
                lora_scale=c.lora_scale, dtype=dt, param_dtype=pdt, name='wo')(h_BTF)
    sow_l1(self, 'mlp_out', out)
    return checkpoint_name(out, 'mlp_out')
