"""SwitchHead attention (model.moe.attention, sharenet/models/switchhead.py): one expert against
plain attention, top-k against a numpy restatement, cached decoding, tying, accounting, bad
input."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.train import experiment
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, accounting, init_variables, param_table
from sharenet.models.attention import CausalAttention
from sharenet.models.config import ModelConfig

BASE = dict(d_model=16, num_heads=2, mlp_dim=32, num_layers=2, vocab_size=32, mlp='gelu',
            position='none', dtype='float64', param_dtype='float64')
T = 6


def _cfg(E=4, k=2, **kw):
  moe = {'attention': 'switchhead', 'attention_experts': E, 'attention_top_k': k,
         **kw.pop('moe', {})}
  return ModelConfig(**{**BASE, **kw}, moe=moe)


@functools.lru_cache(maxsize=None)
def _apply(cfg):
  return jax.jit(CausalAttention(cfg).apply)


def _attn(cfg, params, x_BTD):
  return _apply(cfg)({'params': params}, x_BTD, jnp.arange(T))


def _init(cfg, x_BTD, seed=0):
  boxed = jax.jit(CausalAttention(cfg).init)(jax.random.key(seed), x_BTD, jnp.arange(T))
  return jax.tree.map(lambda b: b.value, boxed['params'], is_leaf=lambda b: hasattr(b, 'value'))


@pytest.fixture(scope='module')
def x_BTD():
  with jax.enable_x64(True):
    yield jax.random.normal(jax.random.key(1), (2, T, 16), jnp.float64)


@pytest.mark.slow
def test_one_expert_is_plain_attention_with_a_sigmoid_output_gate(x_BTD):
  """E = 1, k = 1 (the reference's special case): value and output projections of the plain
  module's weights, each head's output gated by sigmoid(x W_sel,h). Zero selector: exactly half
  the plain attention; any selector: sum_h gate_h x the plain module restricted to head h."""
  with jax.enable_x64(True):
    plain = ModelConfig(**BASE)
    p = _init(plain, x_BTD)
    want = _attn(plain, p, x_BTD)
    sh = {'q': p['q'], 'k': p['k'], 'v_experts': p['v']['kernel'][None],
          'o_experts': p['o']['kernel'][None], 'o_router': jnp.zeros((1, 16, 2))}
    assert jax.tree.structure(sh) == jax.tree.structure(_init(_cfg(1, 1), x_BTD))
    np.testing.assert_allclose(np.asarray(_attn(_cfg(1, 1), sh, x_BTD)), 0.5 * np.asarray(want),
                               rtol=1e-12, atol=1e-14)
    w_DH = jax.random.normal(jax.random.key(2), (16, 2), jnp.float64)
    gate_BTH = jax.nn.sigmoid(x_BTD @ w_DH)
    got = _attn(_cfg(1, 1), {**sh, 'o_router': w_DH[None]}, x_BTD)
    restricted = 0.0
    for h in range(2):
      o_h = p['o']['kernel'] * (jnp.arange(2) == h)[:, None, None]
      restricted += gate_BTH[..., h:h + 1] * _attn(plain, {**p, 'o': {'kernel': o_h}}, x_BTD)
    np.testing.assert_allclose(np.asarray(got), np.asarray(restricted), rtol=1e-10, atol=1e-13)


def _numpy_switchhead(p, x_BTD, k):
  """SwitchHead restated densely in numpy: every (head, expert) product formed, the top-k
  sigmoid scores of each head weighting them, causal softmax attention with 1/sqrt(Dh)."""
  x = np.asarray(x_BTD)
  sel = lambda w: 1 / (1 + np.exp(-np.einsum('btd,edh->bthe', x, np.asarray(w))))

  def gates(w):
    s = sel(w)
    kth = -np.sort(-s, axis=-1)[..., k - 1:k]
    return np.where(s >= kth, s, 0.0)
  q = np.einsum('btd,dhk->bthk', x, np.asarray(p['q']['kernel']))
  kk = np.einsum('btd,dhk->bthk', x, np.asarray(p['k']['kernel']))
  v = np.einsum('btd,edhk,bthe->bthk', x, np.asarray(p['v_experts']), gates(p['v_router']))
  logits = np.einsum('bthk,bshk->bhts', q, kk) / np.sqrt(q.shape[-1])
  logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
  a = np.exp(logits - logits.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  heads = np.einsum('bhts,bshk->bthk', a, v)
  return np.einsum('bthk,ehko,bthe->bto', heads, np.asarray(p['o_experts']), gates(p['o_router']))


@pytest.mark.parametrize('dispatch', ['reference', 'ragged_dot'])
def test_top_k_experts_match_numpy(dispatch, x_BTD):
  """E = 4, k = 2, both grouped matmuls: the module's output is the numpy restatement's (to the
  attention core's float32 logits and softmax; a wrong selection is off by O(1))."""
  with jax.enable_x64(True):
    cfg = _cfg(4, 2, moe={'dispatch': dispatch})
    p = _init(cfg, x_BTD, seed=3)
    np.testing.assert_allclose(np.asarray(_attn(cfg, p, x_BTD)), _numpy_switchhead(p, x_BTD, 2),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_cached_generation_equals_full_forward(greedy_is_full_forward_argmax):
  """The cache holds the value experts' output; greedy cached decoding picks the full
  forward's argmax (RoPE on, float32, grouped-query heads)."""
  cfg = _cfg(4, 2, position='rope', num_heads=4, num_kv_heads=2, dtype='float32',
             param_dtype='float32', moe={'dispatch': 'ragged_dot'})   # compiles fastest
  model = DecoderLM(cfg)
  greedy_is_full_forward_argmax(model, init_variables(model, jax.random.key(3)), [5, 17, 2], 4)


@pytest.mark.slow
def test_tied_switchhead_experts_get_the_summed_gradient():
  """A universal block applied twice: its expert and selector gradients are the sums of the two
  uses' in an untied copy holding the same weights in both layers."""
  with jax.enable_x64(True):
    fast = {'dispatch': 'ragged_dot'}   # the two dispatches agree: test_top_k_experts_match_numpy
    tied = _cfg(sharing={'scheme': 'universal', 'num_unique': 1}, moe=fast)
    untied = _cfg(sharing={'scheme': 'untied', 'num_unique': 0}, moe=fast)
    v = init_variables(DecoderLM(tied), jax.random.key(0))
    stack = jax.tree.map(lambda a: jnp.concatenate([a, a]), v['params']['stack'])
    v2 = {**v, 'params': {**v['params'], 'stack': stack}}
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 9)))

    def grad(model, variables):
      def f(variables):
        logits = model.apply(variables, toks[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))
      return jax.jit(jax.grad(f))(variables)['params']['stack']
    g_tied, g_untied = grad(DecoderLM(tied), v), grad(DecoderLM(untied), v2)
    leaves = jax.tree_util.tree_leaves_with_path(g_tied)
    names = {jax.tree_util.keystr(p).split("'")[-2] for p, _ in leaves}
    assert {'v_experts', 'o_experts', 'v_router', 'o_router'} <= names
    for (path, a), b in zip(leaves, jax.tree.leaves(g_untied)):
      np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b.sum(0)), rtol=1e-8, atol=1e-12,
                                 err_msg=jax.tree_util.keystr(path))
      assert float(jnp.abs(a).sum()) > 0, jax.tree_util.keystr(path)


