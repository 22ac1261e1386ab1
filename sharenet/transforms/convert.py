"""One-shot conversions between architectures, each function-preserving where the math allows.

Norm conversions follow Jiang et al., Pre-RMSNorm and Pre-CRMSNorm Transformers (arXiv:2305.14858).

  ln_to_rms      Pre-LN -> Pre-RMSNorm: LN biases beta are folded into biases of the linear
                 maps reading the normalized stream; residual writers are recentred (W - mean
                 over 'embed', the *last* axis of a Flax (in, out) kernel); a tied table is
                 recentred in the forward pass instead (model.center_embedding) so the readout
                 keeps using it.
  rms_to_crms    Pre-RMSNorm with a zero-mean stream -> Pre-CRMSNorm: gains gamma are
                 folded into the readers, writers drop the last 'embed' coordinate, readers take
                 W[:-1] - W[-1:] along 'embed'; the stream is d_model - 1 wide (head_dim is kept
                 explicitly). A tied table becomes an untied embedding + readout, since the
                 compressed writer (E[:, :-1]) and reader (E^T[:-1] - E^T[-1:]) differ.
  fold_unified_norm  Unified Norm -> no norm (Yang et al., arXiv:2208.01313): in eval mode
                 each norm is the per-channel affine map gamma x / sqrt(running_var + eps) +
                 beta, so its scale multiplies the 'embed' input rows of the readers (the
                 readout for the final norm; a tied table becomes an untied readout) and beta
                 through them becomes their bias. Pre placement, untied plans.

Untied -> recursive (config.to=recursive) lives in transforms/recursive.py, DirectShare
head-wise sharing (config.to=head_shared) in transforms/head_share.py, the Mixture-of-LoRAs merge
(config.to=merge_lora_experts) in transforms/lora_merge.py.

CLI: python convert.py --workdir SRC --out DST
     --config.to=rmsnorm|crmsnorm|recursive|head_shared|merge_lora_experts [...]
(sharenet.main.convert_workdir.convert_workdir) writes DST/config.json and a checkpoint (fresh
optimizer
state and data iterator) that eval.py reads and train.py continues with
`--config configs/workdir.py:DST`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.config import compat
from sharenet.errors import require
from sharenet.models import DecoderLM, ModelConfig, init_variables, param_table
from sharenet.models.params import ParamInfo

Path = tuple[str, ...]


def _part(table: dict[Path, ParamInfo], module: Path, use: str) -> Path:
  """Path of a norm module's gain ('gain') or bias ('shift') leaf."""
  (path,) = [p for p, i in table.items() if i.module == module and i.use == use]
  return path


def _stream_norms(table: dict[Path, ParamInfo]) -> list[tuple[Path, list[Path]]]:
  """(input norm module, its reader kernels) per block branch, from the role table.

  A branch's input norm is its 'params' norm_in over 'embed' (QK-norms normalise head_dim);
  under pre placement (the callers check) exactly that branch's readers read its output.
  """
  norms = sorted({i.module: i for i in table.values() if i.path[0] == 'params' and
                  i.role == 'norm_in' and i.branch is not None and 'embed' in i.axes}.items())
  out = []
  for module, n in norms:
    block = module[:-1]
    readers = sorted(p for p, i in table.items() if i.role == 'reader' and
                     i.branch == n.branch and p[:len(block)] == block)
    out.append((module, readers))
  return out


def _writers(table: dict[Path, ParamInfo]) -> list[Path]:
  """Kernels of the block branches that write the residual stream, and their biases (a model
  with model.proj_bias=all, GPT-2's): a writer's bias is written to the stream as its output."""
  kernels = sorted(p for p, i in table.items() if i.role == 'writer')
  modules = {table[k].module for k in kernels}
  return kernels + sorted(p for p, i in table.items() if i.role == 'bias' and
                          i.module in modules)


def _one(table: dict[Path, ParamInfo], role: str, branch: str | None = None) -> Path | None:
  """The path of the only leaf with `role` outside the blocks (None if absent)."""
  paths = [p for p, i in table.items() if i.role == role and i.branch == branch]
  require(len(paths) <= 1, f'conversion expects one top-level {role} leaf, got {paths}')
  return paths[0] if paths else None


def _final_norm(table: dict[Path, ParamInfo]) -> Path:
  """Module of the final norm (the norm_out outside the blocks)."""
  (module,) = {i.module for i in table.values() if i.role == 'norm_out' and i.branch is None}
  return module


def _bias_of(table: dict[Path, ParamInfo], kernel: Path) -> Path:
  """Path of the bias beside a kernel in `table` (a model with reader_bias=True)."""
  (path,) = [p for p, i in table.items() if i.role == 'bias' and i.module == kernel[:-1]]
  return path


def _center(w, axis=-1):
  return w - jnp.mean(w, axis=axis, keepdims=True)


