"""Mixture of LoRAs (model.moe.lora_experts, sharenet/models/lora_experts.py) and its merge into
one depth-wise LoRA (sharenet/transforms/lora_merge.py)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.train import experiment
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, accounting, init_variables, param_table
from sharenet.models.config import ModelConfig
from sharenet.models.params import PER_LAYER
from sharenet.transforms.lora_merge import merge_lora_experts

BASE = dict(d_model=16, num_heads=2, mlp_dim=32, num_layers=4, vocab_size=32, mlp='gelu',
            dtype='float64', param_dtype='float64')
SHARING = dict(scheme='middle_cycle', num_unique=3, lora_rank=2,
               lora_targets='q,mlp_in,mlp_out')
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 7)))


def _cfg(N=3, **kw):
  return ModelConfig(**BASE, sharing={**SHARING, **kw}, moe={'lora_experts': N})


def _init(cfg):
  return jax.jit(lambda key: init_variables(DecoderLM(cfg), key))(jax.random.key(0))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _randomized(variables, seed, zero_router):
  """Every LoRA factor random (B starts at zero), the routers zero if `zero_router`: equal
  logits, so every token picks expert 0 (argmax's first)."""
  flat = flatten_dict(variables)
  keys = jax.random.split(jax.random.key(seed), len(flat))
  for key, (path, v) in zip(keys, sorted(flat.items())):
    if 'lora_router' in path and zero_router:
      flat[path] = jnp.zeros_like(v)
    elif 'lora' in path[-1] or 'lora_router' in path:
      flat[path] = 0.5 * jax.random.normal(key, v.shape, v.dtype)
  return unflatten_dict(flat)


@pytest.mark.slow
def test_merged_equals_routed_when_every_token_picks_one_expert():
  """Zero routers: every token runs expert 0 at gate 1, so merging with one_hot(0) is the same
  function; one_hot(1) is not, and neither is the routed model once its routers spread tokens."""
  with jax.enable_x64(True):
    cfg = _cfg()
    v = _randomized(_init(cfg), 1, zero_router=True)
    routed_apply = jax.jit(DecoderLM(cfg).apply)
    routed = routed_apply(v, TOKENS)
    mcfg, merged = merge_lora_experts(cfg, v, [1.0, 0.0, 0.0])
    assert mcfg.moe.lora_experts == 0 and mcfg.sharing.lora_rank == 2
    assert not any('lora_experts' in k or 'lora_router' in k
                   for p in flatten_dict(merged['params']) for k in p)
    apply = jax.jit(DecoderLM(mcfg).apply)
    np.testing.assert_allclose(np.asarray(apply(merged, TOKENS)), np.asarray(routed),
                               rtol=1e-9, atol=1e-10)
    _, other = merge_lora_experts(cfg, v, [0.0, 1.0, 0.0])
    assert float(jnp.max(jnp.abs(apply(other, TOKENS) - routed))) > 1e-3
    spread = _randomized(v, 2, zero_router=False)
    assert float(jnp.max(jnp.abs(routed_apply(spread, TOKENS) - routed))) > 1e-3


@pytest.mark.slow
def test_experts_are_tied_block_params_and_the_router_learns():
  """Experts and router sit in the tied block's params (the depth-wise q LoRA stays per layer);
  the straight-through gate gives the router a gradient; FLOPs count all N experts' factors."""
  with jax.enable_x64(True):
    cfg = _cfg()   # the merge test's model and variables: compiled programs are reused
    table = {p: i for p, i in param_table(cfg).items() if 'lora' in p[-1]}
    kinds = {(p[0], p[-1], i.role) for p, i in table.items()}
    assert ('params', 'lora_experts_a', 'lora') in kinds and ('params', 'lora_router', 'router') \
        in kinds and (PER_LAYER, 'lora_a', 'lora') in kinds
    assert not any(p[0] == PER_LAYER and 'mlp' in p for p in table)
    v = _randomized(_randomized(_init(cfg), 1, zero_router=True), 2, zero_router=False)

    def loss(params):
      logits = DecoderLM(cfg).apply({**v, 'params': params}, TOKENS[:, :-1])
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), TOKENS[:, 1:, None], -1))
    g = flatten_dict(jax.jit(jax.grad(loss))(v['params']))
    routers = [x for p, x in g.items() if p[-1] == 'lora_router']
    assert routers and all(float(jnp.abs(x).sum()) > 0 for x in routers)
    every = _cfg(lora_layers='all')   # accounting counts LoRA where every layer holds it
    plain = ModelConfig(**BASE, sharing={**SHARING, 'lora_layers': 'all'})
    per_token = 3 * 2 * (16 + 32) * 2 + 3 * 16 - 2 * 2 * (16 + 32)   # N experts, router, - LoRA
    assert accounting.matmul_params_per_layer(every) - \
        accounting.matmul_params_per_layer(plain) == per_token


