"""CRMSNorm from scratch: how large is the implied coordinate, and does the init explain the gap?

  python -m sharenet.studies.crms_init --config configs/norm_study.py --out runs/crms_init \
      [--config.study.schemes=untied]   # trains crmsnorm twice: iid and isotropic writer init

CRMSNorm (Jiang et al., arXiv:2305.14858) keeps n = d_model coordinates z of a zero-mean
(n+1)-vector whose last entry is -sum z. Every leaf that writes the residual stream (embedding,
learned positions, the writer kernels o / wo) is viewed as M (rows, n); the implied coordinate
receives M 1 and a stored coordinate one column of M, so

  ratio(M) = ||M 1|| / rms_j ||M[:, j]||

is the implied coordinate's scale relative to a stored one: ~sqrt(n) for iid entries (16 at
d_model 256), ~1 when M's rows are the first n entries of isotropic zero-mean (n+1)-vectors. The
isotropic init is M - c (M 1) 1^T with c = (1 - 1/sqrt(n+1)) / n, which maps iid rows to exactly
that distribution (covariance I - 11^T/(n+1)).

Per init the study trains the norm study's crmsnorm cell (configs/norm_study.py: 200 steps) with
checkpoints every 50 steps and writes OUT/crms_init.json: eval bits per byte and the ratios of
every writer at init and at each checkpoint (one value per stacked set).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models import param_table
from sharenet.studies import common
from sharenet.studies.norm_study import SCHEMES
from sharenet.train import experiment, loop, trainer, workdir_io

INITS = ('iid', 'isotropic')
WRITER_ROLES = ('writer', 'embedding', 'pos_embed')


def writers(infos: dict) -> dict:
  """Leaves that write the residual stream: 'embed' is their last (output) axis."""
  return {p: i for p, i in infos.items() if i.role in WRITER_ROLES and i.axes[-1] == 'embed'}


def isotropic(variables: Any, infos: dict) -> Any:
  """Each writer's rows -> the first n entries of an isotropic zero-mean (n+1)-vector."""
  flat = dict(flatten_dict(variables))
  for p in writers(infos):
    w = flat[p]
    n = w.shape[-1]
    flat[p] = w - (1 - 1 / math.sqrt(n + 1)) / n * jnp.sum(w, -1, keepdims=True)
  return unflatten_dict(flat)


def ratios(variables: Any, infos: dict) -> dict[str, list[float]]:
  """{writer path: ratio per stacked set} (module docstring)."""
  flat = flatten_dict(variables)
  out = {}
  for p, i in writers(infos).items():
    w = np.asarray(flat[p], np.float64)
    m = w.reshape(w.shape[:i.num_stack] + (-1, w.shape[-1]))
    implied = np.sqrt(np.sum(np.sum(m, -1) ** 2, -1))
    stored = np.sqrt(np.mean(np.sum(m ** 2, -2), -1))
    out['/'.join(p[1:])] = np.atleast_1d(implied / stored).round(2).tolist()
  return out


@contextlib.contextmanager
def writer_init(kind: str):
  """Within the block, the train loop's fresh init (trainer.init_variables) uses `kind`."""
  plain = trainer.init_variables

  def init_variables(model, rng, *args, **kwargs):
    v = plain(model, rng, *args, **kwargs)
    return isotropic(v, param_table(model.cfg)) if kind == 'isotropic' else v

  trainer.init_variables = init_variables
  try:
    yield init_variables
  finally:
    trainer.init_variables = plain


def run_one(config: Any, kind: str, workdir: str) -> dict[str, Any]:
  import jax

  with writer_init(kind) as init:
    exp = trainer.setup(config, experiment.validate(config))
    infos = param_table(exp.model.cfg)
    row = {'init': kind, 'ratios': {0: ratios(init(exp.model, jax.random.key(config.train.seed)),
                                              infos)}}
    res = common.completed(loop.train_and_evaluate(config, workdir), workdir)
  row['eval_bits_per_byte'] = res['eval_bits_per_byte']
  every = config.train.checkpoint_every
  for step in range(every, config.train.steps + 1, every):
    state = workdir_io.restore_state(config, workdir, step).state
    row['ratios'][step] = ratios(state.params, infos)
  return row


def main(config: Any, out: str) -> int:
  schemes = common.parse_list(config.study.schemes, str)
  rows = []
  for scheme in schemes:
    c = common.with_overrides(config, {**SCHEMES[scheme], 'model.norm.kind': 'crmsnorm',
                                       'train.progress': False, 'train.checkpoint_every': 50,
                                       'train.keep_checkpoints': 10})
    for kind in INITS:
      row = {'scheme': scheme, **run_one(c, kind, os.path.join(out, scheme, kind))}
      print(json.dumps(row), flush=True)
      rows.append(row)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'crms_init.json'), 'w') as f:
    json.dump(rows, f, indent=1)
  return 0


if __name__ == '__main__':
  common.run_cli(main, 'runs/crms_init', 'configs/norm_study.py')
