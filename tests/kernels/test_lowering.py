"""TPU and GPU programs lowered on this CPU: every program sharenet compiles, with its kernels.

jax lowers for a platform the host lacks (`jax.export.export(jax.jit(f), platforms=[p])`);
under `sharenet.kernels.target(p)` the kernels are chosen for that platform, so these modules
are the ones a TPU or GPU user compiles, Mosaic's and Triton's lowering rules included
(sharenet/kernels/lowering.py). From abstract shapes only (jax.eval_shape), never compiled.
Programs:
the train step (built as sharenet/train/loop.py builds it), generation's compiled program
(prefill and the decode loop, sharenet/inference/generate.py) and recursive inference's tick
(sharenet/inference/loop_by_loop.py). Each lowers for 'tpu' and 'cuda' and calls every Pallas
kernel docs/scaling.md ("Lowering") claims for the platform; bfloat16 TPU modules hold no
float32 x float32 matmul outside the allowlist there. On an 8-device mesh (data x fsdp x
tensor; a subprocess, as jax fixes the device count at start-up) the train step and generation
lower with their shardings, each kernel per shard. Shapes are the smallest the kernels' block
rules take (T = 128, TPU's lane width); the fused add + norm also at pod widths and lengths.
"""
import collections
import functools
import json
import os
import subprocess
import sys
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import pytest

from sharenet.train import experiment, sharding, trainer
from sharenet.inference import generate
from sharenet import kernels
from sharenet.kernels import lowering
from sharenet.inference import loop_by_loop
from sharenet.errors import ConfigError
from sharenet.kernels import norms as norm_kernels
from sharenet.models import DecoderLM, init_variables, logical_axes

PLATFORMS = lowering.PLATFORMS
SMALL = {'model.d_model': 128, 'model.num_heads': 2, 'model.mlp_dim': 256,
         'train.seq_len': 128, 'train.batch_size': 2}
CONFIGS = {
    'untied': {'model.num_layers': 2},
    'cycle': {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
              'model.sharing.num_unique': 2},
    'middle_cycle_lora': {'model.num_layers': 4, 'model.sharing.scheme': 'middle_cycle',
                          'model.sharing.num_unique': 3, 'model.sharing.lora_rank': 8,
                          'model.sharing.lora_targets': 'q,v,mlp_in',
                          'model.sharing.untie_norms': True},
    # capacities 1, 1/2: the second recursion's 64 tokens pad to the TPU kernel's 128.
    'mor_expert_choice': {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
                          'model.sharing.num_unique': 2, 'model.routing.kind': 'expert_choice'},
}
DECODE_CONFIGS = ('untied', 'cycle', 'middle_cycle_lora')   # generation serves no routed model
# The plans recursive inference serves (loop by loop: prelude, loops, coda).
TICK_CONFIGS = ('cycle', 'middle_cycle_lora')
# Every config under both kernel switches and both dtypes on each platform.
SETTINGS = (('pallas', 'bfloat16'), ('auto', 'float32'))

# The kernels docs/scaling.md claims, by name in the platform's custom call.
ATTENTION = {'tpu': ('_flash_attention_kernel',), 'cuda': ('mha_forward',)}
ATTENTION_GRAD = {'tpu': ('_flash_attention_dq_kernel', '_flash_attention_dkv_kernel'),
                  'cuda': ('mha_backward',)}
NORMS = ('add_rmsnorm_fwd',)      # the default norm, rmsnorm; its backward below
NORMS_GRAD = ('add_rmsnorm_bwd',)
EXPECTED = {
    'train': {p: ATTENTION[p] + ATTENTION_GRAD[p] + NORMS + NORMS_GRAD for p in PLATFORMS},
    # The cached attention of generation and of the tick goes through kernels/attention.py as
    # training's does; the fused kernels take no key positions, so it runs the XLA reference.
    'decode': {p: NORMS for p in PLATFORMS},
    'tick': {p: NORMS for p in PLATFORMS},
}
# float32 x float32 matmuls a bfloat16 TPU module may hold, by op name (docs/scaling.md).
F32_MATMULS_ALLOWED = ('router.expert_logits', 'router.token_logits')


class Program(NamedTuple):
  fn: Callable
  args: tuple
  jit_kwargs: dict
  mesh: Any = None     # (mesh, rules) to trace under, or None


def config(make, name: str, kernels_: str = 'pallas', dtype: str = 'bfloat16',
           mesh: tuple[int, int, int] | None = None):
  c = make(**SMALL, **CONFIGS[name], **{'model.kernels': kernels_, 'model.dtype': dtype})
  if mesh is not None:
    c.train.batch_size = c.train.eval_batch_size = 4
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def _mesh(c):
  return sharding.make_mesh(c.mesh), sharding.rules_of(c.mesh)


