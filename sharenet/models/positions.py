"""Attention's position step: QK-norm, then rotary positions (RoPE), for queries and keys.

QK-norm (model.norm.qk_norm): rms, a learned gain over head_dim (ViT-22B); l2, unit vectors
(Henry et al., arXiv:2010.04245). RoPE applies under model.position=rope; under learned
(added to the embedding, models/lm.py) or none, this step only normalises.

Built inside the attention module's compact call: its norms are that module's children
'q_norm' and 'k_norm' (none when the query is the key: models/projections.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sharenet.models.config import ModelConfig
from sharenet.models.layers import rope
from sharenet.models.projections import BRANCH, Projected
from sharenet.models.norms import Norm


def frequencies(cfg: ModelConfig, d: int) -> np.ndarray:
  """RoPE's d/2 angular frequencies base^(-2i/d) under model.rope_scaling (float64 constants;
  the rotation casts them to float32):

  - linear: every frequency divided by `factor` (position interpolation, Chen et al.,
    arXiv:2306.15595);
  - llama3 (Llama 3.1's rope_type 'llama3', as transformers' _compute_llama3_parameters): with
    L = original_max_len and the wavelength w = 2 pi / f, a frequency with w > L / low_freq_factor
    is divided by `factor`, one with w < L / high_freq_factor is kept, and between them
    f' = (1 - s) f / factor + s f with s = (L / w - low_freq_factor) / (high_freq_factor -
    low_freq_factor).
  """
  freq = cfg.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  rs = cfg.rope_scaling
  if rs.kind == 'linear':
    return freq / rs.factor
  if rs.kind == 'llama3':
    wavelen = 2 * np.pi / freq
    low_wavelen = rs.original_max_len / rs.low_freq_factor
    high_wavelen = rs.original_max_len / rs.high_freq_factor
    smooth = ((rs.original_max_len / wavelen - rs.low_freq_factor)
              / (rs.high_freq_factor - rs.low_freq_factor))
    between = (1 - smooth) * freq / rs.factor + smooth * freq
    return np.where(wavelen > low_wavelen, freq / rs.factor,
                    np.where(wavelen < high_wavelen, freq, between))
  return freq


def rotate(cfg: ModelConfig, x_BTHD: jax.Array, positions: jax.Array) -> jax.Array:
  """RoPE at `positions`, (T,) or per sequence (B, T); the identity unless model.position=rope."""
  if cfg.position != 'rope':
    return x_BTHD
  freq = None if cfg.rope_scaling.kind == 'none' else jnp.asarray(
      frequencies(cfg, x_BTHD.shape[-1]), jnp.float32)
  if positions.ndim == 2:
    return jax.vmap(lambda x, p: rope(x[None], p, cfg.rope_base, freq)[0])(x_BTHD, positions)
  return rope(x_BTHD, positions, cfg.rope_base, freq)


class PositionStep:
  """QK-norm and RoPE of one attention call; `keys` also places cached raw keys again."""

  def __init__(self, cfg: ModelConfig, shares_query: bool):
    self.cfg, self.shares_query = cfg, shares_query
    self.k_norm = self._norm('k_norm') if cfg.norm.qk_norm != 'none' else None
    self.q_norm = (self._norm('q_norm') if cfg.norm.qk_norm != 'none' and not shares_query
                   else None)

  def _norm(self, name: str) -> Norm:
    c = self.cfg
    return Norm('rmsnorm' if c.norm.qk_norm == 'rms' else 'l2', c.norm.eps, axis_name='head_dim',
                param_dtype=jnp.dtype(c.param_dtype), branch=BRANCH, name=name)

  def keys(self, k_BSKD: jax.Array, positions: jax.Array) -> jax.Array:
    """Keys (raw projections) normalised and rotated to `positions`."""
    return rotate(self.cfg, k_BSKD if self.k_norm is None else self.k_norm(k_BSKD), positions)

  def queries(self, qkv: Projected, positions: jax.Array) -> jax.Array:
    """The placed queries alone (a shared query is the raw key projection, placed as keys)."""
    if self.shares_query:
      return self.keys(qkv.q_BTHD, positions)
    q_BTHD = qkv.q_BTHD if self.q_norm is None else self.q_norm(qkv.q_BTHD)
    return rotate(self.cfg, q_BTHD, positions)

  def __call__(self, qkv: Projected, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q, k) of one call's projections at `positions`; a shared query is the placed key."""
    k_BTKD = self.keys(qkv.k_BTKD, positions)
    if self.shares_query:
      return k_BTKD, k_BTKD
    q_BTHD = qkv.q_BTHD if self.q_norm is None else self.q_norm(qkv.q_BTHD)
    return rotate(self.cfg, q_BTHD, positions), k_BTKD
