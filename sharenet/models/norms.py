"""Activation norms chosen by name; gains can live in the tied or the per-layer collection.

Formulas (papers in docs/references.md):
  layernorm  gamma * (x - mean) / sqrt(var + eps) + beta, var = mean((x-mu)^2)    (Ba et al.)
  rmsnorm    gamma * x / sqrt(mean(x^2) + eps)                       (Zhang & Sennrich)
  crmsnorm   gamma * z / sqrt((sum z^2 + (sum z)^2) / (n + 1) + eps)  (Jiang et al.); z is the
             compressed (n)-vector of a zero-mean (n+1)-vector whose last entry is -sum z
  scalenorm  g * x / max(||x||_2, eps), one scalar g initialised to sqrt(d)  (Nguyen & Salazar)
  dyt        gamma * tanh(alpha * x) + beta, one scalar alpha (init 0.5)   (Zhu et al.)
  lpnorm     gamma * (x - mean) / (mean(|x - mean|^p) + eps)^(1/p) + beta, p = model.norm.p
             (Liao, Kawaguchi & Poggio, "Streaming Normalization", arXiv:1610.06160, Lp
             normalization: the p-th root of the p-th absolute central moment; p = 2 is
             layernorm, p = 1 their fast L1 form). Over the features of one token, as layernorm:
             stateless, so batch- and device-independent
  l2         x / max(||x||_2, eps) with no gain (QK-norm of Henry et al.: the gain is a
             scalar in the attention logits instead)
  powernorm  gamma * s / sqrt(v + eps) + beta, s = x over its channel groups' RMS per token,
             v the batch's quadratic mean per channel in warmup, else the running one; eval
             mode reads the running one; approximate backward (Shen et al., "PowerNorm",
             arXiv:2003.07845). Its statistics: sharenet/models/norm_stats.py
  unified_norm gamma * x / sqrt(v + eps) + beta, v the batch's quadratic mean per channel, then
             the geometric mean of a window of them; eval mode (and the fold into the next
             linear layer) reads the running one (Yang et al., "Unified Normalization",
             arXiv:2208.01313); sharenet/models/norm_stats.py
  online_norm (x - mu) / sqrt(var + eps) with the running statistics of the rows before each
             row (tokens as a stream, continued across steps), then gamma, beta and a clamp to
             +-5 (Chiley et al., "Online Normalization", arXiv:1905.05894); norm_stats.py

`Norm(..., kernels=...)` follows model.kernels (sharenet/kernels/__init__.py): on the Pallas
path layernorm, rmsnorm and crmsnorm run sharenet/kernels/norms.py's fused kernel, which also
takes the residual add before the norm (`Norm(...)(x, residual)` -> (x + residual, y)); the
other kinds, and the default kernels='xla', run the jnp code below.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet import kernels as kernel_lib
from sharenet.kernels import norms as norm_kernels
from sharenet.models import norm_stats
from sharenet.models.params import param
from sharenet.models.sections import STATS_NORMS, NormConfig

KINDS = ('layernorm', 'rmsnorm', 'crmsnorm', 'scalenorm', 'dyt', 'l2', 'none', 'lpnorm',
         'powernorm', 'unified_norm', 'online_norm')


class Norm(nn.Module):
  """One activation norm over the last axis; `kind` is one of KINDS.

  `role` (norm_in | norm_out) and `branch` are recorded on its parameters
  (sharenet/models/params.py).
  `kernels` is model.kernels: where it selects Pallas, the kinds in norm_kernels.KINDS use the
  fused kernel, with the same parameters (names, collection, roles).

  Called as norm(x) -> y, or norm(x, residual) -> (s, y) with s = x + residual and y = norm(s),
  fused into one pass on the kernel path.
  """
  kind: str = 'rmsnorm'
  eps: float = 1e-6
  collection: str = 'params'
  axis_name: str = 'embed'
  param_dtype: jnp.dtype = jnp.float32
  dyt_alpha: float = 0.5
  p: float = 2.0   # lpnorm's order
  stats: Any = None   # a statistics norm's options: the model's NormConfig (None: defaults)
  role: str = 'norm_in'
  branch: str | None = None
  kernels: str = 'xla'

  @nn.compact
  def __call__(self, x: jax.Array, residual: jax.Array | None = None):
    if self.kind in norm_kernels.KINDS and kernel_lib.use_pallas(self.kernels):
      d = x.shape[-1]
      vec = lambda name, use: param(
          self, name, (d,), (self.axis_name,), self.role,
          init=nn.initializers.ones if use == 'gain' else nn.initializers.zeros,
          collection=self.collection, dtype=self.param_dtype, branch=self.branch, use=use)
      gain = vec('scale', 'gain')
      bias = vec('bias', 'shift') if self.kind == 'layernorm' else None
      s, y = norm_kernels.add_norm_auto(x, residual, gain, bias,
                                        kind=self.kind, eps=self.eps, kernels=self.kernels)
      return y if residual is None else (s, y)
    if residual is not None:
      s = x + residual
      return s, self._norm(s)
    return self._norm(x)

  def _norm(self, x: jax.Array) -> jax.Array:
    """The jnp norm (called from __call__, so its parameters are created in its scope)."""
    if self.kind == 'none':
      return x
    if self.kind not in KINDS:
      raise ValueError(f'unknown norm {self.kind!r}; valid: {", ".join(KINDS)}')
    d = x.shape[-1]
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    bshape = (1,) * (x.ndim - 1) + (d,)

    def vec(name, use):   # a gain starts at ones, a shift at zeros
      init = nn.initializers.ones if use == 'gain' else nn.initializers.zeros
      return param(self, name, (d,), (self.axis_name,), self.role, init=init,
                   collection=self.collection, dtype=self.param_dtype, branch=self.branch,
                   use=use).reshape(bshape)

    def scalar(name, value):
      return param(self, name, (), (), self.role, init=nn.initializers.constant(value),
                   collection=self.collection, dtype=self.param_dtype, branch=self.branch)

    sq = jnp.sum(jnp.square(xf), axis=-1, keepdims=True)
    if self.kind == 'l2':
      return (xf * jax.lax.rsqrt(jnp.maximum(sq, self.eps ** 2))).astype(x.dtype)
    if self.kind == 'scalenorm':
      y = scalar('g', math.sqrt(d)) * xf * jax.lax.rsqrt(jnp.maximum(sq, self.eps ** 2))
      return y.astype(x.dtype)
    if self.kind == 'dyt':
      y = jnp.tanh(scalar('alpha', self.dyt_alpha) * xf) * vec('scale', 'gain')
      return (y + vec('bias', 'shift')).astype(x.dtype)
    if self.kind in STATS_NORMS:
      apply = norm_stats.APPLY[self.kind]
      return apply(self, x, vec('scale', 'gain').reshape(d), vec('bias', 'shift').reshape(d),
                   self.eps, self.stats or NormConfig())
    if self.kind == 'lpnorm':
      xc = xf - jnp.mean(xf, axis=-1, keepdims=True)
      moment = jnp.mean(jnp.maximum(jnp.abs(xc), 1e-30) ** self.p, axis=-1, keepdims=True)
      y = xc * (moment + self.eps) ** (-1.0 / self.p) * vec('scale', 'gain')
      return (y + vec('bias', 'shift')).astype(x.dtype)
    if self.kind == 'layernorm':
      xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
      sq = jnp.sum(jnp.square(xf), axis=-1, keepdims=True)
    if self.kind == 'crmsnorm':
      total = jnp.sum(xf, axis=-1, keepdims=True)
      ms = (sq + jnp.square(total)) / (d + 1)
    else:
      ms = sq / d
    y = xf * jax.lax.rsqrt(ms + self.eps) * vec('scale', 'gain')
    if self.kind == 'layernorm':
      y = y + vec('bias', 'shift')
    return y.astype(x.dtype)
