"""Distillation from a teacher workdir (train.teacher; sharenet/train/distill.py, teacher.py)."""
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.train import distill, trainer


def _np_kd(s, t, temp):
  """T^2 KL(softmax(t/T) || softmax(s/T)) per row, in float64 numpy."""
  def log_softmax(x):
    x = x / temp
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
  lp, lq = log_softmax(t.astype(np.float64)), log_softmax(s.astype(np.float64))
  return temp * temp * (np.exp(lp) * (lp - lq)).sum(-1)


@pytest.mark.parametrize('temp', [1.0, 2.0, 0.5])
def test_kd_equals_a_numpy_restatement(temp):
  rng = np.random.default_rng(0)
  s, t = rng.normal(size=(2, 5, 11)) * 3, rng.normal(size=(2, 5, 11)) * 3
  got = np.asarray(distill.kd_per_token(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32),
                                        temp))
  np.testing.assert_allclose(got, _np_kd(s, t, temp), rtol=1e-5, atol=1e-6)
  nll = rng.random((2, 5))
  loss, m = distill.mix(jnp.asarray(nll), jnp.asarray(got), 0.25)
  np.testing.assert_allclose(float(loss), 0.75 * nll.mean() + 0.25 * got.mean(), rtol=1e-6)
  assert float(m['distill_kd']) == pytest.approx(got.mean(), rel=1e-6)


@pytest.mark.slow
def test_a_student_equal_to_its_teacher_has_zero_loss_and_gradient(tiny_config):
  model = DecoderLM(ModelConfig.from_config(tiny_config().model))
  params = init_variables(model, jax.random.key(0), seq_len=16)
  batch = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)
  teacher = distill.Distill(model, 1.0, 1.0)
  (loss, aux), grads = jax.value_and_grad(trainer.loss_fn, has_aux=True)(
      params, {}, batch, model=model, teacher=teacher, teacher_vars=params)
  assert abs(float(loss)) < 1e-6 and float(aux['distill_ce']) > 1.0
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) < 1e-6
  # another student: a positive loss and a gradient
  other = init_variables(model, jax.random.key(5), seq_len=16)
  (loss, _), grads = jax.value_and_grad(trainer.loss_fn, has_aux=True)(
      other, {}, batch, model=model, teacher=teacher, teacher_vars=params)
  assert float(loss) > 1e-4 and max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-4


@pytest.mark.parametrize('normalize', [True, False])
def test_hidden_matching_equals_a_numpy_restatement(normalize):
  rng = np.random.default_rng(1)
  s, t = rng.normal(size=(3, 2, 5, 8)) * 2, rng.normal(size=(4, 2, 5, 8)) * 5
  match = ((2, 3), (0, 1))
  got = np.asarray(distill.hidden_per_token(jnp.asarray(s, jnp.float32),
                                            jnp.asarray(t, jnp.float32), match, normalize))
  n = (lambda h: h / np.sqrt((h * h).mean(-1, keepdims=True))) if normalize else (lambda h: h)
  want = np.mean([((n(s[a]) - n(t[b])) ** 2).mean(-1) for a, b in match], axis=0)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert distill.parse_match(' 2:3, 0:1', 3, 4) == match


@pytest.mark.slow
def test_a_folded_student_matches_its_teachers_every_layer(tiny_config):
  """The untied teacher folded into a cycle with full-rank SVD LoRA computes the same streams
  in applied order, so hidden matching of every layer pair is zero with zero gradient; matching
  shifted layers is not."""
  from sharenet.transforms import recursive
  cfg = ModelConfig.from_config(tiny_config(**{'model.num_layers': 4}).model)
  model = DecoderLM(cfg)
  params = init_variables(model, jax.random.key(0), seq_len=16)
  scfg, svars = recursive.to_recursive(cfg, params, scheme='cycle', num_unique=2,
                                       init='average', lora_rank=cfg.d_model, lora_init='svd',
                                       lora_targets=('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out'))
  student = DecoderLM(scfg)
  batch = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
  same = distill.Distill(model, 1.0, 1.0, ((0, 0), (1, 1), (2, 2), (3, 3)), 1.0, True)
  grad = jax.value_and_grad(trainer.loss_fn, has_aux=True)
  (loss, aux), g = grad(svars, {}, batch, model=student, teacher=same, teacher_vars=params)
  assert abs(float(loss)) < 1e-6 and float(aux['distill_hidden']) < 1e-9
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g)) < 1e-5
  shifted = same._replace(match=((0, 1), (2, 3)))
  (loss, aux), g = grad(svars, {}, batch, model=student, teacher=shifted, teacher_vars=params)
  assert float(aux['distill_hidden']) > 1e-3
  assert float(loss) == pytest.approx(float(aux['distill_kd']) + float(aux['distill_hidden']),
                                      rel=1e-5)
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g)) > 1e-4


@pytest.fixture(scope='module')
def teacher_dir(tmp_path_factory, tiny_config):
  from sharenet.train import loop
  path = str(tmp_path_factory.mktemp('teacher'))
  loop.train_and_evaluate(tiny_config(**{'train.steps': 4}), path)
  return path


