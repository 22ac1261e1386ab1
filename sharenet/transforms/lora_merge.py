"""Mixture of LoRAs -> one depth-wise LoRA for inference (models/lora_experts.py; docs/experts.md).

"Improving Recursive Transformers with Mixture of LoRAs" (arXiv:2512.12880) merges its routed
LoRA experts into one adapter for inference. Here each applied layer l gets its own adapter
(depth-wise LoRA of Relaxed Recursive Transformers, arXiv:2410.20672, in the per-layer
collection) from expert weights w_{l,e}:

  A_l B_l = trunc_r( sum_e w_{l,e} A_e B_e )     (rank r = model.sharing.lora_rank, truncated SVD)

so the merged layer computes x W + lora_scale x A_l B_l. A token routed to expert e computes
x W + lora_scale x A_e B_e (its gate is 1 in the forward pass), so with w_l = one_hot(e) the
merge is exact (rank <= r) for every token that picks e: the merged model equals the routed one
when every token picks the same expert. Other weights (e.g. each expert's share of the tokens
routed at layer l) give the expected adapter, exact only to the SVD truncation and the routing's
spread. The experts' tied parameters are shared by every use of their set; the merged adapters
are per applied layer.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.kernels import linalg
from sharenet.config import compat
from sharenet.errors import require
from sharenet.models import DecoderLM, ModelConfig, init_variables, layout, param_table
from sharenet.models.params import PER_LAYER

Path = tuple[str, ...]


def _expert_factors(cfg: ModelConfig) -> dict[Path, dict[str, Any]]:
  """{block-local module path of a Dense with experts: {'a' | 'b': its factor's info}}."""
  out: dict[Path, dict[str, Any]] = {}
  for path, i in param_table(cfg).items():
    if path[0] == 'params' and i.role == 'lora' and 'experts' in i.axes and i.in_block:
      out.setdefault(i.local[:-1], {})['a' if i.axes[-1] == 'lora' else 'b'] = i
  return out


def merge_lora_experts(cfg: ModelConfig, variables: Any, weights: Any
                       ) -> tuple[ModelConfig, Any]:
  """(the config with lora_experts=0, its variables): the experts merged per applied layer with
  `weights` (N,) for every layer or (num_layers, N) per applied layer (module docstring)."""
  N, L = cfg.moe.lora_experts, cfg.num_layers
  require(N > 0, 'merge_lora_experts needs a model with model.moe.lora_experts >= 1')
  compat.check_action('convert_merge_lora_experts', cfg.table_config(),
                      'config.to=merge_lora_experts')
  w_LN = np.array(np.broadcast_to(np.asarray(weights, np.float32), (L, N)))
  new_cfg = cfg.derive(moe={'lora_experts': 0})
  target = jax.eval_shape(lambda: init_variables(DecoderLM(new_cfg), jax.random.key(0)))
  missing = []

  def per_layer(variables, w_LN):   # one program (op by op, each gather compiles alone);
    layers = _merged_layers(cfg, variables, w_LN)   # weights an argument: one per model
    merged = flatten_dict(layout.from_applied_per_layer(target[PER_LAYER], layers, new_cfg))
    for p, v in merged.items():
      if isinstance(v, jax.ShapeDtypeStruct):
        missing.append(p)
        merged[p] = jnp.zeros(v.shape, v.dtype)
    return unflatten_dict(merged)
  merged = jax.jit(per_layer)(variables, w_LN)
  require(not missing, f'merge_lora_experts: no value for per-layer {missing[:3]}')
  table = param_table(cfg)
  dropped = {p for p, i in table.items() if p[0] == 'params' and 'experts' in i.axes and
             i.branch == 'mlp' and i.role in ('lora', 'router')}
  out = {c: v for c, v in variables.items() if c not in ('params', PER_LAYER)}
  out['params'] = unflatten_dict({p: v for p, v in flatten_dict(variables['params']).items()
                                  if ('params',) + p not in dropped})
  out[PER_LAYER] = merged
  return new_cfg, out


def _merged_layers(cfg: ModelConfig, variables: Any, w_LN: jax.Array) -> dict[Path, Any]:
  """The source's per-layer parts (applied order) plus each expert Dense's merged A_l, B_l."""
  N, L, r = cfg.moe.lora_experts, cfg.num_layers, cfg.sharing.lora_rank
  params = layout.applied_params(variables['params'], cfg)            # {local: (L, ...)}
  layers = layout.applied_per_layer(variables.get(PER_LAYER, {}), cfg)
  for module, ab in _expert_factors(cfg).items():
    a_LN, b_LN = params[ab['a'].local], params[ab['b'].local]
    in_shape, out_shape = a_LN.shape[2:-1], b_LN.shape[3:]
    a = a_LN.reshape(L, N, -1, r).astype(jnp.promote_types(a_LN.dtype, jnp.float32))
    b = b_LN.reshape(L, N, r, -1).astype(a.dtype)
    delta_LIO = jnp.einsum('ln,lnir,lnro->lio', w_LN.astype(a.dtype), a, b)
    u, s, vt = linalg.per_matrix(functools.partial(jnp.linalg.svd, full_matrices=False),
                                 delta_LIO)
    k = min(r, s.shape[-1])
    lora_a = jnp.zeros(delta_LIO.shape[:2] + (r,), a.dtype).at[..., :k].set(u[..., :k])
    lora_b = jnp.zeros((L, r, delta_LIO.shape[2]), a.dtype).at[:, :k].set(
        s[:, :k, None] * vt[:, :k])
    layers[module + ('lora_a',)] = lora_a.reshape((L,) + in_shape + (r,))
    layers[module + ('lora_b',)] = lora_b.reshape((L, r) + out_shape)
  return layers
