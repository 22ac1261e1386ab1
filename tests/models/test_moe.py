"""Experts in the feed-forward's place (model.moe, sharenet/models/moe.py): sigma-MoE and Switch
against dense / numpy restatements, both dispatches, tying, accounting, bad input, training."""
import json
import math
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.train import experiment, sharding
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, accounting, init_variables, param_table
from sharenet.models import moe
from sharenet.models.config import ModelConfig

BASE = dict(d_model=16, num_heads=2, mlp_dim=32, num_layers=2, vocab_size=32, mlp='gelu',
            dtype='float64', param_dtype='float64')


def _cfg(kind='sigma_moe', E=4, k=2, F=8, **kw):
  moe_keys = dict(kind=kind, num_experts=E, top_k=k, expert_dim=F, **kw.pop('moe', {}))
  return ModelConfig(**{**BASE, **kw}, moe=moe_keys)


def _ffn(cfg, x_BTD, seed=0):
  """(output, aux, the block's expert params) of one MoeFfn on x."""
  module = moe.MoeFfn(cfg)
  variables = jax.jit(lambda key: jax.tree.map(
      lambda b: b.value, module.init(key, x_BTD),
      is_leaf=lambda b: hasattr(b, 'value')))(jax.random.key(seed))
  out, aux = jax.jit(module.apply)(variables, x_BTD)
  return out, aux, variables['params']


@pytest.fixture(scope='module')
def x_BTD():
  with jax.enable_x64(True):
    yield jax.random.normal(jax.random.key(1), (2, 5, 16), jnp.float64)


def _dense_sigma(p, x_BTD, k):
  """sigma-MoE restated densely: every expert run, gates sigmoid(logit) on the top-k, else 0."""
  x = np.asarray(x_BTD).reshape(-1, x_BTD.shape[-1])
  logits = x @ np.asarray(p['router_kernel']).T
  kth = -np.sort(-logits, axis=-1)[:, k - 1:k]
  gates = np.where(logits >= kth, 1 / (1 + np.exp(-logits)), 0.0)
  h = np.maximum(np.einsum('nd,edf->nef', x, np.asarray(p['wi_kernel'])), 0)
  y = np.einsum('nef,efd,ne->nd', h, np.asarray(p['wo_kernel']), gates)
  return y.reshape(x_BTD.shape)


@pytest.mark.parametrize('dispatch', ['reference', 'ragged_dot'])
@pytest.mark.parametrize('k', [4, 2])
def test_sigma_moe_equals_dense_reference(k, dispatch, x_BTD):
  """top_k = num_experts is the dense mixture of every expert; top_k = 2 its top-2 part."""
  with jax.enable_x64(True):
    out, _, p = _ffn(_cfg(k=k, moe={'dispatch': dispatch}), x_BTD)
    np.testing.assert_allclose(np.asarray(out), _dense_sigma(p, x_BTD, k), rtol=1e-10,
                               atol=1e-12)


def test_dispatches_agree_in_value_and_gradient(x_BTD):
  """The row-block reference and jax.lax.ragged_dot: same outputs and parameter gradients
  (switch with SwiGLU experts and dropped tokens, capacity_factor 0.5)."""
  with jax.enable_x64(True):
    grads = {}
    for dispatch in ('reference', 'ragged_dot'):
      cfg = _cfg('switch', k=1, mlp='swiglu', moe={'dispatch': dispatch, 'capacity_factor': 0.5})
      _, _, p = _ffn(cfg, x_BTD)
      f = lambda p: jnp.sum(jnp.sin(moe.MoeFfn(cfg).apply({'params': p}, x_BTD)[0]))
      grads[dispatch] = jax.jit(jax.value_and_grad(f))(p)
    (v0, g0), (v1, g1) = grads['reference'], grads['ragged_dot']
    assert abs(float(v0) - float(v1)) < 1e-10
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-12)
    assert float(jnp.abs(g0['wo_kernel']).sum()) > 0