def _fold_bias(flat: dict, kernel_path: tuple, bias_path: tuple, beta, stacked: bool) -> None:
  """bias += beta @ W over the 'embed' input axis of a reader kernel."""
  w = flat[kernel_path]
  b = jnp.einsum('kd,kd...->k...', beta, w) if stacked else jnp.einsum('d,d...->...', beta, w)
  flat[bias_path] = flat.get(bias_path, 0) + b


def ln_to_rms(cfg: ModelConfig, variables: Any) -> tuple[ModelConfig, Any]:
  """Pre-LN -> Pre-RMSNorm computing the same function (see the module docstring)."""
  require(cfg.norm.kind == 'layernorm',
          f'config.to=rmsnorm needs a layernorm model, got {cfg.norm.kind}')
  compat.check_action('convert_rmsnorm', cfg.table_config(), 'config.to=rmsnorm')
  new_cfg = cfg.derive(norm={'kind': 'rmsnorm'}, reader_bias=True,
                       center_embedding=cfg.center_embedding or cfg.tie_embeddings)
  table, new_table = param_table(cfg), param_table(new_cfg)
  flat = dict(flatten_dict(variables['params']))
  flat = {('params',) + k: v for k, v in flat.items()}
  for norm, readers in _stream_norms(table):
    beta = flat.pop(_part(table, norm, 'shift'))
    for r in readers:
      _fold_bias(flat, r, _bias_of(new_table, r), beta, stacked=True)
  for w in _writers(table):
    flat[w] = _center(flat[w])
  beta = flat.pop(_part(table, _final_norm(table), 'shift'))
  emb, pos = _one(table, 'embedding'), _one(table, 'pos_embed')
  if cfg.tie_embeddings:
    bias = _one(new_table, 'bias')
    flat[bias] = flat.get(bias, 0) + flat[emb] @ beta
  else:
    readout = _one(table, 'readout')
    _fold_bias(flat, readout, _bias_of(new_table, readout), beta, stacked=False)
    flat[emb] = _center(flat[emb])
  if pos is not None:
    flat[pos] = _center(flat[pos])
  out = dict(variables)
  out['params'] = unflatten_dict({k[1:]: v for k, v in flat.items()})
  return new_cfg, _fill_missing(new_cfg, out)


def fold_unified_norm(cfg: ModelConfig, variables: Any, stats: Any) -> tuple[ModelConfig, Any]:
  """A Unified-Norm model in eval mode -> the same function with no norms, the norms' affine
  maps folded into the linear maps that read them (module docstring); `stats` is the model's
  norm_stats collection (TrainState.tstate)."""
  require(cfg.norm.kind == 'unified_norm', f'config.to=fold_unified_norm needs a model with '
          f'model.norm.kind=unified_norm, got {cfg.norm.kind}; valid: a unified_norm run')
  compat.check_action('convert_fold_unified_norm', cfg.table_config(),
                      'config.to=fold_unified_norm')
  new_cfg = cfg.derive(norm={'kind': 'none'}, reader_bias=True, tie_embeddings=False)
  table, new_table = param_table(cfg), param_table(new_cfg)
  flat = {('params',) + k: v for k, v in flatten_dict(variables['params']).items()}
  running = flatten_dict(stats)
  eps = cfg.norm.eps

  def affine(module):   # (scale, shift) of a norm in eval mode, shaped as its gain
    gain, beta = flat.pop(_part(table, module, 'gain')), flat.pop(_part(table, module, 'shift'))
    rv = jnp.reshape(running[module[1:] + ('running_var',)], gain.shape)
    return gain / jnp.sqrt(rv + eps), beta

  for norm, readers in _stream_norms(table):
    scale, beta = affine(norm)
    for r in readers:
      _fold_bias(flat, r, _bias_of(new_table, r), beta, stacked=True)
      w = flat[r]
      flat[r] = w * scale.reshape(scale.shape + (1,) * (w.ndim - 2))
  scale, beta = affine(_final_norm(table))
  readout = _one(new_table, 'readout')
  if cfg.tie_embeddings:
    head, old_bias = flat[_one(table, 'embedding')].T, _one(table, 'bias')
  else:
    head = flat[readout]
    old_bias = next((p for p, i in table.items() if i.role == 'bias' and
                     i.module == readout[:-1]), None)
  bias = (flat.pop(old_bias) if old_bias is not None else 0) + beta @ head
  flat[_bias_of(new_table, readout)] = bias
  flat[readout] = scale[:, None] * head
  out = {'params': unflatten_dict({k[1:]: v for k, v in flat.items()})}
  return new_cfg, _fill_missing(new_cfg, out)


def _compress_reader(w, axis: int):
  """x_d = -sum_{i<d} x_i  =>  W' = W[:-1] - W[-1:] along the input 'embed' axis."""
  head = jax.lax.slice_in_dim(w, 0, w.shape[axis] - 1, axis=axis)
  last = jax.lax.slice_in_dim(w, w.shape[axis] - 1, w.shape[axis], axis=axis)
  return head - last