@pytest.mark.slow
def test_train_distills_from_a_teacher_workdir(teacher_dir, tmp_path, tiny_config):
  from sharenet.train import loop
  from sharenet.train.metrics import read_metrics
  config = tiny_config(**{'train.steps': 3, 'train.log_every': 1, 'model.num_layers': 4,
                          'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2,
                          'train.teacher.workdir': teacher_dir, 'train.teacher.weight': 0.5,
                          'train.teacher.temperature': 2.0, 'train.teacher.match': '1:0,3:1',
                          'train.teacher.match_weight': 0.1})
  loop.train_and_evaluate(config, str(tmp_path / 'student'))
  rows = [r for r in read_metrics(str(tmp_path / 'student')) if 'loss' in r]
  assert len(rows) == 3
  for r in rows:
    assert r['distill_kd'] > 0 and r['distill_hidden'] > 0
    assert r['loss'] == pytest.approx(0.5 * r['distill_ce'] + 0.5 * r['distill_kd'] +
                                      0.1 * r['distill_hidden'], rel=1e-5)


@pytest.mark.parametrize('overrides, match', [
    ({'train.teacher.weight': 0.0}, 'weight=0.0; valid: 0 < weight <= 1'),
    ({'train.teacher.temperature': 0.0}, r'temperature=0.0; valid: > 0'),
    ({'model.vocab_size': 300}, 'vocab_size=256, the student 300'),
    ({'train.exit_loss': 'all', 'model.sharing.scheme': 'universal',
      'model.sharing.num_unique': 1}, 'not built'),
    ({'train.teacher.match': '1:9'}, r"'1:9' is out of range; valid: .* 0..1 : 0..1"),
    ({'train.teacher.match': '1-1'}, "'1-1' is not S:T"),
    ({'train.teacher.match': '1:1', 'train.teacher.match_weight': 0.0}, 'match_weight=0.0'),
    ({'train.teacher.match': '1:1', 'model.d_model': 48}, 'd_model 48 .student. and 32'),
    ({'train.teacher.match': '1:1', 'model.routing.kind': 'expert_choice',
      'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 1}, 'a routed model'),
])
def test_bad_teachers_are_one_line_and_write_nothing(teacher_dir, tmp_path, tiny_config,
                                                     overrides, match):
  from sharenet.train import loop
  config = tiny_config(**{'train.teacher.workdir': teacher_dir, **overrides})
  with pytest.raises(ConfigError, match=match) as e:
    loop.train_and_evaluate(config, str(tmp_path / 'run'))
  assert '\n' not in str(e.value) and not (tmp_path / 'run').exists()


def test_a_teacher_workdir_without_a_run_is_one_line(tmp_path, tiny_config):
  from sharenet.train import loop
  with pytest.raises(ConfigError, match='has no config.json'):
    loop.train_and_evaluate(tiny_config(**{'train.teacher.workdir': str(tmp_path)}),
                            str(tmp_path / 'run'))


def _mesh_worker(out_path, teacher, workdir):
  """Runs in the 8-device subprocess: the student distilled on data=2, fsdp=2, tensor=2."""
  import json
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import conftest
  from sharenet.train import loop
  assert jax.device_count() == 8
  config = _mesh_config(conftest.make_tiny_config, teacher, (2, 2, 2))
  loop.train_and_evaluate(config, workdir)
  with open(out_path, 'w') as f:
    json.dump(conftest.read_losses(workdir), f)


def _mesh_config(make, teacher, mesh=(-1, 1, 1)):
  c = make(**{'train.steps': 3, 'train.log_every': 1, 'train.batch_size': 8,
              'train.eval_batch_size': 8, 'train.teacher.workdir': teacher,
              'train.teacher.weight': 0.5, 'train.teacher.temperature': 2.0})
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


@pytest.mark.slow
def test_distillation_on_a_mesh_matches_one_device(teacher_dir, tmp_path, tiny_config, losses,
                                                   repo_root, subprocess_env):
  import json
  import subprocess
  import sys
  from sharenet.train import loop
  env = dict(subprocess_env, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  out = tmp_path / 'eight.json'
  res = subprocess.run([sys.executable, __file__, str(out), teacher_dir, str(tmp_path / 'eight')],
                       env=env, capture_output=True, text=True, timeout=600, cwd=repo_root)
  assert res.returncode == 0, res.stderr[-4000:]
  eight = {int(k): v for k, v in json.loads(out.read_text()).items()}
  loop.train_and_evaluate(_mesh_config(tiny_config, teacher_dir), str(tmp_path / 'one'))
  one = losses(str(tmp_path / 'one'))
  assert sorted(eight) == sorted(one) == [1, 2, 3]
  for s in one:
    assert abs(eight[s] - one[s]) <= 1e-5 * abs(one[s]), (s, eight[s], one[s])


if __name__ == '__main__':
  import sys
  _mesh_worker(*sys.argv[1:4])
