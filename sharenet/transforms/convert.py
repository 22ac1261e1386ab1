"""One-shot conversions between architectures, each function-preserving where the math allows.

Norm conversions follow Jiang et al., Pre-RMSNorm and Pre-CRMSNorm Transformers (arXiv:2305.14858);
the recursive conversion follows Relaxed Recursive Transformers (arXiv:2410.20672).

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
  to_recursive   untied -> recursive: each unique set from
                 Stepwise (round(linspace(0, L-1, K)), middle schemes linspace(1, L-2, K-2),
                 Python's banker's rounding as in the RRT code), Average (mean of the layers that
                 will use the set) or Lower (the first K layers; middle schemes 1..K-2 plus the
                 verbatim first and last); optional depth-wise LoRA from the truncated SVD of each
                 applied layer's residual W_l - W_shared, exact at full rank for any
                 lora_scale (B is divided by it), on the layers that hold LoRA
                 (model.sharing.lora_layers: shared = RRT's looped layers only, or all).
  to_head_shared DirectShare head-wise sharing (Cao, Yang, Zhao, arXiv:2402.11819): the heads
                 whose W_q, W_k slices best match a head of an earlier layer (cosine) take
                 that head's Q, K, V, O slices; the top config.share_rate fraction of all
                 heads is replaced. Not function-preserving; same architecture, the sharing
                 map (and the unique parameter count) goes to DST/config.json 'head_sharing'.

CLI: python convert.py --workdir SRC --out DST
     --config.to=rmsnorm|crmsnorm|recursive|head_shared [...]
(sharenet.workdir_lib.convert_workdir) writes DST/config.json and a checkpoint (fresh optimizer
state and data iterator) that eval.py reads and train.py continues with
`--config configs/workdir.py:DST`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables, layout, param_table
from sharenet.models.accounting import params_unique
from sharenet.models.config import LORA_LAYERS
from sharenet.params import KERNEL_ROLES, NORM_ROLES, PER_LAYER, ParamInfo

INITS = ('stepwise', 'average', 'lower')
RECURSIVE_SCHEMES = ('universal', 'cycle', 'sequence', 'middle_cycle', 'middle_sequence')
Path = tuple[str, ...]


def _require(ok: bool, msg: str) -> None:
  if not ok:
    raise ConfigError(msg)


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
  """Kernels of the block branches that write the residual stream."""
  return sorted(p for p, i in table.items() if i.role == 'writer')


def _one(table: dict[Path, ParamInfo], role: str, branch: str | None = None) -> Path | None:
  """The path of the only leaf with `role` outside the blocks (None if absent)."""
  paths = [p for p, i in table.items() if i.role == role and i.branch == branch]
  _require(len(paths) <= 1, f'conversion expects one top-level {role} leaf, got {paths}')
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
  _require(cfg.norm == 'layernorm', f'config.to=rmsnorm needs a layernorm model, got {cfg.norm}')
  _require(cfg.norm_placement == 'pre', f'config.to=rmsnorm needs norm placement pre (the '
           f'equivalence uses that only norms read the stream), got {cfg.norm_placement}')
  _require(not cfg.untie_norms and not cfg.lora_rank,
           'conversion of norms supports untie_norms=False and lora_rank=0 (folding into tied '
           'readers would untie them)')
  new_cfg = dataclasses.replace(cfg, norm='rmsnorm', reader_bias=True,
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
  return new_cfg.validate(), _fill_missing(new_cfg, out)


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
  _require(cfg.norm == 'rmsnorm' and cfg.norm_placement == 'pre',
           f'config.to=crmsnorm needs a pre-rmsnorm model, got {cfg.norm_placement}-{cfg.norm}; '
           f'convert a layernorm model with config.to=rmsnorm first')
  _require(not cfg.untie_norms and not cfg.lora_rank,
           'conversion of norms supports untie_norms=False and lora_rank=0')
  _require(writers_zero_mean(cfg, variables),
           'the residual writers are not zero-mean, so RMSNorm -> CRMSNorm would change the '
           'function; valid sources: a config.to=rmsnorm conversion or a model trained with '
           'transforms.reparam=zero_mean_writers')
  flat = {('params',) + k: v for k, v in flatten_dict(variables['params']).items()}
  d = cfg.d_model
  new_cfg = dataclasses.replace(cfg, norm='crmsnorm', d_model=d - 1, head_dim_override=cfg.head_dim,
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
  return new_cfg.validate(), _fill_missing(new_cfg, out)


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


def source_layers(cfg: ModelConfig, num_unique: int, scheme: str, init: str) -> list[list[int]]:
  """For each unique set of the target plan, the source layers it is initialised from."""
  plan = ModelConfig(num_layers=cfg.num_layers, scheme=scheme, num_unique=num_unique).plan
  L = cfg.num_layers
  if init == 'average':
    return [list(plan.uses(u)) for u in range(plan.num_unique)]
  middle = scheme.startswith('middle_')
  k = plan.num_unique - 2 if middle else plan.num_unique
  lo, hi = (1, L - 2) if middle else (0, L - 1)
  if init == 'stepwise':
    # Python's round (half to even), as the RRT code's selection_initialize.
    picks = [round(float(x)) for x in np.linspace(lo, hi, k)]
  else:
    picks = list(range(lo, lo + k))
  if middle:
    picks = [0] + picks + [L - 1]
  return [[p] for p in picks]


def to_recursive(cfg: ModelConfig, variables: Any, scheme: str, num_unique: int, init: str,
                 lora_rank: int = 0, lora_init: str = 'zero', lora_targets: tuple = (),
                 untie_norms: bool = False, seed: int = 0, lora_layers: str = 'shared'
                 ) -> tuple[ModelConfig, Any]:
  """Untied -> recursive with `num_unique` stored sets (see the module docstring)."""
  _require(cfg.scheme == 'untied', f'config.to=recursive needs an untied source, got {cfg.scheme}')
  _require(scheme in RECURSIVE_SCHEMES,
           f'config.scheme={scheme!r} is unknown; valid: {", ".join(RECURSIVE_SCHEMES)}')
  _require(init in INITS, f'config.init={init!r} is unknown; valid: {", ".join(INITS)}')
  _require(lora_init in ('zero', 'svd'),
           f'config.lora_init={lora_init!r} is unknown; valid: zero, svd')
  _require(not cfg.lora_rank, 'the source already has depth-wise LoRA; valid: lora_rank=0')
  _require(lora_layers in LORA_LAYERS, f'config.lora_layers={lora_layers!r} is unknown; valid: '
           f'{", ".join(LORA_LAYERS)}')
  new_cfg = dataclasses.replace(
      cfg, scheme=scheme, num_unique=num_unique, repeats=0, pattern='', lora_rank=lora_rank,
      lora_targets=tuple(lora_targets) or cfg.lora_targets, untie_norms=untie_norms,
      lora_layers=lora_layers).validate()
  plan = new_cfg.plan
  src = {p: v for p, v in layout.applied_params(variables['params'], cfg).items()}
  if PER_LAYER in variables:
    src.update(layout.applied_per_layer(variables[PER_LAYER], cfg))
  picks = source_layers(cfg, num_unique, scheme, init)
  target = init_variables(DecoderLM(new_cfg), jax.random.key(seed))
  shared_paths = layout.unique_sets(target['params'], new_cfg).keys()
  sets = {p: jnp.stack([jnp.mean(src[p][jnp.asarray(ls)], axis=0) for ls in picks])
          for p in shared_paths}
  out = dict(target)
  out['params'] = layout.from_unique_sets(target['params'], sets, new_cfg)
  out['params'] = {**out['params'], **{k: v for k, v in variables['params'].items()
                                       if k != 'stack'}}
  if PER_LAYER in target:
    layers = layout.applied_per_layer(target[PER_LAYER], new_cfg)
    norms = {layout.block_relative(p) for p, i in param_table(new_cfg).items()
             if p[0] == PER_LAYER and i.role in NORM_ROLES}
    for p in layers:
      if p in norms:                 # untied norm parameters: each applied layer's own
        layers[p] = src[p]
    if lora_rank and lora_init == 'svd':
      # Factors for every applied layer; from_applied_per_layer keeps only the layers that hold
      # LoRA (lora_layers=shared: not the unique first / last layers, copied exactly, so their
      # residual is zero and they need none).
      layers.update(svd_lora(src, sets, plan.index, new_cfg))
    out[PER_LAYER] = layout.from_applied_per_layer(target[PER_LAYER], layers, new_cfg)
  return new_cfg, out


def svd_lora(src: dict, sets: dict, index: tuple, cfg: ModelConfig) -> dict:
  """A_l, B_l with scale * A_l B_l = trunc_r(W_l - W_shared(l)) (RRT SVD init, arXiv:2410.20672).

  Flax kernels are (in, out): R = U S V^T, so A = U_r (in, r) and B = S_r V_r^T / scale.
  """
  out = {}
  idx = jnp.asarray(index)
  r = cfg.lora_rank
  table = param_table(cfg)
  kernels = {i.module: i for i in table.values() if i.role in KERNEL_ROLES}
  factors = {}   # block-relative kernel path -> (kernel info, {'a' | 'b': block-relative path})
  for p, i in table.items():
    if i.role == 'lora':   # A maps the kernel's fan-in to the rank: its last axis is 'lora'
      k = kernels[('params',) + i.module[1:]]
      entry = factors.setdefault(layout.block_relative(k.path), (k, {}))
      entry[1]['a' if i.axes[-1] == 'lora' else 'b'] = layout.block_relative(p)
  for kpath, (kinfo, ab) in sorted(factors.items()):
    w_src, w_tied = src[kpath], sets[kpath][idx]               # (L, in..., out...)
    n_in = kinfo.num_in
    in_shape, out_shape = w_src.shape[1:1 + n_in], w_src.shape[1 + n_in:]
    res = (w_src - w_tied).reshape(len(index), int(np.prod(in_shape)), -1)
    u, s, vt = jnp.linalg.svd(res, full_matrices=False)
    k = min(r, s.shape[-1])
    a = jnp.zeros(res.shape[:2] + (r,), res.dtype).at[..., :k].set(u[..., :k])
    b = jnp.zeros((len(index), r, res.shape[2]), res.dtype).at[:, :k].set(
        s[:, :k, None] * vt[:, :k] / cfg.lora_scale)
    out[ab['a']] = a.reshape((len(index),) + in_shape + (r,))
    out[ab['b']] = b.reshape((len(index), r) + out_shape)
  return out


# ---- head-wise sharing (DirectShare) ---------------------------------------------------------

def head_similarity(cfg: ModelConfig, variables: Any) -> np.ndarray:
  """(L, H, L, H) cosine similarity of every head's concatenated W_q, W_k slices to every
  other head's (DirectShare's 'qk' matching function, arXiv:2402.11819)."""
  params = layout.applied_params(variables['params'], cfg)
  q = np.asarray(params[('attn', 'q', 'kernel')], np.float64)   # (L, D, H, Dh)
  k = np.asarray(params[('attn', 'k', 'kernel')], np.float64)
  L, D, H, Dh = q.shape
  heads = np.concatenate([q.transpose(0, 2, 1, 3).reshape(L, H, D * Dh),
                          k.transpose(0, 2, 1, 3).reshape(L, H, D * Dh)], axis=-1)
  unit = heads / np.linalg.norm(heads, axis=-1, keepdims=True)
  return np.einsum('lhx,mjx->lhmj', unit, unit)


def head_matches(cfg: ModelConfig, variables: Any) -> tuple[np.ndarray, np.ndarray]:
  """(match (L, H, 2) = (layer, head) of each head's best match, its similarity (L, H)).

  As DirectShare's find_match.py: a head of layer l is matched against every head of the
  layers before it (so layer 0 has no match: similarity -inf), the first maximum in (layer,
  head) order.
  """
  sim = head_similarity(cfg, variables)
  L, H = sim.shape[:2]
  match = np.zeros((L, H, 2), np.int64)
  best = np.full((L, H), -np.inf)
  for l in range(1, L):
    flat = sim[l, :, :l].reshape(H, l * H)
    i = np.argmax(flat, axis=-1)
    match[l, :, 0], match[l, :, 1] = i // H, i % H
    best[l] = flat[np.arange(H), i]
  return match, best


def replaced_heads(cfg: ModelConfig, best: np.ndarray, share_rate: float) -> list[tuple[int, int]]:
  """The int(share_rate * L * H) heads of highest best-match similarity (layer 0 excluded),
  ties broken as DirectShare's getHeadIndex (a stable ascending sort of heads listed from the
  last layer down, head 0 first; the last n are taken)."""
  L, H = best.shape
  n = int(share_rate * L * H)
  _require(0 <= share_rate and n <= (L - 1) * H,
           f'config.share_rate={share_rate} replaces {n} heads, but only the {(L - 1) * H} heads '
           f'after layer 0 have a match; valid: 0 <= share_rate <= {(L - 1) / L:.4g}')
  order = [(l, h) for l in range(L - 1, 0, -1) for h in range(H)]
  ranked = sorted(order, key=lambda lh: best[lh])
  return sorted(ranked[len(ranked) - n:]) if n else []


def to_head_shared(cfg: ModelConfig, variables: Any, share_rate: float
                   ) -> tuple[ModelConfig, Any, dict[str, Any]]:
  """DirectShare (Cao, Yang, Zhao, "Head-wise Shareable Attention for Large Language Models",
  arXiv:2402.11819; reference code zouyingcao/DirectShare): each replaced head takes its match's
  Q, K, V slices (and biases) and O slice, copied from the source model (a match that is itself
  replaced still lends its original weights, as the reference copies from the unmodified model).

  Returns (the same architecture, the variables with the copied slices, the sharing record:
  replaced heads with their source and similarity, the number of distinct heads and the stored
  parameters once every duplicated head is counted once, `params_unique`).
  """
  _require(cfg.scheme == 'untied', f'config.to=head_shared needs an untied source, got '
           f'{cfg.scheme}')
  _require(cfg.attention_sharing == 'none' and not cfg.masa and not cfg.lora_rank,
           'config.to=head_shared needs plain q, k, v, o kernels; valid: '
           'model.attention_sharing=none, model.masa.atoms=0, model.sharing.lora_rank=0')
  _require(cfg.kv_heads == cfg.num_heads, f'config.to=head_shared copies whole heads (Q, K, V '
           f'and O slices); valid: num_kv_heads=0, got {cfg.num_kv_heads}')
  _require(cfg.qk_norm == 'none', f'config.to=head_shared: a QK-norm gain is per layer, not per '
           f'head, so a copied head would not compute its match; valid: model.norm.qk_norm=none, '
           f'got {cfg.qk_norm}')
  match, best = head_matches(cfg, variables)
  heads = replaced_heads(cfg, best, share_rate)
  src = layout.applied_params(variables['params'], cfg)
  names = [('attn', p, 'kernel') for p in ('q', 'k', 'v')] + [('attn', 'o', 'kernel')]
  names += [('attn', p, 'bias') for p in ('q', 'k', 'v') if ('attn', p, 'bias') in src]
  new = {p: np.array(src[p]) for p in names}
  for l, h in heads:
    m, j = match[l, h]
    for p in names:
      if p[1] == 'o':                           # (L, H, Dh, D)
        new[p][l, h] = np.asarray(src[p])[m, j]
      elif p[2] == 'kernel':                    # (L, D, H, Dh)
        new[p][l, :, h] = np.asarray(src[p])[m, :, j]
      else:                                     # bias (L, H, Dh)
        new[p][l, h] = np.asarray(src[p])[m, j]
  sets = {p: (jnp.asarray(new[p], src[p].dtype) if p in new else v)
          for p, v in layout.unique_sets(variables['params'], cfg).items()}
  out = dict(variables)
  out['params'] = layout.from_unique_sets(variables['params'], sets, cfg)
  L, H = best.shape
  origin = {(l, h): (l, h) for l in range(L) for h in range(H)}
  origin.update({(l, h): tuple(int(i) for i in match[l, h]) for l, h in heads})
  distinct = len(set(origin.values()))
  D, Dh = cfg.d_model, cfg.head_dim
  per_head = 4 * D * Dh + (3 * Dh if ('attn', 'q', 'bias') in src else 0)
  record = {
      'method': 'DirectShare (arXiv:2402.11819)', 'share_rate': share_rate,
      'replaced': [{'layer': l, 'head': h, 'source_layer': int(match[l, h][0]),
                    'source_head': int(match[l, h][1]), 'similarity': float(best[l, h])}
                   for l, h in heads],
      'heads': L * H, 'distinct_heads': distinct,
      'params_unique': params_unique(variables) - (L * H - distinct) * per_head,
  }
  return cfg, out, record