def _drop_last(w, axis: int = -1):
  return jax.lax.slice_in_dim(w, 0, w.shape[axis] - 1, axis=axis)


def writers_zero_mean(cfg: ModelConfig, variables: Any, tol: float = 1e-5) -> bool:
  """True if every residual writer has zero mean over 'embed' (relative to its scale)."""
  flat = {('params',) + k: v for k, v in flatten_dict(variables['params']).items()}
  table = param_table(cfg)
  ws = [flat[w] for w in _writers(table)]
  if not cfg.tie_embeddings and not cfg.center_embedding:
    ws.append(flat[_one(table, 'embedding')])
  pos = _one(table, 'pos_embed')
  if pos is not None and not cfg.center_embedding:
    ws.append(flat[pos])
  return all(float(jnp.max(jnp.abs(jnp.mean(w, -1)))) <= tol * float(jnp.max(jnp.abs(w)) + 1e-30)
             for w in ws)


def rms_to_crms(cfg: ModelConfig, variables: Any) -> tuple[ModelConfig, Any]:
  """Pre-RMSNorm over a zero-mean stream -> Pre-CRMSNorm on d_model - 1 coordinates."""
  require(cfg.norm.kind == 'rmsnorm', f'config.to=crmsnorm needs an rmsnorm model, got '
          f'{cfg.norm.kind}; convert a layernorm model with config.to=rmsnorm first')
  compat.check_action('convert_crmsnorm', cfg.table_config(), 'config.to=crmsnorm')
  require(writers_zero_mean(cfg, variables),
          'the residual writers are not zero-mean, so RMSNorm -> CRMSNorm would change the '
          'function; valid sources: a config.to=rmsnorm conversion or a model trained with '
          'transforms.reparam=zero_mean_writers')
  flat = {('params',) + k: v for k, v in flatten_dict(variables['params']).items()}
  d = cfg.d_model
  new_cfg = cfg.derive(norm={'kind': 'crmsnorm'}, d_model=d - 1, head_dim=cfg.d_head,
                       tie_embeddings=False, center_embedding=False, reader_bias=True)
  table, new_table = param_table(cfg), param_table(new_cfg)
  for norm, readers in _stream_norms(table):
    gain = _part(table, norm, 'gain')
    gamma = flat[gain]                                               # (K, d)
    flat[gain] = jnp.ones((gamma.shape[0], d - 1), gamma.dtype)
    for r in readers:
      w = flat[r]
      w = w * gamma.reshape(gamma.shape + (1,) * (w.ndim - 2))
      flat[r] = _compress_reader(w, axis=1)
  for w in _writers(table):
    flat[w] = _drop_last(flat[w])
  gain = _part(table, _final_norm(table), 'gain')
  gamma = flat[gain]
  flat[gain] = jnp.ones((d - 1,), gamma.dtype)
  emb, pos, readout = _one(table, 'embedding'), _one(table, 'pos_embed'), _one(new_table, 'readout')
  e = flat[emb]
  if cfg.tie_embeddings:
    head = e.T
    logits_bias = _one(table, 'bias')
    if logits_bias is not None:
      flat[_bias_of(new_table, readout)] = flat.pop(logits_bias)
  else:
    head = flat[readout]
  flat[readout] = _compress_reader(gamma[:, None] * head, axis=0)
  if cfg.center_embedding:   # the stored table is recentred so the forward need not do it
    e = _center(e)
  flat[emb] = _drop_last(e)
  if pos is not None:
    p = flat[pos]
    flat[pos] = _drop_last(_center(p) if cfg.center_embedding else p)
  out = dict(variables)
  out['params'] = unflatten_dict({k[1:]: v for k, v in flat.items()})
  return new_cfg, _fill_missing(new_cfg, out)


def _fill_missing(cfg: ModelConfig, variables: Any) -> Any:
  """Checks the converted tree against the new model's; absent biases become zeros."""
  ref = jax.eval_shape(lambda: init_variables(DecoderLM(cfg), jax.random.key(0)))
  roles = param_table(cfg)
  out = {}
  for coll, tree in ref.items():
    have = flatten_dict(variables.get(coll, {}))
    want = flatten_dict(tree)
    extra = set(have) - set(want)
    if extra:
      raise AssertionError(f'conversion produced unknown leaves {sorted(extra)[:3]}')
    filled = {}
    for k, s in want.items():
      if k in have:
        if tuple(have[k].shape) != tuple(s.shape):
          raise AssertionError(f'{coll}/{"/".join(k)}: {have[k].shape} != {s.shape}')
        filled[k] = jnp.asarray(have[k], s.dtype)
      elif roles[(coll,) + k].role == 'bias':
        filled[k] = jnp.zeros(s.shape, s.dtype)
      else:
        raise AssertionError(f'conversion is missing {coll}/{"/".join(k)}')
    out[coll] = unflatten_dict(filled)
  return out