def train_program(c, sharded: bool = False) -> Program:
  """The train step as loop.train_and_evaluate jits it, on abstract state and batch."""
  exp = trainer.setup(c, experiment.validate(c))
  abstract = trainer.abstract_state(exp.model, exp.tx, exp.tr, exp.pz)
  batch = jax.ShapeDtypeStruct((c.train.batch_size, c.train.seq_len + 1), jnp.int32)
  step = trainer.make_train_step(exp)
  if not sharded:
    return Program(step, (abstract, batch), {})
  mesh, rules = _mesh(c)
  specs = sharding.param_specs(logical_axes(exp.model), abstract.params, mesh, rules)
  shardings = sharding.state_shardings(abstract, specs, mesh)
  batch_sharding = sharding.batch_sharding(mesh, rules)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  batch = jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=batch_sharding)
  return Program(step, (sharding.with_shardings(abstract, shardings), batch),
                 dict(in_shardings=(shardings, batch_sharding),
                      out_shardings=(shardings, replicated)), (mesh, rules))


def decode_program(c, sharded: bool = False) -> Program:
  """generate's compiled program: an 8-token prompt bucket, then 4 sampled tokens."""
  model = DecoderLM(experiment.validate(c))
  variables = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((8, 8), jnp.int32)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  fn = functools.partial(generate._generate_padded, model=model, max_new_tokens=4,
                         temperature=1.0, top_k=5, top_p=0.9, eos_id=0)
  if not sharded:
    return Program(fn, (variables, tokens, tokens, rng), {})
  mesh, rules = _mesh(c)
  specs = sharding.param_specs(logical_axes(model), variables, mesh, rules)
  named = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                       is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  rows = sharding.batch_sharding(mesh, rules)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return Program(fn, (variables, tokens, tokens, rng),
                 dict(in_shardings=(named, rows, rows, replicated)), (mesh, rules))


def tick_program(c) -> Program:
  """One tick of recursive inference over 8 slots, 16 cache positions."""
  model = DecoderLM(experiment.validate(c))
  variables = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
  slots = jax.eval_shape(lambda: loop_by_loop.empty_slots(model, 8, 16, 4))
  fn = functools.partial(loop_by_loop._tick, model=model, sync=False)
  scalars = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
  return Program(fn, (variables, slots, *scalars), {})


def lower(program: Program, platform: str):
  if program.mesh is None:
    return lowering.export(program.fn, program.args, platform, **program.jit_kwargs)
  with sharding.activate(*program.mesh):
    return lowering.export(program.fn, program.args, platform, **program.jit_kwargs)


def stray_f32_matmuls(exported) -> list[tuple[str, str]]:
  return [(name, types) for name, types in lowering.f32_matmuls(exported)
          if not any(a in name for a in F32_MATMULS_ALLOWED)]


def check(exported, platform: str, program: str, dtype: str) -> None:
  calls = lowering.kernel_calls(exported, platform)
  missing = [k for k in EXPECTED[program][platform] if not calls[k]]
  assert not missing, f'{program} for {platform}: no {missing} among {dict(calls)}'
  assert '?' not in calls, f'a {platform} custom call without a kernel name: {dict(calls)}'
  if platform == 'tpu' and dtype == 'bfloat16':
    stray = stray_f32_matmuls(exported)
    assert not stray, f'float32 x float32 matmuls in the bf16 TPU {program}: {stray}'


@pytest.mark.slow
@pytest.mark.parametrize('platform, name, kernels_, dtype',
                         [(p, n, k, d) for p in PLATFORMS for n in CONFIGS for k, d in SETTINGS])
def test_train_step_lowers_with_its_kernels(tiny_config, platform, name, kernels_, dtype):
  check(lower(train_program(config(tiny_config, name, kernels_, dtype)), platform), platform,
        'train', dtype)


@pytest.mark.parametrize('platform, name, kernels_, dtype',
                         [(p, n, *SETTINGS[0]) for p in PLATFORMS for n in DECODE_CONFIGS] +
                         [(p, 'cycle', *SETTINGS[1]) for p in PLATFORMS])
@pytest.mark.slow
def test_generation_lowers_with_its_kernels(tiny_config, platform, name, kernels_, dtype):
  check(lower(decode_program(config(tiny_config, name, kernels_, dtype)), platform), platform,
        'decode', dtype)


@pytest.mark.slow
@pytest.mark.parametrize('platform, name, kernels_, dtype',
                         [(p, n, k, d) for p in PLATFORMS for n in TICK_CONFIGS
                          for k, d in SETTINGS])
