"""Writing a train.py workdir: a checkpoint with a fresh optimizer state (or none) and its
config.json, from variables in memory (convert.py) or streamed leaf by leaf (interop/import_hf)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax.traverse_util import flatten_dict

from sharenet import checkpoint, config_json, data, optim, resume, train_lib
from sharenet.models import DecoderLM, ModelConfig
from sharenet.transforms import Transforms


def save_workdir(out: str, raw: dict[str, Any], cfg: ModelConfig, variables: Any, step: int,
                 extra: dict[str, Any], optimizer_state: bool = True) -> None:
  """Writes `out` as a train.py workdir of config `raw` (a dict; its model section `cfg`'s)
  holding `variables` at `step`: a checkpoint with a fresh optimizer state and data iterator
  (train.py continues it), and config.json with `extra` added (convert.py, interop/import_hf).

  `optimizer_state=False` saves none (the checkpoint is then the parameters' size, not three
  times it): `raw` must have train.restore=params, so train.py makes a fresh one on resuming.
  """
  new_config = ml_collections.ConfigDict(raw)
  if not optimizer_state and new_config.train.restore != 'params':
    raise ValueError('a checkpoint without optimizer state needs train.restore=params')
  os.makedirs(out, exist_ok=True)
  new_tr = Transforms(new_config.transforms, DecoderLM(cfg))
  tx = optim.make_optimizer(new_config.train, new_tr)
  params, tstate = new_tr.init(variables)
  # A fresh optimizer state whose LR schedule continues at the source's step.
  opt_state = optim.at_step(tx.init(params), step) if optimizer_state else None
  new_state = train_lib.TrainState(jnp.asarray(step, jnp.int32), params, opt_state, tstate)
  t = new_config.train
  it = None
  if new_config.data.source != 'bin' or new_config.data.path:
    it = data.make_train_iterator(new_config.data, t.seq_len, t.batch_size, t.seed, 0, 1)
  mngr = checkpoint.manager(out, t.keep_checkpoints, async_save=False)
  saved_config, summary = _workdir_configs(new_config, raw, extra, params)
  checkpoint.save(mngr, step, new_state, it, saved_config)
  mngr.wait_until_finished()
  mngr.close()
  config_json.write(out, summary)


def _workdir_configs(new_config: ml_collections.ConfigDict, raw: dict[str, Any],
                     extra: dict[str, Any], params: Any) -> tuple[dict[str, Any], dict[str, Any]]:
  """(the checkpoint's config item, config.json's contents) of a workdir of config
  `new_config` (`raw` as a dict) holding `params` (arrays or ShapeDtypeStructs)."""
  shapes = train_lib.param_shapes(params)
  return ({**resume.config_dict(new_config), 'param_shapes': shapes},
          {**raw, **extra, 'param_shapes': shapes})


def save_workdir_streamed(out: str, raw: dict[str, Any], cfg: ModelConfig, abstract: Any,
                          leaves: Iterable[tuple[tuple[str, ...], Any]], step: int,
                          extra: dict[str, Any]) -> None:
  """save_workdir(out, raw, cfg, variables, step, extra, optimizer_state=False), the
  variables given leaf by leaf: `abstract` is their tree of ShapeDtypeStructs and `leaves`
  yields (path in it, jax.Array or np.ndarray), every leaf once, in any order. The
  checkpoint is written by checkpoint.save_streamed, so the host holds one leaf (and orbax's
  buffers for it) at a time; the saved state and both configs are save_workdir's.

  Needs train.restore=params (no optimizer state), no data named (no iterator position to
  save) and transforms whose init leaves the variables as they are (no reparam, no nGPT
  projection); ValueError otherwise, and for a leaf that is not in `abstract` (path, shape
  or dtype), repeated or missing, which leaves no checkpoint step behind.
  """
  new_config = ml_collections.ConfigDict(raw)
  if new_config.train.restore != 'params':
    raise ValueError('a checkpoint without optimizer state needs train.restore=params')
  if new_config.data.source != 'bin' or new_config.data.path:
    raise ValueError('a streamed workdir saves no data iterator; this config names data')
  new_tr = Transforms(new_config.transforms, DecoderLM(cfg))
  if not new_tr.init_is_identity:
    raise ValueError('a streamed workdir needs transforms whose init keeps the variables '
                     '(no transforms.reparam, no transforms.project=ngpt)')
  params, tstate = jax.eval_shape(new_tr.init, abstract)   # tstate: {} (no leaves)
  skeleton = train_lib.TrainState(jnp.asarray(step, jnp.int32), None, None, tstate)
  skeleton = {f.name: getattr(skeleton, f.name) for f in dataclasses.fields(skeleton)
              if f.name != 'params'}
  want = {p: (tuple(x.shape), np.dtype(x.dtype)) for p, x in flatten_dict(params).items()}

  def checked() -> Iterator[tuple[tuple[str, ...], Any]]:
    for path, value in leaves:
      path = tuple(path)
      got = (tuple(value.shape), np.dtype(value.dtype))
      if want.pop(path, None) != got:
        raise ValueError(f'leaf {"/".join(path)} {got[0]} {got[1]} is not one of the '
                         f'variables\' leaves (or is repeated)')
      yield ('params',) + path, value
      del value   # the caller has saved it: not held while the next leaf is produced
    if want:
      raise ValueError(f'{len(want)} leaves were not given, e.g. {"/".join(next(iter(want)))}')

  saved_config, summary = _workdir_configs(new_config, raw, extra, params)
  os.makedirs(out, exist_ok=True)
  checkpoint.save_streamed(out, step, checked(), skeleton, saved_config)
  config_json.write(out, summary)