@pytest.mark.parametrize('overrides, words', [
    ({'model.moe.lora_experts': 2, 'model.sharing.scheme': 'universal',
      'model.sharing.num_unique': 1}, ['lora_experts=2', 'valid: lora_rank >= 1']),
    ({'model.moe.lora_experts': 2, 'model.sharing.lora_rank': 2, 'model.sharing.scheme':
      'universal', 'model.sharing.num_unique': 1, 'model.sharing.lora_targets': 'q,v'},
     ['names no feed-forward kernel', 'valid: targets including mlp_in']),
    ({'model.moe.lora_experts': -1}, ['lora_experts=-1', 'must be >= 0']),
])
def test_bad_input_is_one_line(overrides, words, tiny_config):
  with pytest.raises(ConfigError) as e:
    experiment.validate(tiny_config(**overrides))
  assert '\n' not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.slow
def test_convert_cli_merges_a_trained_run(tiny_config, tmp_path):
  """convert_workdir --config.to=merge_lora_experts: a trained Mixture-of-LoRAs run becomes a
  depth-wise LoRA run that evaluates; the weights must be N floats (one line otherwise)."""
  import json
  import os
  from sharenet.config import defaults
  from sharenet.train import loop
  from sharenet.main import convert_workdir, eval_workdir
  src, dst = str(tmp_path / 'src'), str(tmp_path / 'dst')
  loop.train_and_evaluate(tiny_config(**{
      'train.steps': 2, 'train.checkpoint_every': 2, 'model.sharing.scheme': 'universal',
      'model.sharing.num_unique': 1, 'model.sharing.lora_rank': 2,
      'model.sharing.lora_targets': 'mlp_in,mlp_out', 'model.moe.lora_experts': 2}), src)
  opts = defaults.conversion_config()
  opts.to, opts.expert_weights = 'merge_lora_experts', '1,0,0'
  with pytest.raises(ConfigError) as e:
    convert_workdir.convert_workdir(src, dst, opts)
  assert '\n' not in str(e.value) and 'valid: e.g. one-hot 1,0' in str(e.value)
  opts.expert_weights = '0.5,0.5'
  convert_workdir.convert_workdir(src, dst, opts)
  assert np.isfinite(eval_workdir.evaluate_workdir(dst)['eval_loss'])
  with open(os.path.join(dst, 'config.json')) as f:
    model = json.load(f)['model']
  assert model['moe']['lora_experts'] == 0 and model['sharing']['lora_rank'] == 2


def test_other_conversions_refuse_expert_parts(tmp_path):
  """Norm, recursive and head conversions do not know the expert parameters: one line."""
  import json
  from sharenet.config import defaults
  from sharenet.main import convert_workdir
  cfg = defaults.default_config()
  cfg.model.moe.attention = 'switchhead'
  with open(tmp_path / 'config.json', 'w') as f:
    json.dump(cfg.to_dict(), f)
  opts = defaults.conversion_config()
  opts.to = 'rmsnorm'
  with pytest.raises(ConfigError) as e:
    convert_workdir.convert_workdir(str(tmp_path), str(tmp_path / 'out'), opts)
  assert '\n' not in str(e.value) and 'does not know SwitchHead' in str(e.value)
