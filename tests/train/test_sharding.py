"""Sharding: 1 device vs 8 simulated devices in several meshes, two processes, resharding restore.

The multi-device runs need a fresh process (JAX fixes the device count at start-up): one
8-device subprocess runs the layouts of both schemes, the resharding restores and the dry runs
(this file's `__main__`), and writes its results as JSON for the tests below. Every layout runs
under at least one scheme and every scheme under at least two layouts (one with each of data,
fsdp and tensor > 1); the full cross product would add compile time, not coverage.
"""
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from sharenet.train import experiment
from sharenet.errors import ConfigError

RTOL = 1e-5
STEPS = 5
LAYOUTS = {'data=8': (8, 1, 1), 'fsdp=8': (1, 8, 1), 'data=2,fsdp=4': (2, 4, 1),
           'data=2,fsdp=2,tensor=2': (2, 2, 2)}
# The layouts each scheme trains under (test_two_processes_match_single_process compares with
# the untied fsdp=8 and data=2,fsdp=4 runs).
SCHEME_LAYOUTS = {'untied': ('fsdp=8', 'data=2,fsdp=4', 'data=2,fsdp=2,tensor=2'),
                  'cycle': ('data=8', 'data=2,fsdp=2,tensor=2')}
# A checkpoint written under the first layout restores under the second and training continues.
RESHARD = {'untied': ('fsdp=8', 'data=2,fsdp=4'), 'cycle': ('data=2,fsdp=2,tensor=2', 'data=8')}
# Parameter transforms add trainable gains, non-trainable state and optimizer state of their own.
TRANSFORMS = {'transforms.reparam': 'weight_norm,sigma_reparam', 'transforms.project': 'nap',
              'model.norm.pre_activation': 'layernorm', 'transforms.updates': 'agc'}
# Statistics norms: running statistics per applied layer, batch statistics over the global
# batch (Unified Norm's window of 2 is full, and its geometric mean used, from step 3)
STATS_NORMS = {'powernorm': {'model.norm.kind': 'powernorm', 'model.norm.stats_warmup': 2},
               'unified_norm': {'model.norm.kind': 'unified_norm', 'model.norm.stats_warmup': 2,
                                'model.norm.stats_window': 2},
               'online_norm': {'model.norm.kind': 'online_norm',   # the reference's momenta
                               'model.norm.stats_momentum': 0.999,
                               'model.norm.stats_grad_momentum': 0.99}}
# The cycle scheme runs with PowerNorm: its running statistics train under both of the
# scheme's layouts and are resharded by the restore; the other statistics norms run alone.
SCHEMES = {'untied': {}, 'cycle': {'model.sharing.num_unique': 2, **STATS_NORMS['powernorm']}}
ALONE = [k for k in STATS_NORMS if k != 'powernorm']


def norm_statistics(workdir: str) -> dict:
  """{path: values} of the running statistics in `workdir`'s last checkpoint."""
  import jax
  from sharenet.train import workdir_io
  from sharenet.models.norm_stats import NORM_STATS
  state = workdir_io.restore_state(workdir_io.load_config(workdir), workdir)[0]
  return {jax.tree_util.keystr(p): jax.numpy.ravel(v).tolist() for p, v in
          jax.tree_util.tree_flatten_with_path(state.tstate[NORM_STATS])[0]}


def write_corpus(directory: str) -> str:
  """~200 KB of stdlib source as one text file: its 1 % validation tail is one eval batch."""
  parts, size = [], 0
  for name in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), '*.py'))):
    parts.append(open(name, 'rb').read())
    size += len(parts[-1])
    if size > 200_000:
      break
  path = os.path.join(directory, 'corpus.txt')
  with open(path, 'wb') as f:
    f.write(b''.join(parts)[:200_000])
  return path


def config(tiny_config, scheme: str, corpus: str, mesh=(-1, 1, 1), **overrides):
  """4 applied layers, 8 rows, a constant LR (so a shorter run has the same schedule)."""
  c = tiny_config(**{'model.num_layers': 4, 'model.sharing.scheme': scheme,
                     'data.source': 'text', 'data.path': corpus,
                     'train.steps': STEPS, 'train.batch_size': 8, 'train.schedule': 'constant',
                     'train.warmup_steps': 0, 'train.checkpoint_every': 3,
                     **SCHEMES[scheme], **overrides})
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def mesh_flags(mesh):
  return [f'--config.mesh.{a}={n}' for a, n in zip(('data', 'fsdp', 'tensor'), mesh)]