def test_roles_and_accounting():
  """Expert stacks are readers / writers of their own fan-in, selectors routers; FLOPs count
  the top-k experts per head, every selector row; parameters every stored expert."""
  cfg = _cfg(4, 2, dtype='float32', param_dtype='float32')
  table = {p[-1]: i for p, i in param_table(cfg).items() if 'attn' in p and 'experts' in i.axes}
  assert {n: (i.role, i.fan_in) for n, i in table.items()} == {
      'v_experts': ('reader', 16), 'o_experts': ('writer', 16), 'v_router': ('router', 16),
      'o_router': ('router', 16)}
  qk, mlp, one = 2 * 16 * 16, 2 * 16 * 32, 16 * 16
  assert accounting.matmul_params_per_layer(cfg) == qk + mlp + 2 * 2 * one + 2 * 4 * 16 * 2
  assert accounting.matmul_params_per_layer(_cfg(1, 1)) == qk + mlp + 2 * one + 16 * 2
  shapes = lambda c: jax.eval_shape(lambda: init_variables(DecoderLM(c), jax.random.key(0)))
  v = shapes(cfg)
  dense = shapes(ModelConfig(**{**BASE, 'dtype': 'float32', 'param_dtype': 'float32'}))
  stored = 2 * (3 * 2 * one + 2 * 4 * 16 * 2)   # per layer: 4 - 1 copies of v and o, selectors
  assert accounting.params_unique(v) - accounting.params_unique(dense) == stored


