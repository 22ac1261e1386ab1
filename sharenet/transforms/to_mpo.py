"""A trained model's kernels as MPOs whose central tensor every layer shares (MPOBERT's
initialization, models/mpo.py): `python convert.py --config.to=mpo --config.mpo_cores=N
[--config.mpo_bond=D] [--config.mpo_targets=...]` (sharenet/main/convert_workdir.py).

Each stored set's target kernel W_u is decomposed by sequential SVDs (left-canonical, exact at
full bonds). The shared central tensor is stored set 0's (MPOBERT's reference code shares layer
0's central tensor, albert.py `replace`); every set keeps its own auxiliary tensors, and the
tensors on one side of the centre are refitted to the shared centre by least squares (the side
right of it, or left of it when the centre is the last tensor): with the other side an isometry
L_u, the best remainder is R_u = argmin || L_u^T X_u - C R_u || = pinv(C) L_u^T X_u, then split
into its tensors again. So a model of one stored set per kernel type (a universal plan, or
ALBERT's), and stored set 0 of any model, convert exactly at full bonds; the other sets of an
untied model convert approximately (MPOBERT shares the centre to tie the layers), and each
set's relative error ||W'_u - W_u|| / ||W_u|| is reported in the summary.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.config import compat
from sharenet.models import DecoderLM, ModelConfig, init_variables, layout, mpo
from sharenet.models.masa import atom_specs


def refit(own: list[np.ndarray], central: np.ndarray, w: np.ndarray, s: mpo.MpoShape
          ) -> list[np.ndarray]:
  """Set u's chain `own` with the shared `central` in place of its own centre and the tensors
  on one side refitted by least squares (module docstring)."""
  c, n = s.central, len(s.ins)
  x = mpo.interleaved(w, s)
  sizes = [i * j for i, j in zip(s.ins, s.outs)]
  if c < n - 1:   # keep T_1 .. T_{c-1} (an isometry), refit T_{c+1} .. T_n
    left = own[0].reshape(sizes[0], -1)
    for t in own[1:c]:
      left = (left @ t.reshape(t.shape[0], -1)).reshape(-1, t.shape[-1])
    y = (left.T @ x.reshape(left.shape[0], -1)).reshape(s.bonds[c] * sizes[c], -1)
    r = np.linalg.lstsq(central.reshape(-1, s.bonds[c + 1]), y, rcond=None)[0]
    right = mpo.chain(r, s.ins[c + 1:], s.outs[c + 1:], s.bonds[c + 1:])
    return own[:c] + [central] + right
  # the centre is the last tensor: keep it shared, refit the left part as one matrix
  cmat = central.reshape(s.bonds[c], -1)
  left = np.linalg.lstsq(cmat.T, x.reshape(-1, cmat.shape[1]).T, rcond=None)[0].T
  return mpo.chain(left, s.ins[:c], s.outs[:c], s.bonds[:c + 1]) + [central]


def stored_targets(cfg: ModelConfig) -> tuple[str, ...]:
  """The kernel targets a model stores as plain kernels: its stored projections, less what
  experts replace (SwitchHead's v and o, model.moe's dense MLP) and what a tied transpose
  reads (CEM: q, the tied MLP's mlp_in)."""
  tied = ('q',) * (cfg.attention_sharing == 'cem') + ('mlp_in',) * cfg.mlp_tied
  out = [t for t in cfg.projections if t not in tied]
  if cfg.moe.attention == 'switchhead':
    out = [t for t in out if t not in ('v', 'o')]
  if cfg.moe.kind != 'none':
    out = [t for t in out if not t.startswith('mlp')]
  return tuple(out)


def to_mpo(cfg: ModelConfig, variables: Any, cores: int, bond: int = 0,
           targets: tuple[str, ...] = ()) -> tuple[ModelConfig, Any, dict[str, Any]]:
  """(the MPO model's config, its variables, {kernel name: [relative error per stored set]})
  of a plain-kernel model (`cfg`, `variables` with reparametrizations resolved); `targets`
  () -> every kernel it stores (`stored_targets`)."""
  compat.check_action('convert_mpo', cfg.table_config(), 'config.to=mpo')
  new_cfg = cfg.derive(mpo=dict(cores=cores, bond=bond,
                                targets=tuple(targets) or stored_targets(cfg)))
  template = init_variables(DecoderLM(new_cfg), jax.random.key(0))
  sets = layout.unique_sets(variables['params'], cfg)
  new_sets, central, errors = {}, {}, {}
  for name, (shape, _, _, num_in, branch, _) in atom_specs(new_cfg, new_cfg.mpo_kernels).items():
    w_U = np.asarray(sets[(branch, name, 'kernel')], np.float64)
    U = w_U.shape[0]
    fan_in = int(np.prod(shape[:num_in]))
    w_U = w_U.reshape(U, fan_in, -1)
    s = mpo.mpo_shape(fan_in, w_U.shape[2], cores, bond)
    own = [mpo.decompose(w, s) for w in w_U]
    centre = own[0][s.central]
    chains = [own[0]] + [refit(own[u], centre, w_U[u], s) for u in range(1, U)]
    central[name] = centre
    for k in range(len(s.ins)):
      if k != s.central:
        new_sets[(branch, name, f'mpo_{k}')] = np.stack([ch[k] for ch in chains])
    errors[name] = [float(np.linalg.norm(mpo.contract(ch, s) - w) / np.linalg.norm(w))
                    for ch, w in zip(chains, w_U)]
  src = flatten_dict(variables['params'])
  params = dict(flatten_dict(template['params']))
  for path in params:   # everything outside the converted kernels: the source's values
    if path in src:
      params[path] = src[path]
    elif path[0] == 'mpo':
      params[path] = jnp.asarray(central[path[1]], params[path].dtype)
  params = layout.from_unique_sets(unflatten_dict(params), new_sets, new_cfg)
  return new_cfg, {**variables, 'params': params}, {'relative_error': errors}