def test_recursive_inference_tick_lowers_with_its_kernels(tiny_config, platform, name, kernels_,
                                                          dtype):
  check(lower(tick_program(config(tiny_config, name, kernels_, dtype)), platform), platform,
        'tick', dtype)


def test_f32_matmuls_are_found_and_named(tiny_config):
  """The allowlist check sees what it should: a float32 model's matmuls, by op name."""
  found = lowering.f32_matmuls(lower(tick_program(config(tiny_config, 'cycle', 'auto',
                                                         'float32')), 'tpu'))
  assert any('readout' in name for name, _ in found), found
  assert all(name for name, _ in found), found


# Pod widths and lengths (one sequence of T rows per device), where the block rules bite: on
# GPU a row of D elements per Triton program, on TPU 8-256 rows of D float32 in VMEM.
POD = ([('rmsnorm', d, t, 'bfloat16') for d in (1024, 2048, 4096, 8192) for t in (2048, 8192)] +
       [(kind, 8192, 8192, dt) for kind in ('layernorm', 'crmsnorm') for dt in ('bfloat16',)] +
       [('rmsnorm', 8192, 8192, 'float32')])


@pytest.mark.parametrize('platform', PLATFORMS)
def test_add_norm_lowers_at_pod_widths(platform):
  for kind, d, t, dtype in POD:
    x = jax.ShapeDtypeStruct((1, t, d), jnp.dtype(dtype))
    gain = jax.ShapeDtypeStruct((d,), jnp.float32)
    bias = gain if kind == 'layernorm' else None

    def loss(x, residual, gain, bias):
      s, y = norm_kernels.add_norm(x, residual, gain, bias, kind=kind, eps=1e-6)
      return jnp.sum(s.astype(jnp.float32)) + jnp.sum(y.astype(jnp.float32))

    exported = lowering.export(jax.grad(loss, argnums=(0, 1, 2)), (x, x, gain, bias), platform)
    calls = lowering.kernel_calls(exported, platform)
    assert calls == collections.Counter({f'add_{kind}_fwd': 1, f'add_{kind}_bwd': 1}), (
        kind, d, t, dtype, calls)


def test_target_chooses_the_kernels_of_its_platform_then_the_hosts_again():
  assert kernels.backend() == 'cpu' and not kernels.use_pallas('auto')
  for platform, backend in (('tpu', 'tpu'), ('cuda', 'gpu'), ('gpu', 'gpu')):
    with kernels.target(platform):
      assert kernels.backend() == backend and kernels.use_pallas('auto')
      assert not kernels.interpret() and not kernels.rows_weight_grad('auto')
      assert kernels.attention_backend('auto', 'auto') == 'pallas'
  assert kernels.backend() == 'cpu' and kernels.attention_backend('auto', 'auto') == 'chunked'


def test_target_is_part_of_jits_cache_key():
  f = jax.jit(lambda x: x + {'cpu': 0, 'gpu': 1, 'tpu': 2}[kernels.backend()])
  assert int(f(0)) == 0
  with kernels.target('tpu'):
    assert int(f(0)) == 2     # retraced, not served from the host's trace
  assert int(f(0)) == 0


def test_unknown_target_is_one_line_config_error():
  with pytest.raises(ConfigError, match='valid: cpu, gpu, cuda, rocm, tpu') as e:
    kernels.target('metal')
  assert '\n' not in str(e.value)
  with pytest.raises(ConfigError, match='valid: tpu, cuda'):
    lowering.export(lambda x: x, (jax.ShapeDtypeStruct((), jnp.float32),), 'rocm')


def test_docs_name_every_asserted_kernel_and_allowed_matmul(repo_root):
  with open(os.path.join(repo_root, 'docs', 'scaling.md')) as f:
    text = f.read()
  names = {n for program in EXPECTED.values() for p in program.values() for n in p}
  names |= {f'add_{k}_{s}' for k in norm_kernels.KINDS for s in ('fwd', 'bwd')}
  missing = [n for n in sorted(names) + list(F32_MATMULS_ALLOWED) if f'`{n}`' not in text]
  assert not missing, f'docs/scaling.md does not name {missing}'


# ---- an 8-device mesh (data 2 x fsdp 2 x tensor 2), in a subprocess -------------------------

MESH = (2, 2, 2)
MESH_CASES = ([('train', p, n) for p in PLATFORMS for n in CONFIGS] +
              [('decode', p, 'cycle') for p in PLATFORMS])


