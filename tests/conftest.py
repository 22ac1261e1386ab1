"""Shared test setup (CPU, a persistent compilation cache, strict rank promotion) and fixtures.

Test modules never import each other: helpers two of them need live here, as fixtures. The
plain functions behind them (`make_tiny_config`, `read_losses`, ...) are for scripts that a
test runs in a subprocess, which `import conftest` for the same setup.
"""
import gc
import os
import sys
import types

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Tests check numerics, not speed, and compile hundreds of tiny programs: XLA:CPU settings that
# cut compile time (measured on a tiny model's gradient, 2-core CPU): LLVM at -O0 (~35 %), the
# classic elemental emitters instead of the MLIR fusion emitters (~2.5x), and one codegen
# thread per compile (the two test workers already fill both cores).
_FAST_COMPILE = {'--xla_backend_optimization_level': '0', '--xla_cpu_use_fusion_emitters': 'false',
                 '--xla_cpu_parallel_codegen_split_count': '1'}
_flags = os.environ.get('XLA_FLAGS', '')
os.environ['XLA_FLAGS'] = ' '.join([_flags] + [f'{k}={v}' for k, v in _FAST_COMPILE.items()
                                               if k not in _flags]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

_CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'sharenet', 'jax_tests')
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
jax.config.update('jax_numpy_rank_promotion', 'raise')
# As every entry point (sharenet/config/cli.py, GC_THRESHOLDS): at CPython's default thresholds
# a full collection walks a worker's every live object, jax's caches included, every few
# seconds (measured in docs/performance.md, "Garbage collection"). Old garbage is collected
# when the caches are dropped (_release_compiled_programs).
from sharenet.config.cli import GC_THRESHOLDS  # noqa: E402

gc.set_threshold(*GC_THRESHOLDS)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Tests evaluate the first 8192 validation tokens (one tiny-config eval batch), not the whole
# 446k-token split: a run's final evaluation is then ~1/50 of its former cost. Tests of the
# evaluation itself use their own data configs, which evaluate everything.
EVAL_TOKENS = 8192


def make_tiny_config(**overrides):
  """configs/tiny.py (evaluating EVAL_TOKENS validation tokens) with dotted overrides, e.g.
  make_tiny_config(**{'train.steps': 5})."""
  from configs import tiny
  c = tiny.get_config()
  c.data.eval_tokens = EVAL_TOKENS
  for key, value in overrides.items():
    section, _, name = key.rpartition('.')
    node = c
    for part in section.split('.') if section else []:
      node = node[part]
    node[name] = value
  return c


def read_losses(workdir):
  """Last logged loss per step (a killed run may have logged steps that were redone)."""
  from sharenet.train.metrics import read_metrics
  return {r['step']: r['loss'] for r in read_metrics(workdir) if 'loss' in r}


def make_train_cmd(workdir, *flags):
  """`python train.py` on configs/tiny.py (evaluating EVAL_TOKENS tokens) with extra --config
  flags."""
  return [sys.executable, os.path.join(ROOT, 'train.py'), '--config',
          os.path.join(ROOT, 'configs', 'tiny.py'), f'--workdir={workdir}',
          f'--config.data.eval_tokens={EVAL_TOKENS}', *flags]


def kill_after_checkpoint(cmd, env, workdir, step):
  """Starts `cmd` (a train.py run into `workdir`), kills it with SIGKILL once its
  checkpoint `step` exists (at most 300 s), and asserts that checkpoint was written."""
  import signal
  import subprocess
  import time
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt = os.path.join(workdir, 'checkpoints', str(step))
  deadline = time.time() + 300
  while not os.path.isdir(ckpt) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert os.path.isdir(ckpt), f'the run never wrote its step-{step} checkpoint'


