"""Imports a Hugging Face model directory as a sharenet workdir.

  python -m sharenet.interop.import_hf --model DIR --out WORKDIR [--mesh fsdp=8,tensor=2]

DIR: config.json, *.safetensors (with or without model.safetensors.index.json) and, when
present, tokenizer.json. WORKDIR is an ordinary train.py workdir (config.json and a checkpoint
with a fresh optimizer state): eval.py --prompt generates with the imported tokenizer
(data.tokenizer=hf:WORKDIR/tokenizer.json), train.py continues it (configs/workdir.py:WORKDIR,
naming the data: data.source=bin and data.path, token ids of that tokenizer; train.restore is
params, so the first run loads the parameters with a fresh optimizer state), convert.py
converts it.
Architectures and the fields refused: sharenet/interop/hf_arch.py; docs/interop.md.

Tensors are read one at a time into the stacked parameters; each parameter, once complete, is
moved to a jax array and written to the workdir's checkpoint before the next one is read
(orbax_io.save_streamed, orbax's experimental partial save). Peak host memory is about three
times the largest stacked parameter (it plus orbax's write and compression buffers), not the
model (benchmarks/hf_streaming.py; docs/interop.md, "Tests and memory"). Every tensor of the checkpoint must
be a parameter of the model and every parameter must be in the checkpoint; names, shapes and
dtypes are checked before anything is written. On any error nothing is left at WORKDIR: the
workdir is written beside it (the checkpoint staged, the step committed by a rename) and
renamed into place at the end.

Under a mesh (`--mesh`, the workdir's config.mesh: data / fsdp / tensor / expert sizes), each
completed parameter goes straight into its sharding (jax.make_array_from_callback over the
devices this process addresses: a pod host places only its shards), and the checkpoint is
written sharded; train.py on that mesh restores it without a gather.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.config import cli, defaults
from sharenet.errors import ConfigError
from sharenet.interop import hf_arch, hf_layout, safetensors_io
from sharenet.models import DecoderLM, ModelConfig
from sharenet.models.lm import init_variables, logical_axes, param_table
from sharenet.train import experiment, sharding, workdir_io

TOKENIZER = 'tokenizer.json'


def read_hf_config(model_dir: str) -> dict[str, Any]:
  """The directory's config.json as a dict (ConfigError if missing or unreadable)."""
  path = os.path.join(model_dir, 'config.json')
  if not os.path.isfile(path):
    raise ConfigError(f'--model {model_dir} has no config.json; valid: a Hugging Face model '
                      f'directory (config.json and *.safetensors)')
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise ConfigError(f'{path} is not valid JSON ({e})') from None


def experiment_config(model_keys: dict[str, Any], tokenizer: str | None) -> dict[str, Any]:
  """The workdir's experiment config: the defaults with the imported model; data is named by
  the user (source bin, no path) and read with the imported tokenizer when there is one."""
  config = defaults.complete({'model': model_keys}).to_dict()
  config['data'].update(source='bin', path='', tokenizer=f'hf:{tokenizer}' if tokenizer else
                        'auto')
  # The data is the user's, so the data stream always changes on the first train.py run:
  # parameters are loaded with a fresh optimizer state (sharenet/train/resume.py) without a flag.
  config['train'].update(steps=0, restore='params')
  window = model_keys.get('attention_window', 0)
  if window:   # a sliding-window model is modelled within its window only (hf_arch.py)
    config['train']['seq_len'] = min(config['train']['seq_len'], window)
  return config


def _check_out(out: str) -> None:
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ConfigError(f'--out {out} exists and is not an empty directory; valid: a new '
                      f'directory (an import never writes over a run)')


def mesh_overrides(spec: str) -> dict[str, int]:
  """'fsdp=8,tensor=2' -> {'fsdp': 8, 'tensor': 2}: sizes of config.mesh's axes."""
  valid = ('data', 'fsdp', 'tensor', 'expert')
  out = {}
  for part in (p for p in spec.replace(' ', '').split(',') if p):
    key, _, value = part.partition('=')
    if key not in valid or not value.lstrip('-').isdigit():
      raise ConfigError(f'--mesh {spec!r}: {part!r} is not AXIS=SIZE; valid axes: '
                        f'{", ".join(valid)} (e.g. --mesh fsdp=8,tensor=2)')
    out[key] = int(value)
  return out