def test_blocked_matmul_pads_each_group():
  """Groups of 0, 1, a block and a block + 1 rows: each row times its group's matrix."""
  rng = np.random.default_rng(0)
  sizes = np.array([0, 1, 4, 5])
  x, w = rng.normal(size=(10, 3)), rng.normal(size=(4, 3, 2))
  group = np.repeat(np.arange(4), sizes)
  want = np.einsum('md,mdf->mf', x, w[group])
  got = moe.blocked_matmul(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                           jnp.asarray(sizes), block=4)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_entropy_regularizer_matches_numpy():
  """sum_e pbar_e log pbar_e per sequence (pbar: the mean softmax over its tokens), averaged."""
  logits = np.random.default_rng(0).normal(size=(3, 7, 5)) * 2
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  pbar = p.mean(1)
  want = np.mean(np.sum(pbar * np.log(pbar), -1))
  assert float(moe.entropy_reg(jnp.asarray(logits))) == pytest.approx(want, rel=1e-5)
  assert want < 0 and want > -math.log(5)   # -H, between -log E and 0


def test_switch_capacity_drops_and_balance_match_numpy():
  """Token order fills each expert to ceil(cf N / E); the rest get gate 0. E sum f_i P_i."""
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(12, 3)) + np.array([2.0, 0, 0])   # expert 0 over-subscribed
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  C = math.ceil(0.75 * 12 / 3)
  seen, kept = [0, 0, 0], []
  for e in p.argmax(-1):
    kept.append(seen[e] < C)
    seen[e] += 1
  experts, gates, got_kept = moe.switch_select(jnp.asarray(logits, jnp.float32), 0.75)
  assert list(np.asarray(got_kept)) == kept and not all(kept)
  np.testing.assert_allclose(np.asarray(gates)[:, 0], p.max(-1) * np.array(kept), rtol=1e-5)
  f = np.bincount(p.argmax(-1), minlength=3) / 12
  want = 3 * np.sum(f * p.mean(0))
  assert float(moe.balance_loss(jnp.asarray(logits))) == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_tied_experts_get_the_summed_gradient():
  """A universal block applied twice: its experts' gradient is the sum of the two uses' in an
  untied copy holding the same weights in both layers."""
  with jax.enable_x64(True):
    tied = _cfg(sharing={'scheme': 'universal', 'num_unique': 1})
    untied = _cfg(sharing={'scheme': 'untied', 'num_unique': 0})
    v = init_variables(DecoderLM(tied), jax.random.key(0))
    stack = jax.tree.map(lambda a: jnp.concatenate([a, a]), v['params']['stack'])
    v2 = {**v, 'params': {**v['params'], 'stack': stack}}
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 9)))

    def nll(model):
      def f(variables):
        logits = model.apply(variables, toks[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))
      return jax.jit(jax.grad(f))
    g_tied = nll(DecoderLM(tied))(v)['params']['stack']
    g_untied = nll(DecoderLM(untied))(v2)['params']['stack']
    leaves = jax.tree_util.tree_leaves_with_path(g_tied)
    assert any('wi_kernel' in jax.tree_util.keystr(p) for p, _ in leaves)
    for (path, a), b in zip(leaves, jax.tree.leaves(g_untied)):
      np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b.sum(0)), rtol=1e-8, atol=1e-12,
                                 err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_per_layer_routers_are_the_tied_model_with_each_layers_own_selector():
  """model.moe.router_per_layer on a universal block applied twice: the selector is a per-layer
  part (one per applied layer) and the experts stay tied. With both layers' selectors equal to
  the tied model's, the logits are the tied model's; with layer 1's changed, they are an untied
  model's holding the tied experts in both layers and each layer's own selector; the stored
  count grows by one selector; each layer's selector gets only its own use's gradient."""
  with jax.enable_x64(True):
    shared = _cfg(sharing={'scheme': 'universal', 'num_unique': 1})
    per = _cfg(sharing={'scheme': 'universal', 'num_unique': 1}, moe={'router_per_layer': True})
    untied = _cfg(sharing={'scheme': 'untied', 'num_unique': 0})
    table = param_table(per)
    router = [i for i in table.values() if i.role == 'router']
    assert len(router) == 1 and router[0].path[0] == 'per_layer' and router[0].layers == (0, 1)
    v = init_variables(DecoderLM(shared), jax.random.key(0))
    w = np.asarray(v['params']['stack']['segment_0']['level']['block']['moe']['router_kernel'])
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 9)))
    pv = init_variables(DecoderLM(per), jax.random.key(0))
    assert accounting.params_unique(pv) - accounting.params_unique(v) == w[0].size
    params = jax.tree.map(lambda a: a, v['params'])
    del params['stack']['segment_0']['level']['block']['moe']['router_kernel']
    other = np.random.default_rng(1).normal(0, 0.25, w.shape[1:])
    for sel, want_tied in ((np.stack([w[0], w[0]]), True), (np.stack([w[0], other]), False)):
      per_layer = {'stack': {'segment_0': {'level': {'block': {'moe': {
          'router_kernel': jnp.asarray(sel).reshape(router[0].shape)}}}}}}
      got = DecoderLM(per).apply({'params': params, 'per_layer': per_layer}, toks)
      if want_tied:
        np.testing.assert_allclose(got, DecoderLM(shared).apply(v, toks), rtol=1e-10)
        continue
      stack = jax.tree.map(lambda a: jnp.concatenate([a, a]), v['params']['stack'])
      stack['segment_0']['level']['block']['moe']['router_kernel'] = jnp.asarray(sel)
      ref = DecoderLM(untied).apply({'params': {**v['params'], 'stack': stack}}, toks)
      np.testing.assert_allclose(got, ref, rtol=1e-10)
      assert np.abs(np.asarray(got) - np.asarray(DecoderLM(shared).apply(v, toks))).max() > 1e-6

      def nll(p):
        logits = DecoderLM(per).apply({'params': params, 'per_layer': p}, toks[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))
      g = jax.grad(nll)(per_layer)['stack']['segment_0']['level']['block']['moe']
      g = np.asarray(g['router_kernel']).reshape((2,) + w.shape[1:])
      assert not np.allclose(g[0], g[1], atol=1e-12)