def share_a_wandb_service(tmp_path, monkeypatch):
  """Starts a W&B service in this process (offline) and leaves WANDB_SERVICE naming it for
  the rest of the test, as a launcher or notebook that uses wandb does for its children."""
  import wandb
  before = os.environ.get('WANDB_SERVICE')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  # wandb names its service in the environment when it starts one and reuses it after; one
  # this process holds unnamed (the variable was removed since) is ended so that one starts
  if before is None:
    wandb.teardown()
  wandb.init(project='launcher', dir=str(tmp_path)).finish()
  value = os.environ.get('WANDB_SERVICE')
  assert value, 'wandb started no service'
  if before is None:   # after the test the variable is unset again, as before it
    os.environ.pop('WANDB_SERVICE')
    monkeypatch.setenv('WANDB_SERVICE', value)


def resume_matches_uninterrupted(tmp_path, flags, step, last):
  """Runs tiny train.py with `flags` to the end in one workdir, and in another kills it (-9)
  once its checkpoint `step` exists and reruns it; asserts the rerun resumed there and logged
  the uninterrupted run's losses for steps step+1..last, bit for bit."""
  import subprocess
  env = make_subprocess_env()
  ref, killed = str(tmp_path / 'ref'), str(tmp_path / 'killed')
  def run(workdir):
    out = subprocess.run(make_train_cmd(workdir, *flags), env=env, capture_output=True, text=True)
    assert out.returncode == 0, f'{workdir}: exit {out.returncode}\n{out.stderr[-3000:]}'
    return out
  run(ref)
  kill_after_checkpoint(make_train_cmd(killed, *flags), env, killed, step)
  out = run(killed)
  assert f'resumed from checkpoint at step {step}' in out.stdout
  want, got = read_losses(ref), read_losses(killed)
  assert [got[s] for s in range(step + 1, last + 1)] == [want[s]
                                                           for s in range(step + 1, last + 1)]
  return ref, killed


def rel_err(a, b):
  """max |a - b| / max |b|, on the host: op by op, jnp would compile each leaf's shape."""
  import numpy as np
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def make_subprocess_env():
  """This environment plus the repo on PYTHONPATH and the suite's compilation cache."""
  e = dict(os.environ)
  e['JAX_COMPILATION_CACHE_DIR'] = jax.config.jax_compilation_cache_dir or ''
  e['PYTHONPATH'] = ROOT
  return e


@pytest.fixture(scope='session')
def repo_root():
  """Absolute path of the repository root."""
  return ROOT


@pytest.fixture(scope='session')
def tiny_config():
  """Factory: tiny_config(**{'section.field': value}) -> a fresh configs/tiny.py config."""
  return make_tiny_config


@pytest.fixture(scope='session')
def losses():
  """losses(workdir) -> {step: last logged loss}."""
  return read_losses


@pytest.fixture(scope='session')
def train_cmd():
  """train_cmd(workdir, *flags) -> argv of a tiny train.py run."""
  return make_train_cmd


@pytest.fixture(scope='session')
def subprocess_env():
  """Environment for a subprocess running repository code; read-only (extend a dict() copy)."""
  return types.MappingProxyType(make_subprocess_env())


@pytest.fixture(scope='session')
def text_cfg(tmp_path_factory):
  """A data config of one random text file: its last 1 % (300 bytes) is the validation split
  (eval_lib tests, evaluation at test-time depths)."""
  import ml_collections
  import numpy as np
  path = tmp_path_factory.mktemp('corpus') / 'corpus.txt'
  path.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 30_000, np.uint8)))
  return ml_collections.ConfigDict({'source': 'text', 'path': str(path)})


@pytest.fixture
def small_corpus(tmp_path):
  """Path of a 30 kB text file (the start of os.py): the data of the studies' tiny runs."""
  path = tmp_path / 'corpus.txt'
  with open(os.__file__, 'rb') as f:
    path.write_bytes(f.read()[:30_000])
  return str(path)


def randomize_per_layer(variables, scale=0.3, seed=1):
  """`variables` with every per-layer part (depth-wise LoRA, untied norms) shifted by
  scale * N(0, 1), so that the loops of a looped model differ."""
  leaves, tree = jax.tree.flatten(variables['per_layer'])
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return {**variables, 'per_layer': jax.tree.unflatten(tree, [
      x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])}