@pytest.mark.parametrize('overrides, words', [
    ({'model.attention_sharing': 'kv_shared'},   # the compatibility table's line (compat.py)
     ['model.attention_sharing=kv_shared', 'value experts', 'valid: either one without']),
    ({'model.moe.attention_top_k': 3, 'model.moe.attention_experts': 2},
     ['attention_top_k=3', 'valid: attention_experts >= 1 and attention_top_k in 1..2']),
    ({'model.sharing.lora_rank': 2, 'model.sharing.lora_targets': 'q,v',
      'model.sharing.scheme': 'universal', 'model.sharing.num_unique': 1},
     ['lora_rank=2', 'v and o experts', 'valid: either one without']),
    ({'model.masa.atoms': 2, 'model.masa.targets': 'o'},
     ['masa.atoms=2', 'v and o experts', 'valid: either one without']),
    ({'parametrization.kind': 'umup'}, ['kind=umup', 'valid: either one without']),
    ({'model.moe.dispatch': 'gmm'}, ['valid: auto, ragged_dot, reference']),
])
def test_bad_input_is_one_line(overrides, words, tiny_config):
  c = tiny_config(**{'model.moe.attention': 'switchhead', **overrides})
  with pytest.raises(ConfigError) as e:
    experiment.validate(c)
  assert '\n' not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_expert_axis_must_divide_attention_experts(tiny_config):
  from sharenet.train import sharding
  c = tiny_config(**{'model.moe.attention': 'switchhead', 'model.moe.attention_experts': 6,
                     'mesh.expert': 4, 'mesh.data': 2, 'train.batch_size': 8,
                     'train.eval_batch_size': 8})
  with pytest.raises(ConfigError) as e:
    sharding.validate(experiment.sections(c), 8)
  assert '\n' not in str(e.value) and 'model.moe.attention_experts=6' in str(e.value) and \
      'valid: mesh.expert among the divisors [1, 2, 3, 6]' in str(e.value)
  c.model.moe.attention_experts = 8
  sharding.validate(experiment.sections(c), 8)


