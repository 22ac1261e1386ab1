"""Factorized token embeddings (model.embed_dim, model.embed_projection).

With model.embed_dim = E < d_model the token table is (vocab, E) and a projection brings each
embedded token to the residual width D, so the table stores V x E instead of V x D parameters:

- `linear`: ALBERT's factorized embedding parameterization (Lan et al., "ALBERT: A Lite BERT for
  Self-supervised Learning of Language Representations", arXiv:1909.11942, Section 3.1):
  x = e W_up, W_up (E, D).
- `self_attentive`: Subformer's self-attentive embedding factorization, SAFE (Reid,
  Marrese-Taylor and Matsuo, "Subformer: Exploring Weight Sharing for Parameter Efficiency in
  Generative Transformers", arXiv:2101.00234; the reduction_dim layer of its fairseq code):
  one small pre-norm Transformer layer at width E lifts the embeddings, h = e + Attn(norm(e)),
  x = act(norm(h) W_1) W_2 with W_1 (E, E) and W_2 (E, D) (no residual around the lift: the
  widths differ). The attention is causal with the model's head_dim (E / head_dim heads) and
  rotary positions (the model's own positions are added at width D afterwards, as without
  factorization), through the blocks' attention core (sharenet/kernels/attention.py, on the
  back-end model.attention selects; packed documents attend within their own); the activation
  is GELU (the code's default is ReLU).

A tied readout reads the table through a projection back to E (ALBERT's tied output layer and
the Subformer's `output_projection`): logits = (x W_down) table^T, W_down (D, E).

The factor axis is 'embed_factor', a width axis (parametrization/rules.py): under muP E scales
with d_model (the base model's E is embed_dim x base_d_model / d_model, models/scaling.py), so
W_up, W_down and SAFE's kernels are hidden matrices and the table an input weight.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet import kernels
from sharenet.kernels import attention as attention_kernel
from sharenet.models.config import ModelConfig
from sharenet.models.layers import Dense, rope
from sharenet.models.norms import Norm

FACTOR_AXIS = 'embed_factor'
# the self-attentive block's hidden units (fc1: E -> E): an axis of its own, since a kernel's
# logical axes must differ for sharding (flax's logical_to_mesh_axes)
FACTOR_HIDDEN_AXIS = 'embed_factor_hidden'


class EmbedProjection(nn.Module):
  """The embedded tokens (B, T, E) -> the stream's width (B, T, D) (module docstring)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, e_BTE: jax.Array, segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """`segment_ids_BT`: packed documents (the self-attentive lift attends within each)."""
    c = self.cfg
    dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    dense = lambda features, in_axes, out_axes, role, name: Dense(
        features, in_axes, out_axes, role=role, dtype=dt, param_dtype=pdt,
        dense_grad=c.dense_grad, name=name)
    if c.embed_projection == 'linear':
      return dense((c.d_model,), (FACTOR_AXIS,), ('embed',), 'writer', 'up')(e_BTE)
    norm = lambda name: Norm(c.norm.kind, c.norm.eps, axis_name=FACTOR_AXIS, param_dtype=pdt,
                             dyt_alpha=c.norm.dyt_alpha, p=c.norm.p, name=name)
    heads, dh = c.embed_dim // c.d_head, c.d_head
    T = e_BTE.shape[1]
    a = norm('attn_norm')(e_BTE)
    qkv = [dense((heads, dh), (FACTOR_AXIS,), ('heads', 'head_dim'), 'reader', n)(a)
           for n in ('q', 'k', 'v')]
    q, k, v = (rope(t, jnp.arange(T), c.rope_base) if i < 2 else t for i, t in enumerate(qkv))
    attended = attention_kernel.attention(
        q, k, v, scale=dh ** -0.5, impl=kernels.attention_backend(c.attention, c.kernels),
        segment_ids_BT=segment_ids_BT)
    h = e_BTE + dense((c.embed_dim,), ('heads', 'head_dim'), (FACTOR_AXIS,), 'writer',
                      'o')(attended)
    f = nn.gelu(dense((c.embed_dim,), (FACTOR_AXIS,), (FACTOR_HIDDEN_AXIS,), 'reader',
                      'fc1')(norm('mlp_norm')(h)))
    return dense((c.d_model,), (FACTOR_HIDDEN_AXIS,), ('embed',), 'writer', 'fc2')(f)


def readout_projection(cfg: ModelConfig) -> Dense:
  """The tied readout's W_down (D -> E), created in the calling module's setup."""
  return Dense((cfg.embed_dim,), ('embed',), (FACTOR_AXIS,), role='reader',
               dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
               dense_grad=cfg.dense_grad, name='readout_proj')