def assert_close(got, want):
  assert sorted(got) == sorted(want)
  for step in want:
    assert abs(got[step] - want[step]) <= RTOL * abs(want[step]), (step, got[step], want[step])


def _worker(tiny_config, losses, out_path: str, tmp: str, corpus: str) -> None:
  """Runs in the 8-device subprocess (conftest's plain helpers stand in for the fixtures)."""
  import contextlib
  import functools
  import io

  import jax

  from sharenet.train import loop
  assert jax.device_count() == 8, jax.devices()
  from sharenet.train import sharding
  out = {'losses': {}, 'resumed': {}, 'dry_run': {}}
  cfg = functools.partial(config, tiny_config)
  c = cfg('untied', corpus, (1, 8, 1))
  mesh, rules = sharding.make_mesh(c.mesh), sharding.rules_of(c.mesh)
  out['contiguous'] = [sharding.rows_per_process_contiguous(mesh, rules, f) for f in
                       (lambda d: d.id // 4, lambda d: d.id % 2)]
  for scheme in SCHEMES:
    for name in SCHEME_LAYOUTS[scheme]:
      workdir = os.path.join(tmp, f'{scheme}-{name}')
      loop.train_and_evaluate(cfg(scheme, corpus, LAYOUTS[name]), workdir)
      out['losses'][f'{scheme} {name}'] = losses(workdir)
    written, restored = RESHARD[scheme]
    src, dst = os.path.join(tmp, f'{scheme}-{written}'), os.path.join(tmp, f'{scheme}-reshard')
    shutil.copytree(os.path.join(src, 'checkpoints'), os.path.join(dst, 'checkpoints'))
    shutil.copy(os.path.join(src, 'config.json'), dst)
    shutil.rmtree(os.path.join(dst, 'checkpoints', str(STEPS)))
    loop.train_and_evaluate(cfg(scheme, corpus, LAYOUTS[restored]), dst)
    out['resumed'][scheme] = losses(dst)
  # the flat lowering (gathered sets, one scan) here, the nested one on the single device
  workdir = os.path.join(tmp, 'cycle-transforms')
  loop.train_and_evaluate(cfg('cycle', corpus, LAYOUTS['data=2,fsdp=2,tensor=2'],
                                   **TRANSFORMS, **{'model.scan_lowering': 'flat'}), workdir)
  out['losses']['cycle transforms'] = losses(workdir)
  dft = 'data=2,fsdp=2,tensor=2'
  out['losses']['cycle powernorm'] = out['losses'][f'cycle {dft}']
  out['norm_statistics'] = {'powernorm': norm_statistics(os.path.join(tmp, f'cycle-{dft}'))}
  for kind in ALONE:
    workdir = os.path.join(tmp, f'cycle-{kind}')
    loop.train_and_evaluate(cfg('cycle', corpus, LAYOUTS[dft], **STATS_NORMS[kind]),
                                 workdir)
    out['losses'][f'cycle {kind}'] = losses(workdir)
    out['norm_statistics'][kind] = norm_statistics(workdir)
  for name, mesh in (('fsdp=1', (8, 1, 1)), ('fsdp=8', (1, 8, 1)), ('tensor=8', (1, 1, 8))):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      totals = loop.train_and_evaluate(cfg('untied', corpus, mesh, dry_run=True),
                                            os.path.join(tmp, f'dry-{name}'))
    out['dry_run'][name] = {'totals': totals, 'stdout': buf.getvalue(),
                            'wrote_workdir': os.path.exists(os.path.join(tmp, f'dry-{name}'))}
  with open(out_path, 'w') as f:
    json.dump(out, f)


def device_env(base: dict, n: int) -> dict:
  e = dict(base)
  e['JAX_PLATFORMS'] = 'cpu'
  e['XLA_FLAGS'] = (e.get('XLA_FLAGS', '') + f' --xla_force_host_platform_device_count={n}')
  return e


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return write_corpus(str(tmp_path_factory.mktemp('corpus')))


@pytest.fixture(scope='module')
def eight(tmp_path_factory, corpus, repo_root, subprocess_env):
  """Results of the 8-device subprocess."""
  tmp = tmp_path_factory.mktemp('eight')
  out = tmp / 'out.json'
  res = subprocess.run([sys.executable, __file__, str(out), str(tmp), corpus],
                       env=device_env(subprocess_env, 8), capture_output=True, text=True,
                       timeout=900, cwd=repo_root)
  assert res.returncode == 0, res.stderr[-4000:]
  data = json.loads(out.read_text())
  as_int = lambda d: {int(k): v for k, v in d.items()}
  data['losses'] = {k: as_int(v) for k, v in data['losses'].items()}
  data['resumed'] = {k: as_int(v) for k, v in data['resumed'].items()}
  return data


@pytest.fixture(scope='module')
def single(tmp_path_factory, corpus, tiny_config, losses):
  """5-step losses of each scheme on this (single-device) process."""
  from sharenet.train import loop
  out = {}
  workdirs = {scheme: str(tmp_path_factory.mktemp(scheme)) for scheme in SCHEMES}
  for scheme, workdir in workdirs.items():
    loop.train_and_evaluate(config(tiny_config, scheme, corpus), workdir)
    out[scheme] = losses(workdir)
  out['cycle powernorm'] = out['cycle']
  out['norm_statistics'] = {'powernorm': norm_statistics(workdirs['cycle'])}
  workdir = str(tmp_path_factory.mktemp('cycle-transforms'))
  loop.train_and_evaluate(config(tiny_config, 'cycle', corpus, **TRANSFORMS), workdir)
  out['cycle transforms'] = losses(workdir)
  for kind in ALONE:
    workdir = str(tmp_path_factory.mktemp(f'cycle-{kind}'))
    loop.train_and_evaluate(config(tiny_config, 'cycle', corpus, **STATS_NORMS[kind]),
                                 workdir)
    out[f'cycle {kind}'] = losses(workdir)
    out['norm_statistics'][kind] = norm_statistics(workdir)
  return out


@pytest.mark.slow
@pytest.mark.parametrize('scheme,layout', [(s, n) for s in SCHEMES for n in SCHEME_LAYOUTS[s]])
def test_losses_match_one_device(eight, single, scheme, layout):
  got, want = eight['losses'][f'{scheme} {layout}'], single[scheme]
  assert len(want) == STEPS
  print(f'{scheme} {layout}: 1 device {want}; 8 devices max rel diff '
        f'{max(abs(got[s] - want[s]) / abs(want[s]) for s in want):.2e}')
  assert_close(got, want)


@pytest.mark.slow   # the 8-device subprocess (module fixture `eight`)
def test_parameter_transforms_and_the_flat_lowering_on_a_mesh_match_one_device(eight, single):
  """Transforms' gains, state and optimizer state, under scan_lowering='flat' (gathered sets,
  one scan) on data x fsdp x tensor, give the nested lowering's losses on one device."""
  got, want = eight['losses']['cycle transforms'], single['cycle transforms']
  assert len(want) == STEPS and want != single['cycle']
  assert_close(got, want)


@pytest.mark.slow   # the 8-device subprocess (module fixture `eight`)
@pytest.mark.parametrize('kind', STATS_NORMS)
def test_running_statistics_on_a_mesh_match_one_device(eight, single, kind):
  """A statistics norm under data x fsdp x tensor: the losses (2 warmup steps on the batch
  statistic, then the running one) and every running statistic after the 5 steps equal one
  device's: the statistics are means over the global batch."""
  assert_close(eight['losses'][f'cycle {kind}'], single[f'cycle {kind}'])
  got, want = eight['norm_statistics'][kind], single['norm_statistics'][kind]
  assert got.keys() == want.keys() and any(k.endswith("var']") or k.endswith("['phi']")
                                           for k in want)
  # Online Norm's statistics and control processes are associative scans over the rows, whose
  # partial results combine in another order when the rows are sharded: float32 rounding of
  # order 3e-5 of the leaf's scale after 5 steps of 4,096 rows.
  tol = 1e-4 if kind == 'online_norm' else RTOL
  for k in want:
    scale = float(np.max(np.abs(want[k]))) if want[k] else 0.0   # reduction-order noise
    np.testing.assert_allclose(got[k], want[k], rtol=tol, atol=tol * scale, err_msg=k)


@pytest.mark.slow   # the 8-device subprocess (module fixture `eight`)
@pytest.mark.parametrize('scheme', SCHEMES)
def test_checkpoint_restores_under_another_mesh(eight, scheme):
  resumed, (written, restored) = eight['resumed'][scheme], RESHARD[scheme]
  assert sorted(resumed) == [4, 5], resumed   # restored step 3 (written under `written`)
  uninterrupted = eight['losses'][f'{scheme} {written}']
  print(f'{scheme}: {written} -> {restored} resumed {resumed}; uninterrupted {uninterrupted}')
  assert_close(resumed, {s: uninterrupted[s] for s in (4, 5)})


@pytest.mark.slow   # the 8-device subprocess (module fixture `eight`)
def test_dry_run_bytes_shrink_with_fsdp(eight):
  dry = eight['dry_run']
  print({k: v['totals'] for k, v in dry.items()})
  full, fsdp8 = (dry[k]['totals']['param_bytes_per_device'] for k in ('fsdp=1', 'fsdp=8'))
  assert full == dry['fsdp=1']['totals']['param_bytes_total']
  assert abs(fsdp8 / full - 1 / 8) < 0.01, fsdp8 / full
  assert dry['fsdp=8']['totals']['state_bytes_per_device'] < dry['fsdp=1']['totals'][
      'state_bytes_per_device'] / 7
  text = dry['fsdp=8']['stdout']
  assert "('layers', 'embed', 'heads', 'head_dim')" in text and "P(None, 'fsdp'" in text
  assert 'compiled train step, per device' in text
  assert not any(d['wrote_workdir'] for d in dry.values())
  # 2 heads cannot split 8 ways: replicated on that dim, and said so.
  assert 'heads=2) is not divisible by mesh tensor (8); replicated' in dry['tensor=8']['stdout']


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _two_processes(train_cmd, base_env: dict, workdir: str, corpus: str, mesh, by_flag: bool,
                   timeout: float = 600) -> None:
  """Runs train.py as 2 processes x 4 CPU devices on localhost (gloo collectives).

  Multi-host start-up is asked for by --config.mesh.distributed=True or by the environment.
  """
  port, procs = _free_port(), []
  logs = [tempfile.TemporaryFile() for _ in range(2)]
  for i in range(2):
    e = device_env(base_env, 4)
    e.update(JAX_COORDINATOR_ADDRESS=f'localhost:{port}', JAX_NUM_PROCESSES='2',
             JAX_PROCESS_ID=str(i))
    e.pop('SHARENET_DISTRIBUTED', None)
    if not by_flag:
      e['SHARENET_DISTRIBUTED'] = '1'
    cmd = train_cmd(workdir, f'--config.train.steps={STEPS}', '--config.train.batch_size=8',
                    '--config.train.schedule=constant', '--config.train.warmup_steps=0',
                    '--config.train.checkpoint_every=3', '--config.model.num_layers=4',
                    '--config.data.source=text', f'--config.data.path={corpus}',
                    *mesh_flags(mesh), *(['--config.mesh.distributed=True'] if by_flag else []))
    procs.append(subprocess.Popen(cmd, env=e, stdout=logs[i], stderr=subprocess.STDOUT))
  deadline = time.time() + timeout
  try:
    # A process that fails leaves its peer waiting for collectives: stop both at once.
    while any(p.poll() is None for p in procs) and time.time() < deadline:
      if any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  for p, log in zip(procs, logs):
    log.seek(0)
    assert p.returncode == 0, log.read().decode(errors='replace')[-4000:]


@pytest.mark.slow
def test_two_processes_match_single_process(eight, corpus, tmp_path, losses, train_cmd,
                                            subprocess_env):
  workdir = str(tmp_path / 'w')
  _two_processes(train_cmd, subprocess_env, workdir, corpus, LAYOUTS['data=2,fsdp=4'],
                 by_flag=False)
  print(f'2 processes: {losses(workdir)}; 1 process: {eight["losses"]["untied data=2,fsdp=4"]}')
  assert_close(losses(workdir), eight['losses']['untied data=2,fsdp=4'])
  files = os.listdir(os.path.join(workdir, 'checkpoints', str(STEPS), 'data'))
  assert {'process_0-of-2.json', 'process_1-of-2.json'} <= set(files)
  # Both hosts restore the step-3 checkpoint under another mesh and continue identically.
  shutil.rmtree(os.path.join(workdir, 'checkpoints', str(STEPS)))
  _two_processes(train_cmd, subprocess_env, workdir, corpus, LAYOUTS['fsdp=8'], by_flag=True)
  files = os.listdir(os.path.join(workdir, 'checkpoints', str(STEPS), 'data'))
  assert {'process_0-of-2.json', 'process_1-of-2.json'} <= set(files)
  assert_close({s: losses(workdir)[s] for s in (4, 5)},
               {s: eight['losses']['untied fsdp=8'][s] for s in (4, 5)})


@pytest.mark.slow   # the 8-device subprocess (module fixture `eight`)
def test_hosts_must_read_contiguous_rows(eight):
  # Two simulated hosts owning devices 0-3 / 4-7 read one block each; interleaved ones don't.
  assert eight['contiguous'] == [True, False]


def test_scan_axes_unsharded_and_optimizer_state_follows_params(tiny_config):
  """Stacked ('layers') and per-applied-layer ('repeats', 'layers') axes stay whole."""
  import jax
  from flax.traverse_util import flatten_dict

  from sharenet.optim import chain
  from sharenet.train import sharding, trainer
  from sharenet.models import DecoderLM, ModelConfig, logical_axes, param_table
  c = tiny_config(**{'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
                     'model.sharing.num_unique': 2, 'model.sharing.lora_rank': 2,
                     'model.sharing.untie_norms': True})
  mcfg = ModelConfig.from_config(c.model)
  model, tx = DecoderLM(mcfg), chain.make_optimizer(c.train, table=param_table(mcfg))
  abstract = trainer.abstract_state(model, tx)
  mesh, rules = sharding.make_mesh(c.mesh), sharding.rules_of(c.mesh)
  logical = logical_axes(model)
  specs = sharding.param_specs(logical, abstract.params, mesh, rules)
  shardings = sharding.state_shardings(abstract, specs, mesh)
  names = flatten_dict(logical, is_leaf=lambda _, x: isinstance(x, jax.sharding.PartitionSpec))
  flat_specs = flatten_dict(specs, is_leaf=lambda _, x: isinstance(x, jax.sharding.PartitionSpec))
  seen = set()
  for path, n in names.items():
    for name, axes in zip(n, flat_specs[path]):
      seen.add(name)
      assert axes == {'layers': None, 'repeats': None, 'embed': 'fsdp',
                      'heads': 'tensor'}.get(name, axes), (path, n, flat_specs[path])
  assert {'layers', 'repeats', 'embed', 'heads', 'lora'} <= seen
  # Adam's moments carry their params' shardings; scalars (step counts) are replicated.
  param_sh = dict(jax.tree_util.tree_flatten_with_path(shardings.params)[0])
  moments = 0
  for path, sh in jax.tree_util.tree_flatten_with_path(shardings.opt_state)[0]:
    names = [getattr(k, 'name', None) for k in path]
    if 'mu' in names or 'nu' in names:
      moments += 1
      i = names.index('mu' if 'mu' in names else 'nu')
      assert sh == param_sh[tuple(path[i + 1:])], path
  assert moments == 2 * len(param_sh)
  for x, sh in zip(jax.tree.leaves(abstract.opt_state), jax.tree.leaves(shardings.opt_state)):
    assert x.ndim or sh.spec == jax.sharding.PartitionSpec()


BAD_MESH = [
    ({'mesh.fsdp': 3}, 'mesh.fsdp=3'),
    ({'mesh.data': 2}, 'mesh.data=2'),
    ({'mesh.data': -1, 'mesh.fsdp': -1}, 'at most one -1'),
    ({'mesh.rules': (('embed', 'model'),)}, 'mesh axis'),
]


@pytest.mark.parametrize('overrides, match', BAD_MESH)
def test_bad_mesh_is_one_line_config_error(overrides, match, tiny_config):
  with pytest.raises(ConfigError, match=match) as e:
    experiment.validate(tiny_config(**overrides))
  assert '\n' not in str(e.value)


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import conftest  # the suite's compilation cache and flags, and its plain helpers
  _worker(conftest.make_tiny_config, conftest.read_losses, *sys.argv[1:4])