def param_shardings(raw: dict[str, Any], cfg: Any) -> dict[tuple, Any]:
  """{path below 'params': NamedSharding} of DecoderLM(cfg) on raw['mesh'] (train.py's)."""
  run = experiment.sections(raw, cfg)
  sharding.validate(run, jax.device_count())
  mesh, rules = sharding.make_mesh(run.mesh), sharding.rules_of(run.mesh)
  abstract = jax.eval_shape(lambda: init_variables(DecoderLM(cfg), jax.random.key(0)))
  specs = sharding.param_specs(logical_axes(DecoderLM(cfg))['params'], abstract['params'], mesh,
                               rules)
  return {p: jax.sharding.NamedSharding(mesh, s) for p, s in flatten_dict(
      specs, is_leaf=lambda _, x: isinstance(x, jax.sharding.PartitionSpec)).items()}


def _place(value: np.ndarray, sharding: Any) -> jax.Array:
  """`value` as a jax array: on the default device, or only the addressable shards of
  `sharding`."""
  if sharding is None:
    return jax.device_put(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def stored_params(cfg: Any) -> dict[tuple, jax.ShapeDtypeStruct]:
  """{path below 'params': float32 ShapeDtypeStruct} of the leaves `iter_params` yields for
  untied DecoderLM(cfg), in the model's order."""
  abstract = jax.eval_shape(lambda: init_variables(DecoderLM(cfg), jax.random.key(0)))
  return {p: jax.ShapeDtypeStruct(x.shape, np.float32)
          for p, x in flatten_dict(abstract['params']).items()}


def iter_params(model_dir: str, arch: str, cfg: Any, shardings: dict[tuple, Any] | None = None
                ) -> Iterator[tuple[tuple, jax.Array]]:
  """(path below 'params', jax array) of every stored parameter of untied DecoderLM(cfg), one
  at a time, each read tensor by tensor from the checkpoint: block parameters are stacked over
  the applied layers and placed by models/layout.py; with `shardings` ({path: NamedSharding})
  each is placed straight into its sharding. A parameter is yielded once complete and not
  held after the consumer asks for the next one.

  The checkpoint's tensor names, shapes and dtypes are checked against the model first (one
  ConfigError line: a tensor missing, of the wrong shape or dtype, or not modelled) when this
  is called, before the iterator reads a tensor."""
  files = safetensors_io.open_model(model_dir)
  table = {p[1:]: i for p, i in param_table(cfg).items() if p[0] == 'params'}
  shapes = {(i.local if i.in_block else p): ((cfg.num_layers,) + i.shape[i.num_layer_axes:]
                                             if i.in_block else i.shape)
            for p, i in table.items()}
  entries = hf_arch.entries(arch, cfg, hf_arch.prefix(arch, set(files)))
  assert {e.path for e in entries} == set(shapes), 'interop entries do not match the model'
  stored = {p: i for p, i in table.items() if i.in_block}
  # each entry's stored leaves: (path, the applied layers' values it holds, or None: all)
  targets = {e.path: ([(p, np.asarray(i.sets)) for p, i in stored.items() if i.local == e.path]
                      if e.layer else [(e.path, None)]) for e in entries}
  assert sorted(p for t in targets.values() for p, _ in t) == sorted(stored_params(cfg)), \
      'interop entries do not cover the model'
  used: set[str] = set()
  for e in entries:   # the whole checkpoint checked before anything is read or written
    for i in range(cfg.num_layers) if e.layer else [None]:
      name = e.hf.format(i=i)
      if name not in files:
        raise ConfigError(f'--model {model_dir}: tensor {name} is missing (config.json '
                          f'describes a {arch} model that has it)')
      want = hf_layout.hf_shape(e, shapes[e.path][1:] if e.layer else shapes[e.path])
      if files[name].shape(name) != want:
        raise ConfigError(f'--model {model_dir}: tensor {name} has shape '
                          f'{files[name].shape(name)}, config.json implies {want}')
      files[name].check_dtype(name)
      used.add(name)
  extra = sorted(n for n in set(files) - used if not hf_arch.ignored(arch, n))
  if extra:
    raise ConfigError(f'--model {model_dir}: tensor {extra[0]} is not modelled by sharenet '
                      f'({len(extra)} such; config.json does not describe them)')
  return _read_params(model_dir, files, entries, shapes, targets, cfg.num_layers,
                      shardings or {})


def _read_params(model_dir: str, files: dict[str, Any], entries: list[Any],
                 shapes: dict[tuple, tuple], targets: dict[tuple, list], num_layers: int,
                 shardings: dict[tuple, Any]) -> Iterator[tuple[tuple, jax.Array]]:
  """iter_params' reading, once the checkpoint is checked."""
  cache: list[Any] = [None, None]   # GPT-2's fused c_attn is read once for q, k and v
  for k, e in enumerate(entries):
    value = np.empty(shapes[e.path], np.float32)
    for i in range(num_layers) if e.layer else [None]:
      name = e.hf.format(i=i)
      if cache[0] != name:
        cache[:] = None, None   # the previous tensor freed before the next is read
        cache[:] = name, files[name].read(name)
      one = value[i] if e.layer else value
      if cache[1].shape != hf_layout.hf_shape(e, one.shape):   # checked above; a changed file
        raise ConfigError(f'--model {model_dir}: tensor {name} has shape {cache[1].shape}, '
                          f'config.json implies {hf_layout.hf_shape(e, one.shape)}')
      one[...] = hf_layout.to_sharenet(e, cache[1], one.shape)
      del one
    nxt = entries[k + 1].hf.format(i=0) if k + 1 < len(entries) else None
    if cache[0] != nxt:
      cache[:] = None, None
    # complete: each stored leaf (an untied plan's: its applied layers' values, in order)
    # made the jax array the checkpoint saves; the numpy buffer is freed before it is yielded
    todo = targets[e.path]
    for j, (path, sets) in enumerate(todo):
      whole = sets is None or np.array_equal(sets, np.arange(len(value)))
      leaf = _place(value if whole else value[sets], shardings.get(path))
      if j + 1 == len(todo):
        del value
      yield path, leaf
      del leaf


def _under(key: str, leaves: Iterator[tuple[tuple, Any]]) -> Iterator[tuple[tuple, Any]]:
  for path, value in leaves:
    yield (key,) + path, value
    del value   # not held while the next one is read


def read_params(model_dir: str, arch: str, cfg: Any,
                shardings: dict[tuple, Any] | None = None) -> dict[str, Any]:
  """The 'params' tree of untied DecoderLM(cfg): every parameter of `iter_params` held at
  once (the import streams them instead; this is for tests and benchmarks)."""
  return unflatten_dict(dict(iter_params(model_dir, arch, cfg, shardings)))


def import_hf(model_dir: str, out: str, mesh: str = '') -> dict[str, Any]:
  """Writes `out`, the sharenet workdir of Hugging Face directory `model_dir`; `mesh`
  ('fsdp=8,tensor=2') sets its config.mesh and places each parameter in its sharding."""
  _check_out(out)
  if not os.path.isdir(model_dir):
    raise ConfigError(f'--model {model_dir} is not a directory')
  arch, keys = hf_arch.model_keys(read_hf_config(model_dir))
  out = os.path.abspath(out)
  has_tok = os.path.isfile(os.path.join(model_dir, TOKENIZER))
  raw = experiment_config(keys, os.path.join(out, TOKENIZER) if has_tok else None)
  import ml_collections
  raw['mesh'].update(mesh_overrides(mesh))
  cfg = ModelConfig.from_experiment(ml_collections.ConfigDict(raw))
  shardings = param_shardings(raw, cfg) if mesh else None
  specs = stored_params(cfg)
  leaves = iter_params(model_dir, arch, cfg, shardings)   # bad input: raises here
  tmp = f'{out}.import-{os.getpid()}.tmp'
  try:
    # No optimizer state (train.restore=params makes a fresh one): the checkpoint is the
    # parameters' size, not three times it; they are written one at a time as they are read.
    workdir_io.save_workdir_streamed(
        tmp, raw, cfg, {'params': unflatten_dict(specs)}, _under('params', leaves), 0,
        {'imported_from': os.path.abspath(model_dir), 'hf_model_type': arch})
    if has_tok:
      shutil.copyfile(os.path.join(model_dir, TOKENIZER), os.path.join(tmp, TOKENIZER))
    if os.path.isdir(out):
      os.rmdir(out)   # empty (checked above)
    os.rename(tmp, out)
  finally:
    if os.path.isdir(tmp):
      shutil.rmtree(tmp)
  return {'model_type': arch, 'workdir': out, 'num_layers': cfg.num_layers,
          'params': int(sum(np.prod(a.shape) for a in specs.values()))}


def main(argv: list[str]) -> None:
  del argv
  from absl import flags, logging
  logging.set_verbosity(logging.WARNING)
  result = import_hf(flags.FLAGS.model, flags.FLAGS.out, flags.FLAGS.mesh)
  print(json.dumps(result), flush=True)


if __name__ == '__main__':
  from absl import flags
  flags.DEFINE_string('model', None, 'Hugging Face model directory.', required=True)
  flags.DEFINE_string('out', None, 'New sharenet workdir.', required=True)
  flags.DEFINE_string('mesh', '', 'AXIS=SIZE,... of config.mesh (data, fsdp, tensor, expert): '
                      'each parameter is placed in its sharding, the checkpoint written sharded.')
  cli.run(main)
