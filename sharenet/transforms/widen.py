"""Growing a trained model wider by the row-column (RC) mean-field ansatz (convert.py
--config.to=wider).

The RC ansatz (the mean-field account of zero-shot weight transfer, "model growth"): the rows
and columns of a trained network's matrices are samples of a distribution common to networks
of every width, so a wider network is made by sampling more of them from the trained one.
Here every grown axis (the residual width 'embed', the MLP width 'mlp', the attention heads
'heads' / 'kv_heads'; head_dim and the vocabulary never grow) gets an index map sigma from the
new units to the trained ones: the trained units keep their place, and the new ones are drawn
from the trained units' empirical distribution: whole rounds of all of them (when the new width
is a multiple of the old, each unit is copied the same number of times), then the remainder
drawn without replacement. Every parameter is gathered by sigma along each of its grown axes;
along a fan-in axis (ParamInfo.num_in: the inputs of a kernel, the residual axis of the
readout, a LoRA A factor, a router) it is also divided by the multiplicity of the unit it
copies, the mean-field 1/n width rule, so each copy's contribution sums back to the unit's.

What is kept: every matrix product exactly (a linear map reads each unit's copies with weights
summing to the unit's weight). The norms over the residual width are kept exactly when every
unit has the same multiplicity (a new width that is a multiple of the old: the stream is the old
one tiled, its mean and RMS unchanged), so then the grown model computes the trained model's
function; otherwise the norms see the resampled stream's statistics and the function moves
(convert.py reports the zero-shot loss and logit difference either way). Heads grow as whole
heads (head_dim kept); under grouped-query attention whole groups are copied (a query head
copies the head its kv head's copy serves), so the ratio heads / kv heads is kept. The
parametrization's per-leaf forward multipliers are applied before growing and divided out at
the new width (sharenet/main/convert_workdir.py), and the readout is scaled by the ratio of the
two widths' logits multipliers (muP's 1 / m_d, a model-level scalar) and the query kernel by
their attention multipliers', so under SP and muP the grown model computes the products above.
A QK-norm (which renormalises the scaled queries), tied embeddings (the readout is the embedding,
whose residual axis is an output axis) and u-muP's unit-scaled matmuls (1 / sqrt(fan-in) in the
forward pass) do not keep the function at the new width: the zero-shot report says by how much.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.errors import ConfigError
from sharenet.models import param_table
from sharenet.models import scaling
from sharenet.models.config import ModelConfig
from sharenet.models.params import STACK_AXES

GROWN_AXES = ('embed', 'mlp', 'heads', 'kv_heads')


def target(cfg: ModelConfig, d_model: int, mlp_dim: int = 0, num_heads: int = 0
           ) -> ModelConfig:
  """The wider config: d_model, mlp_dim (0: scaled with d_model) and num_heads (0: head_dim
  kept); kv heads keep their group size. One ConfigError line for a width that does not grow
  or a head count that does not fit."""
  d, m, h, k, dh = cfg.d_model, cfg.mlp_dim, cfg.num_heads, cfg.kv_heads, cfg.d_head
  if d_model < d or d_model <= 0:
    raise ConfigError(f'config.d_model={d_model}: a wider model needs d_model >= the source\'s '
                      f'{d}; valid: e.g. {2 * d}')
  new_m = mlp_dim or (m * d_model // d if m * d_model % d == 0 else round(m * d_model / d))
  new_h = num_heads or (d_model // dh if d_model % dh == 0 else 0)
  if not new_h or new_h * dh != d_model and not cfg.head_dim:
    raise ConfigError(f'config.d_model={d_model} is not divisible by the source\'s head_dim '
                      f'{dh} (heads grow whole, head_dim kept); valid: a multiple of {dh}, or '
                      f'config.num_heads with d_model = num_heads x {dh}')
  if new_m < m or new_h < h:
    raise ConfigError(f'config.mlp_dim={new_m} / num_heads={new_h}: a wider model keeps at '
                      f'least the source\'s {m} / {h}; valid: values >= those')
  if new_h * k % h:
    raise ConfigError(f'config.num_heads={new_h} does not keep the source\'s {h // k} query '
                      f'heads per kv head; valid: a multiple of {h // k}')
  if (d_model, new_m, new_h) == (d, m, h):
    raise ConfigError(f'config.to=wider: d_model={d_model}, mlp_dim={new_m} and '
                      f'num_heads={new_h} are the source\'s; valid: a larger d_model')
  changes: dict[str, Any] = {'d_model': d_model, 'mlp_dim': new_m, 'num_heads': new_h}
  if cfg.num_kv_heads:
    changes['num_kv_heads'] = new_h * k // h
  # the base (proxy) model is the source's: its widths pinned, not re-derived at the new width
  base_d, base_h = scaling.base_widths(cfg)
  changes['parametrization'] = dataclasses.replace(cfg.parametrization, base_d_model=base_d,
                                                   base_num_heads=base_h)
  return cfg.derive(**changes)


def index_map(n: int, new: int, rng: np.random.Generator) -> np.ndarray:
  """sigma: new units -> trained units (the module docstring's draw)."""
  rounds, rest = divmod(new - n, n)
  extra = [np.arange(n)] * rounds + [np.sort(rng.choice(n, rest, replace=False))]
  return np.concatenate([np.arange(n)] + extra).astype(np.int64)


class Draws:
  """The index maps sigma of one growth, one per (axis, old size, new size): the model's widths
  drawn up front (a query head copies the head of its group that its kv head's copy serves), an
  axis of another size (an expert's own hidden width) drawn when first met, so every leaf that
  shares an axis gathers it alike."""

  def __init__(self, cfg: ModelConfig, new_cfg: ModelConfig, seed: int = 0):
    self.rng = np.random.default_rng(seed)
    self.maps: dict[tuple[str, int, int], np.ndarray] = {}
    for name, old, new in (('embed', cfg.d_model, new_cfg.d_model),
                           ('mlp', cfg.mlp_dim, new_cfg.mlp_dim),
                           ('kv_heads', cfg.kv_heads, new_cfg.kv_heads)):
      self.get(name, old, new)
    group = cfg.num_heads // cfg.kv_heads
    h = np.arange(new_cfg.num_heads)
    kv = self.maps[('kv_heads', cfg.kv_heads, new_cfg.kv_heads)]
    self.maps[('heads', cfg.num_heads, new_cfg.num_heads)] = kv[h // group] * group + h % group

  def get(self, name: str, old: int, new: int) -> np.ndarray:
    key = (name, old, new)
    if key not in self.maps:
      self.maps[key] = index_map(old, new, self.rng)
    return self.maps[key]


def _model_scalar_ratio(cfg: ModelConfig, new_cfg: ModelConfig, info: Any) -> float:
  """What a leaf is multiplied by so that the new width's model-level scalars compute the old
  ones' products: the readout by the logits multipliers' ratio (muP's 1 / m_d), the query
  kernel by the attention multipliers' (muP's base head width over d_head, the base's heads
  growing with the model's), unless a QK-norm renormalises the queries."""
  if info.role == 'readout':
    return cfg.logits_mult / new_cfg.logits_mult
  if info.role == 'reader' and info.use == 'query' and cfg.norm.qk_norm == 'none':
    return cfg.attn_mult / new_cfg.attn_mult
  return 1.0


def widen(cfg: ModelConfig, variables: Any, new_cfg: ModelConfig, seed: int = 0) -> Any:
  """`variables` (effective: the weights the model applies) of `cfg` grown to `new_cfg`."""
  draws = Draws(cfg, new_cfg, seed)
  old, new = param_table(cfg), param_table(new_cfg)
  out = {}
  for collection, tree in variables.items():
    flat = {}
    for path, leaf in flatten_dict(tree).items():
      key = (collection,) + path
      info, want = old.get(key), new[key].shape if key in new else None
      if info is None or want is None:
        raise ConfigError(f'config.to=wider: {"/".join(key)} is not in both models\' role '
                          f'tables; valid: a model whose parameters models/params.py creates')
      x = np.asarray(leaf)
      lead = 0
      while lead < len(info.axes) and info.axes[lead] in STACK_AXES:
        lead += 1
      for ax, name in enumerate(info.axes):
        if name in GROWN_AXES and len(want) == x.ndim and want[ax] != x.shape[ax]:
          sigma = draws.get(name, x.shape[ax], want[ax])
          x = np.take(x, sigma, axis=ax)
          if lead <= ax < lead + info.num_in:   # a fan-in axis: copies share the unit's weight
            shape = [1] * x.ndim
            shape[ax] = -1
            x = x / np.bincount(sigma)[sigma].reshape(shape).astype(x.dtype)
      if want != x.shape:
        raise ConfigError(f'config.to=wider: {"/".join(key)} (axes {info.axes}) grows to '
                          f'{x.shape}, but the wider model holds {want}; valid: a model whose '
                          f'width-dependent axes are {", ".join(GROWN_AXES)}')
      x = x * _model_scalar_ratio(cfg, new_cfg, info)
      flat[path] = jnp.asarray(x, np.asarray(leaf).dtype)
    out[collection] = unflatten_dict(flat)
  return out