@pytest.mark.slow
def test_roles_and_accounting():
  """Experts are reader / writer stacks of their own fan-in, the selector a router; FLOPs count
  the top_k experts run, parameters every stored expert."""
  cfg = _cfg(E=4, k=2, F=8)
  table = {p[-1]: i for p, i in param_table(cfg).items() if 'moe' in p}
  assert {n: (i.role, i.fan_in) for n, i in table.items()} == {
      'router_kernel': ('router', 16), 'wi_kernel': ('reader', 16), 'wo_kernel': ('writer', 8)}
  one = accounting.matmul_params_per_layer(cfg)
  attn = 4 * 16 * 16
  assert one == attn + 2 * 2 * 16 * 8 + 4 * 16     # top-2 of 4 experts, all 4 selector rows
  top1 = accounting.matmul_params_per_layer(_cfg(E=4, k=1, F=8))
  assert one - top1 == 2 * 16 * 8
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  dense = init_variables(DecoderLM(ModelConfig(**BASE)), jax.random.key(0))
  stored = 2 * (4 * 2 * 16 * 8 + 4 * 16 - 2 * 16 * 32)   # per layer: experts + selector - MLP
  assert accounting.params_unique(v) - accounting.params_unique(dense) == stored


@pytest.mark.parametrize('overrides, words', [
    ({'model.moe.kind': 'sigma_moe', 'model.moe.top_k': 9}, ['top_k=9', 'valid: 1..8']),
    ({'model.moe.kind': 'switch', 'model.moe.top_k': 2}, ['top_k=2', 'valid: 0 or 1']),
    ({'model.moe.kind': 'bogus'}, ['valid: none, sigma_moe, switch']),
    ({'model.moe.lora_experts': 2, 'model.sharing.scheme': 'universal',
      'model.sharing.num_unique': 1}, ['lora_experts=2', 'valid: lora_rank >= 1']),
    ({'model.moe.router_per_layer': True}, ['router_per_layer=True', 'model.moe.kind=none',
                                            'valid: model.moe.kind in sigma_moe, switch']),
    ({'model.moe.kind': 'sigma_moe', 'model.moe.dispatch': 'gmm'},
     ['valid: auto, ragged_dot, reference']),
    ({'model.moe.kind': 'sigma_moe', 'model.sharing.lora_rank': 2,
      'model.sharing.lora_targets': 'q,mlp_in', 'model.sharing.scheme': 'universal',
      'model.sharing.num_unique': 1}, ['mlp_in', 'valid: targets among q,k,v,o']),
])
def test_bad_input_is_one_line(overrides, words, tiny_config):
  with pytest.raises(ConfigError) as e:
    experiment.validate(tiny_config(**overrides))
  assert '\n' not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_expert_axis_must_divide_num_experts(tiny_config):
  c = tiny_config(**{'model.moe.kind': 'sigma_moe', 'model.moe.num_experts': 6,
                     'mesh.expert': 4, 'mesh.data': 2, 'train.batch_size': 8,
                     'train.eval_batch_size': 8})
  with pytest.raises(ConfigError) as e:
    sharding.validate(experiment.sections(c), 8)
  assert '\n' not in str(e.value) and 'valid: mesh.expert among the divisors [1, 2, 3, 6]' in \
      str(e.value)
  c.model.moe.num_experts = 8
  sharding.validate(experiment.sections(c), 8)


