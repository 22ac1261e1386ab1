"""train.eval_tasks under a mesh: the harness scores the sharded parameters of a run on 8
simulated devices (data=2, fsdp=2, tensor=2) as one device scores the same run's.

The 8-device run needs a fresh process (JAX fixes the device count at start-up): this file's
`__main__` trains there and writes its metrics rows as JSON.
"""
import json
import os
import subprocess
import sys

import pytest

TASK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'fixtures',
                        'tasks')
RTOL = 1e-4


def _config(tiny_config, mesh=(-1, 1, 1)):
  c = tiny_config(**{'train.steps': 2, 'train.batch_size': 8, 'train.eval_batch_size': 8,
                     'train.eval_tasks': 'sharenet_mc,sharenet_rolling',
                     'train.eval_task_dir': TASK_DIR, 'train.eval_task_limit': 6})
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def _task_rows(workdir):
  from sharenet.train.metrics import read_metrics
  (row,) = [r for r in read_metrics(workdir) if 'eval_loss' in r]
  return {k: v for k, v in row.items() if k.startswith('task/')}


def _worker(tiny_config, out_path, workdir):
  import jax
  from sharenet.train import loop
  assert jax.device_count() == 8, jax.devices()
  loop.train_and_evaluate(_config(tiny_config, (2, 2, 2)), workdir)
  with open(out_path, 'w') as f:
    json.dump(_task_rows(workdir), f)


@pytest.mark.slow
def test_task_metrics_on_a_mesh_match_one_device(tmp_path, tiny_config, repo_root,
                                                 subprocess_env):
  from sharenet.train import loop
  env = dict(subprocess_env, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  out = tmp_path / 'eight.json'
  res = subprocess.run([sys.executable, __file__, str(out), str(tmp_path / 'eight')], env=env,
                       capture_output=True, text=True, timeout=600, cwd=repo_root)
  assert res.returncode == 0, res.stderr[-4000:]
  eight = json.loads(out.read_text())
  loop.train_and_evaluate(_config(tiny_config), str(tmp_path / 'one'))
  one = _task_rows(str(tmp_path / 'one'))
  assert sorted(eight) == sorted(one) and 'task/sharenet_rolling/bits_per_byte' in one
  for k, v in one.items():
    assert abs(eight[k] - v) <= RTOL * abs(v), (k, eight[k], v)


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import conftest  # the suite's compilation cache and flags, and its plain helpers
  _worker(conftest.make_tiny_config, *sys.argv[1:3])