def _numpy_entropy_reg(logits_BTE):
  """MoEUT's entropy_reg restated: per sequence the mean softmax over its tokens, sum p log p,
  averaged over sequences."""
  p = np.exp(logits_BTE - logits_BTE.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  pbar = p.mean(1)
  return np.mean(np.sum(pbar * np.log(pbar), -1))


def _rms(x, g):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _dense_sigma(p, x_ND, sel_ND, k):
  """sigma-MoE restated densely: experts run on x, their top-k sigmoid gates from sel."""
  logits = sel_ND @ np.asarray(p['router_kernel']).T
  kth = -np.sort(-logits, axis=-1)[:, k - 1:k]
  gates = np.where(logits >= kth, 1 / (1 + np.exp(-logits)), 0.0)
  h = np.maximum(np.einsum('nd,edf->nef', x_ND, np.asarray(p['wi_kernel'])), 0)
  return np.einsum('nef,efd,ne->nd', h, np.asarray(p['wo_kernel']), gates)


def test_moeut_norm_placement_and_selection_entropy_match_numpy(x_BTD):
  """model.norm.placement=moeut (MoEUT's peri-layernorm, as moeut.py MoEUTLayer): one block of
  SwitchHead attention and a sigma-MoE feed-forward restated in numpy: queries, keys and both
  attention selectors read RMSNorm_a(x), the value experts the raw x; the experts read the raw
  x1 = x + attention, their selector RMSNorm_m(x1). The carried aux loss is the feed-forward's
  entropy term plus attention_entropy_reg x (the value and the output selectors' negative
  entropies per (sequence, head))."""
  from sharenet.models.block import Block, Shared, Stream
  with jax.enable_x64(True):
    cfg = _cfg(3, 2, moe={'kind': 'sigma_moe', 'num_experts': 4, 'top_k': 2, 'expert_dim': 8,
                          'attention_entropy_reg': 0.003, 'entropy_reg': 0.02,
                          'dispatch': 'ragged_dot'},
               norm={'placement': 'moeut'}, sharing={'scheme': 'universal', 'num_unique': 1},
               num_layers=1)
    block = Block(cfg)
    carry = Stream(x_BTD, None, jnp.zeros((), jnp.float32))
    boxed = jax.jit(block.init)(jax.random.key(4), carry, Shared(jnp.arange(T)))
    v = jax.tree.map(lambda b: b.value, boxed, is_leaf=lambda b: hasattr(b, 'value'))
    p = v['params']
    g_a = 1 + 0.3 * np.random.default_rng(0).normal(size=16)   # gains off 1: a wrong read shows
    g_m = 1 + 0.3 * np.random.default_rng(1).normal(size=16)
    p = {**p, 'attn_norm': {'scale': jnp.asarray(g_a)}, 'mlp_norm': {'scale': jnp.asarray(g_m)}}
    out, _ = jax.jit(block.apply)({'params': p}, carry, Shared(jnp.arange(T)))
    x = np.asarray(x_BTD)
    h = _rms(x, g_a)
    a = p['attn']
    sel = lambda w: 1 / (1 + np.exp(-np.einsum('btd,edh->bthe', h, np.asarray(w))))

    def gates(w):
      s = sel(w)
      kth = -np.sort(-s, axis=-1)[..., 1:2]
      return np.where(s >= kth, s, 0.0)
    q = np.einsum('btd,dhk->bthk', h, np.asarray(a['q']['kernel']))
    kk = np.einsum('btd,dhk->bthk', h, np.asarray(a['k']['kernel']))
    vv = np.einsum('btd,edhk,bthe->bthk', x, np.asarray(a['v_experts']), gates(a['v_router']))
    logits = np.einsum('bthk,bshk->bhts', q, kk) / np.sqrt(q.shape[-1])
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    heads = np.einsum('bhts,bshk->bthk', w, vv)
    x1 = x + np.einsum('bthk,ehko,bthe->bto', heads, np.asarray(a['o_experts']),
                       gates(a['o_router']))
    ffn = _dense_sigma(p['moe'], x1.reshape(-1, 16), _rms(x1, g_m).reshape(-1, 16), 2)
    want = x1 + ffn.reshape(x1.shape)
    np.testing.assert_allclose(np.asarray(out.x_BTD), want, rtol=1e-5, atol=1e-6)

    per_head = lambda w: np.einsum('btd,edh->bhte', h, np.asarray(w)).reshape(-1, T, 3)
    attn_reg = sum(_numpy_entropy_reg(per_head(a[n])) for n in ('v_router', 'o_router'))
    ffn_logits = (_rms(x1, g_m) @ np.asarray(p['moe']['router_kernel']).T)
    want_aux = 0.003 * attn_reg + 0.02 * _numpy_entropy_reg(ffn_logits)
    assert attn_reg < 0 and float(out.aux) == pytest.approx(want_aux, rel=1e-5)


def test_moeut_placement_norms_only_what_selects():
  """A dense MoEUT-norm block stores the attention norm only (x + MLP(x) reads no norm);
  the aux loss is there only with more than one attention expert and a coefficient."""
  names = lambda c: {p[-2] for p in param_table(c) if p[-1] == 'scale'}
  dense = ModelConfig(**BASE, norm={'placement': 'moeut'})
  assert names(dense) == {'attn_norm', 'final_norm'}
  assert names(ModelConfig(**BASE)) == {'attn_norm', 'mlp_norm', 'final_norm'}
  assert _cfg(4, 2).moe.aux and not _cfg(1, 1).moe.aux
  assert not _cfg(4, 2, moe={'attention_entropy_reg': 0.0}).moe.aux


@pytest.mark.parametrize('sharing', ['kv_shared', 'qkv_shared'])
def test_moeut_placement_refuses_values_that_are_keys(sharing):
  with pytest.raises(ConfigError) as e:
    ModelConfig(**BASE, attention_sharing=sharing, norm={'placement': 'moeut'})
  assert '\n' not in str(e.value) and 'MoEUT norms read the values un-normalised' in str(e.value)