def _worker(make, out_path: str) -> None:
  """Runs in the 8-device subprocess: lowers MESH_CASES, and compares the sharded kernels'
  gradients (Pallas interpret mode on this CPU) with the XLA path's."""
  assert jax.device_count() == 8, jax.devices()
  out = {'lowered': {}}
  for program, platform, name in MESH_CASES:
    build = train_program if program == 'train' else decode_program
    row = {'error': None}
    try:
      exported = lower(build(config(make, name, mesh=MESH), sharded=True), platform)
      text = exported.mlir_module()
      row.update(kernels=dict(lowering.kernel_calls(text, platform)),
                 per_shard='sdy.manual_computation' in text or '{manual}' in text,
                 devices=exported.nr_devices,
                 stray_f32=stray_f32_matmuls(text) if platform == 'tpu' else [])
    except Exception as e:   # noqa: BLE001 -- reported by the test that reads it
      row['error'] = f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
    out['lowered'][f'{program} {platform} {name}'] = row
  grads = {}
  for kernels_ in ('xla', 'pallas'):
    c = make(**CONFIGS['cycle'], **{'model.kernels': kernels_, 'train.batch_size': 4})
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = MESH
    program = train_program(c, sharded=True)
    exp = trainer.setup(c, experiment.validate(c))
    mesh, rules = program.mesh
    with sharding.activate(mesh, rules):
      state = jax.jit(functools.partial(trainer.init_state, exp.model, exp.tx, tr=exp.tr,
                                        pz=exp.pz),
                      out_shardings=program.jit_kwargs['in_shardings'][0])(jax.random.key(0))
      batch = jax.random.randint(jax.random.key(1), program.args[1].shape, 0, 256)
      loss = lambda p, b: trainer.loss_fn(p, state.tstate, b, model=exp.model, tr=exp.tr,
                                            pz=exp.pz)[0]
      grads[kernels_] = jax.jit(jax.grad(loss))(state.params, batch)
  rel = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a))),
                     grads['xla'], grads['pallas'])
  out['grad_rel_err'] = max(jax.tree.leaves(rel))
  with open(out_path, 'w') as f:
    json.dump(out, f)


@pytest.fixture(scope='module')
def eight(tmp_path_factory, repo_root, subprocess_env):
  out = tmp_path_factory.mktemp('lowering') / 'out.json'
  env = dict(subprocess_env, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  res = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                       text=True, timeout=600, cwd=repo_root)
  assert res.returncode == 0, res.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize('program, platform, name', MESH_CASES)
def test_lowers_on_an_8_device_mesh_with_kernels_per_shard(eight, program, platform, name):
  row = eight['lowered'][f'{program} {platform} {name}']
  assert row['error'] is None, row['error']
  assert row['devices'] == 8
  missing = [k for k in EXPECTED[program][platform] if not row['kernels'].get(k)]
  assert not missing, f'no {missing} among {row["kernels"]}'
  assert row['per_shard'], 'the kernels should run per shard (jax.shard_map)'
  assert not row['stray_f32'], row['stray_f32']


@pytest.mark.slow
def test_kernels_per_shard_give_the_xla_paths_gradients(eight):
  # float32, cycle plan, data x fsdp x tensor: the partial gain gradients of the norm kernel
  # are summed over the mesh by shard_map's transpose.
  assert eight['grad_rel_err'] < 1e-4, eight['grad_rel_err']


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import conftest  # the suite's compilation cache and flags, and its plain helpers
  _worker(conftest.make_tiny_config, sys.argv[1])


EXPERTS = {**CONFIGS['cycle'], 'model.moe.kind': 'sigma_moe', 'model.moe.num_experts': 4,
           'model.moe.top_k': 2, 'model.moe.expert_dim': 64, 'model.moe.attention': 'switchhead',
           'model.moe.attention_experts': 2, 'model.moe.attention_top_k': 1}


@pytest.mark.slow
@pytest.mark.parametrize('platform', PLATFORMS)
def test_experts_dispatch_through_ragged_dot(tiny_config, platform):
  """model.moe.dispatch=auto on TPU / GPU: sigma-MoE and SwitchHead's train step (forward and
  backward, bfloat16 with the Pallas kernels) lowers with its grouped matmuls as XLA's
  ragged_dot (jax.lax.ragged_dot, the maintained grouped matmul those compilers implement),
  not as the CPU's sorted-block reference."""
  c = tiny_config(**SMALL, **EXPERTS, **{'model.kernels': 'pallas', 'model.dtype': 'bfloat16'})
  exported = lower(train_program(c), platform)
  check(exported, platform, 'train', 'bfloat16')
  text = exported.mlir_module()
  # 3 grouped matmuls forward (experts' up and down, SwitchHead's values and outputs), more back
  assert text.count('ragged_dot') >= 8, text.count('ragged_dot')