@pytest.mark.slow
def test_cached_generation_equals_full_forward(greedy_is_full_forward_argmax):
  """sigma-MoE is per token: greedy cached decoding picks the full forward's argmax."""
  cfg = ModelConfig(**{**BASE, 'dtype': 'float32', 'param_dtype': 'float32'},
                    moe={'kind': 'sigma_moe', 'num_experts': 4, 'top_k': 2, 'expert_dim': 8})
  model = DecoderLM(cfg)
  greedy_is_full_forward_argmax(model, init_variables(model, jax.random.key(3)), [5, 17, 2], 4)


@pytest.mark.slow
def test_cli_train_with_experts(tmp_path, train_cmd, subprocess_env):
  """train.py with sigma-MoE: the loss falls, the train rows report the aux loss, which
  eval_loss does not hold."""
  res = subprocess.run(train_cmd(tmp_path, '--config.model.moe.kind=sigma_moe',
                                 '--config.model.moe.num_experts=4', '--config.train.steps=6',
                                 '--config.train.log_every=1', '--config.train.progress=False'),
                       env=dict(subprocess_env), capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  train = [r for r in rows if 'loss' in r]
  assert all('moe_aux_loss' in r and r['moe_aux_loss'] < 0 for r in train)
  assert train[-1]['loss'] < train[0]['loss']
  assert np.isfinite(out['eval_loss'])
  config = json.load(open(tmp_path / 'config.json'))
  assert config['model']['moe']['kind'] == 'sigma_moe'


@pytest.mark.slow
def test_coord_check_sigma_moe_universal():
  """A universal sigma-MoE model (one stored set of 4 experts applied twice), widths 32-128:
  under mup the residual stream and attention output are flat in width and the experts' output
  does not grow (experts hidden matrices of their own fan-in, the selector an output weight);
  under sp the residual stream grows (the negative control). Measured (2026-12-03): mup
  residual slopes -0.07..0.01, attn_out <= 0.05, mlp_out -0.28..-0.08 (a shrinking transient:
  the selector's logits start at O(1/sqrt(width)) as an output weight's do, so the gates start
  near sigmoid(0) at large width and grow to O(1) in the first updates)."""
  from configs.mup import coord_check as cc_config
  from sharenet.studies import coord_check
  c = cc_config.get_config()
  c.model.num_layers, c.train.batch_size, c.train.seq_len = 2, 4, 16
  c.model.sharing.scheme, c.model.sharing.num_unique = 'universal', 1
  c.model.moe.kind, c.model.moe.num_experts, c.model.moe.top_k = 'sigma_moe', 4, 2
  s = c.study
  s.steps, s.seeds, s.width_values, s.width_variants = 3, 1, '32,64,128', 'sp,mup'
  res = coord_check.run_axis(c, 'width', log=lambda m: None)
  worst = coord_check.summary(res)
  for a in ('residual', 'attn_out', 'embed_out'):
    assert worst['mup'][a] < 0.15, (a, worst['mup'])
  mlp = res['variants']['mup']['slopes']['mlp_out'][1:]
  assert max(mlp) < 0.15 and min(mlp) > -0.4, mlp
  sp = res['variants']['sp']['slopes']
  assert max(sp['residual'][1:]) > 0.4 and max(sp['mlp_out'][1:]) > 0.4, sp