@pytest.fixture(scope='session')
def randomized_per_layer():
  """randomized_per_layer(variables) -> the variables with randomised per-layer parts."""
  return randomize_per_layer


def assert_greedy_is_full_forward_argmax(model, variables, prompt, n):
  """Greedy cached decoding of `n` tokens after `prompt` picks, at every step, the argmax of
  one full (uncached) forward over the prompt and the generated tokens."""
  import jax.numpy as jnp
  import numpy as np
  from sharenet.inference import generate
  out = generate.generate(model, variables, [prompt], n, temperature=0).tokens[0]
  logits = model.apply(variables, jnp.asarray([(list(prompt) + list(out))[:-1]]))
  assert list(np.asarray(jnp.argmax(logits[0, len(prompt) - 1:], -1))) == list(out)


@pytest.fixture(scope='session')
def greedy_is_full_forward_argmax():
  """greedy_is_full_forward_argmax(model, variables, prompt, n): asserts that greedy cached
  decoding equals the full forward's argmax."""
  return assert_greedy_is_full_forward_argmax


# The slow tier (-m slow; the fast tier is -m "not slow") is the tests marked @pytest.mark.slow:
# 8-device subprocesses, notebooks, trained-checkpoint conversions, compatibility rows, and
# every test measured over ~4 s in a full run of the suite (`python benchmarks/suite_profile.py
# --junit FILE` names the unmarked ones).


# A worker's resident memory above which jax's in-memory caches are dropped after a module.
RELEASE_RSS_BYTES = 3 << 30


def _resident_bytes():
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


@pytest.fixture(autouse=True, scope='module')
def _release_compiled_programs():
  """Drops jax's in-memory caches (traced and compiled programs) after a test module once the
  worker holds more than RELEASE_RSS_BYTES.

  One pytest process otherwise keeps every executable of the suite alive (8.4 GB resident by
  test_transforms); below the bound, later modules reuse the small programs (op-by-op
  dispatch, optimizer updates) earlier ones compiled. The persistent compilation cache still
  serves dropped programs from disk.
  """
  yield
  if not os.path.exists('/proc/self/statm') or _resident_bytes() > RELEASE_RSS_BYTES:
    jax.clear_caches()
    from sharenet.models import param_table
    param_table.cache_clear()   # the init traces it keeps hold their compiled inits
    gc.collect()


# SHARENET_TEST_PROFILE=DIR: one JSON line per test (wall seconds, XLA compiles and their
# seconds, lowering and tracing seconds) in DIR/<worker>.jsonl, to find where the suite's
# time goes (`python benchmarks/suite_profile.py DIR` summarizes them).
_PROFILE_DIR = os.environ.get('SHARENET_TEST_PROFILE')
if _PROFILE_DIR:
  import json
  import time
  from jax._src import dispatch as _dispatch

  _counts = {}

  def _on_duration(event, seconds, **_):
    key = {_dispatch.BACKEND_COMPILE_EVENT: 'compile', _dispatch.JAXPR_TRACE_EVENT: 'trace',
           _dispatch.JAXPR_TO_MLIR_MODULE_EVENT: 'lower'}.get(event)
    if key:
      _counts[key + '_s'] = _counts.get(key + '_s', 0.0) + seconds
      _counts[key + 's'] = _counts.get(key + 's', 0) + 1

  jax.monitoring.register_event_duration_secs_listener(_on_duration)

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    _counts.clear()
    start = time.perf_counter()
    yield
    row = {'test': item.nodeid, 'wall_s': round(time.perf_counter() - start, 3),
           **{k: round(v, 3) for k, v in _counts.items()}}
    os.makedirs(_PROFILE_DIR, exist_ok=True)
    worker = os.environ.get('PYTEST_XDIST_WORKER', 'main')
    with open(os.path.join(_PROFILE_DIR, f'{worker}.jsonl'), 'a') as f:
      f.write(json.dumps(row) + '\n')
