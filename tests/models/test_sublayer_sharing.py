"""Sub-layer weight sharing (docs/sharing.md): attention projection sharing
(model.attention_sharing, arXiv:2606.04032), MASA matrix atoms (model.masa.*, arXiv:2508.04581)
and the DirectShare head-sharing conversion (convert.py --config.to=head_shared,
arXiv:2402.11819), each against an independent construction."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models import scaling
from sharenet.checkpoint import orbax_io
from sharenet.train import experiment, resume, loop
from sharenet.config import defaults
from sharenet.inference import generate as gen
from sharenet.main import convert_workdir, eval_workdir
from sharenet.train import workdir_io
from sharenet.parametrization import rules as P
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.models import accounting
from sharenet.models.lm import init_cache
from sharenet.transforms import head_share


def _cfg(**kw):
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, mlp_dim=48, remat='none')
  return ModelConfig(**base).derive(**kw)


def _x64(**kw):
  return _cfg(dtype='float64', param_dtype='float64', **kw)


def _tokens(B=2, T=10, vocab=64, seed=7):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)


def _perturb(variables, scale=0.3, seed=3):
  """Every leaf moved off its init (norm gains off 1, zero-init parts non-zero)."""
  flat = flatten_dict(variables)
  keys = jax.random.split(jax.random.key(seed), len(flat))
  return unflatten_dict({p: x + scale * jax.random.normal(k, x.shape, x.dtype)
                         for (p, x), k in zip(sorted(flat.items()), keys)})


def _block(path):
  return tuple(path[path.index('block') + 1:]) if 'block' in path else None


# ---- attention_sharing ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('qk_norm', ['none', 'rms'])
@pytest.mark.parametrize('sharing', ['kv_shared', 'qk_shared', 'qkv_shared'])
def test_shared_projection_equals_none_model_with_tied_kernels(sharing, qk_norm):
  """A shared model computes exactly the `none` model whose missing kernels are copies of the
  key kernel (and, where the query is the key, whose q_norm gain is the k_norm gain)."""
  with jax.enable_x64(True):
    cfg = _x64(attention_sharing=sharing, norm=dict(qk_norm=qk_norm))
    ref_cfg = cfg.derive(attention_sharing='none')
    v = _perturb(init_variables(DecoderLM(cfg), jax.random.key(0)))
    flat = flatten_dict(v)
    ref = {}
    for p in flatten_dict(init_variables(DecoderLM(ref_cfg), jax.random.key(1))):
      src = p
      if p[-2] == 'v' and sharing in ('kv_shared', 'qkv_shared'):
        src = p[:-2] + ('k', p[-1])
      if p[-2] in ('q', 'q_norm') and sharing in ('qk_shared', 'qkv_shared'):
        src = p[:-2] + ('k' if p[-2] == 'q' else 'k_norm', p[-1])
      ref[p] = flat[src]
    toks = _tokens()
    out = DecoderLM(cfg).apply(v, toks)
    expected = DecoderLM(ref_cfg).apply(unflatten_dict(ref), toks)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    # and the shared model is not the none model with its own (independent) kernels
    own = _perturb(init_variables(DecoderLM(ref_cfg), jax.random.key(0)))
    assert float(jnp.max(jnp.abs(DecoderLM(ref_cfg).apply(own, toks) - out))) > 1e-3


@pytest.mark.slow
def test_stored_projections_and_param_counts():
  L, D, H, Dh = 2, 32, 2, 16
  none = _cfg()
  n0 = accounting.params_unique(init_variables(DecoderLM(none), jax.random.key(0)))
  per_kernel = L * D * H * Dh
  for sharing, kernels, saved in (('none', 'qkv', 0), ('kv_shared', 'qk', 1),
                                  ('qk_shared', 'kv', 1), ('qkv_shared', 'k', 2)):
    cfg = none.derive(attention_sharing=sharing)
    v = init_variables(DecoderLM(cfg), jax.random.key(0))
    stored = {p[-2] for p in flatten_dict(v['params']) if p[-1] == 'kernel' and 'attn' in p}
    assert stored == set(kernels) | {'o'}, sharing
    assert accounting.params_unique(v) == n0 - saved * per_kernel
    # FLOPs read the role table: one projection fewer per shared kernel
    assert (accounting.matmul_params_per_layer(cfg)
            == accounting.matmul_params_per_layer(none) - saved * D * H * Dh)


@pytest.mark.slow
@pytest.mark.parametrize('sharing', ['kv_shared', 'qkv_shared'])
def test_values_are_keys_cache_holds_k_only_and_decodes_like_a_full_forward(sharing):
  """The K-only cache (keys before QK-norm and RoPE, renormalised and rotated per step) gives
  the full forward's logits at every position, with left padding and a tied plan."""
  cfg = _cfg(attention_sharing=sharing, norm=dict(qk_norm='rms'),
             sharing=dict(scheme='cycle', num_unique=2), num_layers=4)
  model = DecoderLM(cfg)
  v = _perturb(init_variables(model, jax.random.key(0)), scale=0.1)
  cache = init_cache(cfg, 2, 12)
  assert all(c.v_BSKD is None for c in cache.layers)
  assert sum(c.k_BSKD.shape[0] for c in cache.layers) == 4
  toks = np.asarray(_tokens(B=2, T=10))
  full = np.asarray(model.apply(v, jnp.asarray(toks)))
  # sequence 1 is left-padded by 2 in the cached run: its token t sits at slot t + 2
  pad = 2
  prompt = np.zeros((2, 5 + pad), np.int32)
  pos = np.full((2, 5 + pad), -1, np.int32)
  prompt[0, :] = toks[0, :5 + pad]
  pos[0] = np.arange(5 + pad)
  prompt[1, pad:] = toks[1, :5]
  pos[1, pad:] = np.arange(5)
  logits, cache = model.apply(v, jnp.asarray(prompt), cache=cache, positions_BT=jnp.asarray(pos))
  np.testing.assert_allclose(np.asarray(logits)[0], full[0, :5 + pad], atol=2e-5)
  np.testing.assert_allclose(np.asarray(logits)[1, pad:], full[1, :5], atol=2e-5)
  assert all(c.v_BSKD is None for c in cache.layers)
  for t in range(2):   # one token per step
    tok = np.array([[toks[0, 5 + pad + t]], [toks[1, 5 + t]]], np.int32)
    p = np.array([[5 + pad + t], [5 + t]], np.int32)
    logits, cache = model.apply(v, jnp.asarray(tok), cache=cache, positions_BT=jnp.asarray(p))
    np.testing.assert_allclose(np.asarray(logits)[0, 0], full[0, 5 + pad + t], atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits)[1, 0], full[1, 5 + t], atol=2e-5)
  # generate.py's greedy decode equals argmax of full forwards on the growing sequence
  prompt = [3, 14, 15, 9]
  out = gen.generate(model, v, [prompt], 4, temperature=0.0).tokens[0]
  seq = list(prompt)
  for _ in range(4):
    seq.append(int(jnp.argmax(model.apply(v, jnp.asarray([seq]))[0, -1])))
  assert out == seq[len(prompt):]


@pytest.mark.parametrize('sharing', ['kv_shared', 'qkv_shared'])
def test_fused_attention_backend_agrees(sharing):
  """The Pallas attention kernel (interpret mode on CPU) gets the shared tensors as q / k / v."""
  cfg = _cfg(num_layers=1, attention_sharing=sharing, attention='xla')
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  toks = _tokens(B=1, T=16)
  ref = DecoderLM(cfg).apply(v, toks)
  out = DecoderLM(cfg.derive(attention='pallas')).apply(v, toks)
  np.testing.assert_allclose(out, ref, atol=1e-5)


# ---- MASA ------------------------------------------------------------------------------------

ALL_TARGETS = ('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out')
KERNEL_OF = {'q': ('attn', 'q'), 'k': ('attn', 'k'), 'v': ('attn', 'v'), 'o': ('attn', 'o'),
             'wi': ('mlp', 'wi'), 'wi_gate': ('mlp', 'wi_gate'), 'wi_up': ('mlp', 'wi_up'),
             'wo': ('mlp', 'wo')}


@pytest.mark.slow
def test_masa_one_hot_coefficients_equal_the_untied_model():
  """S = L atoms holding the untied model's kernels and one-hot coefficients c_l = e_l give
  exactly the untied model (every target; gelu MLP: one input kernel)."""
  with jax.enable_x64(True):
    L = 2
    ucfg = _x64(mlp='gelu')
    cfg = ucfg.derive(masa=dict(atoms=L, targets=ALL_TARGETS))
    u = _perturb(init_variables(DecoderLM(ucfg), jax.random.key(0)))
    m = flatten_dict(init_variables(DecoderLM(cfg), jax.random.key(1)))
    uflat = flatten_dict(u)
    for p in m:
      if p[:2] == ('params', 'masa'):
        (kp,) = [q for q in uflat if _block(q) == KERNEL_OF[p[2]] + ('kernel',)]
        m[p] = uflat[kp]                          # (L, ...) stacked kernels = the L atoms
      elif p[-1] == 'masa_coef':
        m[p] = jnp.eye(L, dtype=jnp.float64)      # set l: e_l
      else:
        m[p] = uflat[p]
    toks = _tokens()
    np.testing.assert_array_equal(np.asarray(DecoderLM(cfg).apply(unflatten_dict(m), toks)),
                                  np.asarray(DecoderLM(ucfg).apply(u, toks)))


@pytest.mark.slow
def test_masa_atoms_stored_once_under_a_cycle_plan_and_every_lowering():
  S, L, D, H, Dh = 3, 4, 32, 2, 16
  cfg = _cfg(num_layers=L, sharing=dict(scheme='cycle', num_unique=2), masa=dict(atoms=S))
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  flat = flatten_dict(v['params'])
  atoms = {p[-1]: x.shape for p, x in flat.items() if p[0] == 'masa'}
  assert atoms == {'q': (S, D, H, Dh), 'k': (S, D, H, Dh), 'v': (S, D, H, Dh),
                   'o': (S, H, Dh, D)}
  coefs = [x.shape for p, x in flat.items() if p[-1] == 'masa_coef']
  assert coefs == [(2, S)] * 4                # per stored set (tied with the set), per target
  assert not [p for p in flat if 'attn' in p and p[-1] == 'kernel']
  untied_cycle = _cfg(num_layers=L, sharing=dict(scheme='cycle', num_unique=2))
  n_cycle = accounting.params_unique(init_variables(DecoderLM(untied_cycle), jax.random.key(0)))
  attn = 2 * 4 * D * H * Dh                   # 2 sets x (q, k, v, o)
  assert accounting.params_unique(v) == n_cycle - attn + S * 4 * D * H * Dh + 2 * 4 * S
  # FLOPs: each applied layer multiplies with one combined matrix per target
  assert accounting.matmul_params_per_layer(cfg) == accounting.matmul_params_per_layer(
      untied_cycle)
  # The same tree runs under the flat lowering and remat.
  v = _perturb(v, 0.05)
  toks = _tokens()
  out = DecoderLM(cfg).apply(v, toks)
  for kw in (dict(scan_lowering='flat'), dict(remat='full')):
    other = cfg.derive(**kw)
    np.testing.assert_allclose(DecoderLM(other).apply(v, toks), out, atol=1e-5, rtol=1e-5)
  # The Python loop (one module per set, 'stack/set_<u>') stores the atoms once as well and
  # computes the nested scans' function from the same weights.
  loop = cfg.derive(scan_layers=False)
  lv = init_variables(DecoderLM(loop), jax.random.key(0))
  lflat = dict(flatten_dict(lv['params']))
  for p in lflat:
    if p[0] == 'masa':
      lflat[p] = flatten_dict(v['params'])[p]
    elif p[0] == 'stack':   # ('stack', 'set_u', ...) <- the nested tree's set u
      (src,) = [q for q in flatten_dict(v['params']) if q[0] == 'stack' and _block(q) == p[2:]]
      lflat[p] = flatten_dict(v['params'])[src][int(p[1].removeprefix('set_'))]
    else:
      lflat[p] = flatten_dict(v['params'])[p]
  assert sum(1 for p in lflat if p[0] == 'masa') == 4
  np.testing.assert_allclose(DecoderLM(loop).apply({'params': unflatten_dict(lflat)}, toks), out,
                             atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_masa_gradients_reach_atoms_and_coefficients():
  cfg = _cfg(masa=dict(atoms=2, targets=ALL_TARGETS), sharing=dict(scheme='cycle', num_unique=1))
  model = DecoderLM(cfg)
  v = init_variables(model, jax.random.key(0))
  toks = _tokens()

  def loss(params):
    logits = model.apply({'params': params}, toks[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))

  grads = flatten_dict(jax.grad(loss)(v['params']))
  masa = {p: g for p, g in grads.items() if p[0] == 'masa' or p[-1] == 'masa_coef'}
  # swiglu: wi_gate and wi_up are two projection types, one dictionary each
  assert {p[-1] for p in masa if p[0] == 'masa'} == {'q', 'k', 'v', 'o', 'wi_gate', 'wi_up',
                                                     'wo'}
  assert len([p for p in masa if p[-1] == 'masa_coef']) == 7
  for p, g in masa.items():
    assert float(jnp.max(jnp.abs(g))) > 0, p
  # FLOPs: one combined matrix per kernel and applied layer, as without MASA
  assert accounting.matmul_params_per_layer(cfg) == accounting.matmul_params_per_layer(
      cfg.derive(masa=dict(atoms=0)))


@pytest.mark.parametrize('kind', ['mup', 'umup'])
def test_masa_atoms_get_the_hidden_matrix_rules_of_their_kernel(kind):
  """Atoms follow the rules of the kernel they form (fan-in, width multiplier, init, LR,
  forward multiplier); coefficients are width-independent vectors."""
  settings = scaling.Settings(kind, base_d_model=16)
  plain = P.Parametrization(_cfg(d_model=64, mlp_dim=96).derive(parametrization=settings)).rules
  masa = P.Parametrization(
      _cfg(d_model=64, mlp_dim=96,
           masa=dict(atoms=3, targets=ALL_TARGETS)).derive(parametrization=settings)).rules
  for target, (module, name) in KERNEL_OF.items():
    if name == 'wi':   # gelu only
      continue
    (kernel,) = [r for p, r in plain.items() if _block(p) == (module, name, 'kernel')]
    atom = masa[('params', 'masa', target)]
    assert atom.role == kernel.role == 'hidden'
    for f in ('fan_in', 'fan_in_mult', 'init_scale', 'lr_mult', 'fwd_mult', 'eps_mult'):
      assert getattr(atom, f) == getattr(kernel, f), (target, f)
    assert atom.init_std == pytest.approx(kernel.init_std)
    assert atom.decays and atom.fan_in_mult == 4.0
  coefs = [r for p, r in masa.items() if p[-1] == 'masa_coef']
  assert coefs and all(r.role == 'vector' and r.fan_in_mult == 1.0 and r.init_scale == 1.0
                       and not r.decays for r in coefs)
  assert {r.lr_mult for r in coefs} == ({1.0} if kind == 'mup' else {2 ** -0.5})  # umup: L^-1/2


def test_masa_init_has_the_default_kernel_scale():
  """W_l = sum_s c_ls D_s starts at the default init's std 1/sqrt(fan_in)."""
  cfg = _cfg(d_model=64, mlp_dim=96, num_heads=4, num_layers=4, masa=dict(atoms=3))
  flat = flatten_dict(init_variables(DecoderLM(cfg), jax.random.key(0))['params'])
  coef = [x for p, x in flat.items() if p[-1] == 'masa_coef' and 'q' in p][0]   # (L, S)
  np.testing.assert_allclose(np.linalg.norm(coef, axis=-1), 1.0, rtol=1e-6)
  w = np.tensordot(np.asarray(coef), np.asarray(flat[('masa', 'q')]), axes=1)   # (L, D, H, Dh)
  assert abs(w.std() * math.sqrt(64) - 1) < 0.05
  assert not np.allclose(w[0], w[1])          # layers start different


# ---- config errors ---------------------------------------------------------------------------

@pytest.mark.parametrize('kw,match', [
    (dict(attention_sharing='kv'), 'attention_sharing'),
    (dict(attention_sharing='qk_shared', num_kv_heads=1), 'kv heads'),
    (dict(attention_sharing='qkv_shared', num_kv_heads=1), 'kv heads'),
    (dict(attention_sharing='kv_shared', sharing=dict(lora_rank=2, lora_layers='all',
                                                      lora_targets=('q', 'v'))),
     'store no value projection'),
    (dict(attention_sharing='qk_shared', masa=dict(atoms=2)), 'store no query projection'),
    (dict(masa=dict(atoms=-1)), 'masa.atoms'),
    (dict(masa=dict(atoms=2, targets=('q', 'wq'))), 'masa.targets'),
    (dict(masa=dict(atoms=2, targets=())), 'masa.targets'),
])
def test_config_errors(kw, match):
  with pytest.raises(ConfigError, match=match):
    _cfg(**kw)


@pytest.mark.parametrize('old,new', [('qk_v', 'kv_shared (values are the keys)'),
                                     ('q_kv', 'qk_shared (queries are the keys)'),
                                     ('qkv', 'qkv_shared (one projection for queries, keys '
                                             'and values)')])
def test_an_old_sharing_value_is_one_line_naming_the_new(old, new, tiny_config):
  with pytest.raises(ConfigError) as e:
    experiment.validate(tiny_config(**{'model.attention_sharing': old}))
  assert str(e.value) == f"model.attention_sharing='{old}' was renamed: use {new}"


def test_parametrization_errors():
  with pytest.raises(ConfigError, match='loop_rule'):
    P.Parametrization(
        _cfg(masa=dict(atoms=2), sharing=dict(scheme='universal'),
             num_layers=2).derive(parametrization=scaling.Settings('sp', loop_rule='inv_R')))
  with pytest.raises(ConfigError, match='query_zero_init'):
    P.Parametrization(
        _cfg(attention_sharing='qk_shared').derive(
            parametrization=scaling.Settings('mup', query_zero_init=True)))
  P.Parametrization(
      _cfg(attention_sharing='kv_shared').derive(
          parametrization=scaling.Settings('mup', query_zero_init=True)))


# ---- DirectShare head sharing ----------------------------------------------------------------

def _head_model(L=3, H=4, seed=0, **kw):
  cfg = _cfg(num_layers=L, num_heads=H, **kw)
  return cfg, _perturb(init_variables(DecoderLM(cfg), jax.random.key(seed)), 0.02)


def _kernels(cfg, v):
  flat = flatten_dict(v['params'])
  return {n: np.asarray(flat[('stack', 'segment_0', 'level', 'block', 'attn', n, 'kernel')],
                       np.float64) for n in 'qkvo'}


def test_head_similarity_ranking_matches_numpy():
  cfg, v = _head_model()
  w = _kernels(cfg, v)
  L, H = 3, 4
  best, match = {}, {}
  for l in range(1, L):          # independent loop over head pairs in earlier layers
    for h in range(H):
      a = np.concatenate([w['q'][l][:, h].ravel(), w['k'][l][:, h].ravel()])
      scores = []
      for m in range(l):
        for j in range(H):
          b = np.concatenate([w['q'][m][:, j].ravel(), w['k'][m][:, j].ravel()])
          scores.append((a @ b / np.linalg.norm(a) / np.linalg.norm(b), m, j))
      s, m, j = max(scores, key=lambda t: t[0])
      best[l, h], match[l, h] = s, (m, j)
  got_match, got_best = head_share.head_matches(cfg, v)
  assert np.all(np.isneginf(got_best[0]))
  for (l, h), s in best.items():
    assert got_best[l, h] == pytest.approx(s, abs=1e-9)
    assert tuple(got_match[l, h]) == match[l, h]
  for rate in (0.25, 0.5):
    n = int(rate * L * H)
    top = sorted(best, key=best.get)[-n:]
    assert head_share.replaced_heads(cfg, got_best, rate) == sorted(top)


def _reference_share_hash(selected, match):
  """zouyingcao/DirectShare direct_share.py, step 1, replayed on head indices: walking the
  selected heads layer by layer, each appends a copy of its match's original slices and points
  share_hash of itself and of its match at it. Returns {head: the head its copy came from}."""
  entries, share_hash = [], {}
  for l, h in sorted(selected):
    m, j = (int(i) for i in match[l, h])
    share_hash[l, h] = share_hash[m, j] = len(entries)
    entries.append((m, j))
  return {lh: entries[i] for lh, i in share_hash.items()}


def _assert_heads_from(before, after, origin, L, H):
  for l in range(L):
    for h in range(H):
      m, j = origin.get((l, h), (l, h))
      for n in 'qkv':
        np.testing.assert_array_equal(after[n][l][:, h], before[n][m][:, j])
      np.testing.assert_array_equal(after['o'][l][h], before['o'][m][j])


def test_head_sharing_copies_slices_and_counts():
  cfg, v = _head_model()
  L, H, D, Dh = 3, 4, 32, 8
  toks = _tokens()
  _, v0, rec0 = head_share.to_head_shared(cfg, v, 0.0)
  np.testing.assert_array_equal(DecoderLM(cfg).apply(v0, toks), DecoderLM(cfg).apply(v, toks))
  assert rec0['replaced'] == [] and rec0['params_unique'] == accounting.params_unique(v)
  before = _kernels(cfg, v)
  new_cfg, v1, rec = head_share.to_head_shared(cfg, v, 0.5)
  assert new_cfg == cfg
  after = _kernels(cfg, v1)
  replaced = {(r['layer'], r['head']): (r['source_layer'], r['source_head'])
              for r in rec['replaced']}
  selected = sorted(replaced) + [(r['layer'], r['head']) for r in rec['kept']]
  assert len(selected) == int(0.5 * L * H) == 6 and all(l > 0 for l, _ in selected)
  assert all(m < l for (l, _), (m, _) in replaced.items())
  match, _ = head_share.head_matches(cfg, v)
  origin = _reference_share_hash(selected, match)
  assert {lh: o for lh, o in origin.items() if o != lh} == replaced
  _assert_heads_from(before, after, origin, L, H)
  origins = {origin.get((l, h), (l, h)) for l in range(L) for h in range(H)}
  assert rec['distinct_heads'] == len(origins)
  assert rec['params_unique'] == (accounting.params_unique(v)
                                  - (L * H - len(origins)) * 4 * D * Dh)
  others = {p: x for p, x in flatten_dict(v1).items() if 'attn' not in p}
  assert all(np.array_equal(x, flatten_dict(v)[p]) for p, x in others.items())
  assert float(jnp.max(jnp.abs(DecoderLM(cfg).apply(v1, toks)
                               - DecoderLM(cfg).apply(v, toks)))) > 0


def test_head_sharing_chain_keeps_the_middle_head_as_the_reference_does():
  """Head (2, 0) matches (1, 0), which matches (0, 0), and both are selected: as in the
  reference, (1, 0) keeps its own weights (its share_hash is last pointed at a copy of itself)
  and (2, 0) takes (1, 0)'s original weights, not (0, 0)'s."""
  cfg, v = _head_model(L=3, H=2)
  flat = flatten_dict(v['params'])
  rng = np.random.default_rng(0)
  for n in 'qk':
    key = ('stack', 'segment_0', 'level', 'block', 'attn', n, 'kernel')
    w = np.asarray(flat[key]).copy()                      # (L, D, H, Dh)
    w[1, :, 0] = w[0, :, 0] + 0.1 * rng.standard_normal(w[0, :, 0].shape)
    w[2, :, 0] = w[1, :, 0] + 0.1 * rng.standard_normal(w[0, :, 0].shape)
    flat[key] = jnp.asarray(w)
  v = {**v, 'params': unflatten_dict(flat)}
  match, best = head_share.head_matches(cfg, v)
  rate = 2 / 6
  assert head_share.replaced_heads(cfg, best, rate) == [(1, 0), (2, 0)]
  assert tuple(match[2, 0]) == (1, 0) and tuple(match[1, 0]) == (0, 0)
  _, v1, rec = head_share.to_head_shared(cfg, v, rate)
  assert [(r['layer'], r['head'], r['source_layer'], r['source_head'])
          for r in rec['replaced']] == [(2, 0, 1, 0)]
  assert [(r['layer'], r['head']) for r in rec['kept']] == [(1, 0)]
  assert rec['distinct_heads'] == 5
  assert _reference_share_hash([(1, 0), (2, 0)], match) == {(0, 0): (0, 0), (1, 0): (1, 0),
                                                            (2, 0): (1, 0)}
  _assert_heads_from(_kernels(cfg, v), _kernels(cfg, v1), {(2, 0): (1, 0)}, 3, 2)


def test_postshare_similarity_term_restates_the_reference():
  """PostShare's weight loss: the mean over the chosen heads of the Frobenius norms of their
  q, k, v slices minus their matches' (the reference's 'norm' loss), in numpy."""
  cfg, v = _head_model()
  match, best = head_share.head_matches(cfg, v)
  heads = head_share.replaced_heads(cfg, best, 0.5)
  pairs = head_share.head_pairs(match, heads)
  k = _kernels(cfg, v)
  want = np.mean([sum(np.linalg.norm(k[n][l, :, h] - k[n][m, :, j]) for n in 'qkv')
                  for l, h, m, j in pairs])
  got = float(head_share.similarity_loss(cfg, v['params'], pairs))
  assert len(pairs) == 6 and abs(got - want) <= 1e-5 * want


@pytest.mark.slow
def test_postshare_post_trains_toward_the_matches_then_shares():
  """post_train_steps Adam steps on (1 - w) NLL + w similarity: the similarity term falls, the
  heads chosen on the source are shared afterwards (the same replaced heads as DirectShare),
  and the sharing step then costs less next-token loss than after the same post-training
  without the constraint (w = 0)."""
  cfg, v = _head_model()
  toks = np.asarray(_tokens(B=4, T=12))

  def nll(variables):
    logits = DecoderLM(cfg).apply(variables, jnp.asarray(toks[:, :-1]))
    return float(jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits,
                                                                           toks[:, 1:])))

  _, _, rec_d = head_share.to_head_shared(cfg, v, 0.5)
  cost = {}
  for w in (0.5, 0.0):
    post = head_share.PostTraining(steps=60, lr=3e-3, weight=w, tokens_NT=toks)
    _, shared, rec = head_share.to_head_shared(cfg, v, 0.5, post=post)
    pt = rec['post_training']
    assert rec['method'].startswith('PostShare') and pt['steps'] == 60
    assert [(r['layer'], r['head']) for r in rec['replaced']] == [
        (r['layer'], r['head']) for r in rec_d['replaced']] != []
    cost[w] = nll(shared) - pt['nll_after']   # what sharing the post-trained heads costs
    if w:
      assert pt['similarity_after'] < 0.5 * pt['similarity_before']
    else:
      assert pt['similarity_after'] > 0.9 * pt['similarity_before']
  assert 0 < cost[0.5] < 0.5 * cost[0.0]


def test_postshare_bad_options_are_one_line():
  from sharenet.config import defaults
  from sharenet.main import convert_workdir
  opts = defaults.conversion_config()
  for to, changes, match in (('head_shared', {'post_train_steps': -1}, 'post_train_steps=-1'),
                             ('head_shared', {'post_train_steps': 5, 'similarity_weight': 2.0},
                              'similarity_weight=2.0'),
                             ('rmsnorm', {'post_train_steps': 5}, 'post-trains before head')):
    o = defaults.conversion_config()
    o.to = to
    o.update(changes)
    with pytest.raises(ConfigError, match=match) as e:
      convert_workdir.check_options(o)
    assert '\n' not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize('kw,rate,match', [
    (dict(), 0.75, 'share_rate'),   # 9 of 12 heads; only 8 lie after layer 0
    (dict(), -0.1, 'share_rate'),
    (dict(num_kv_heads=2), 0.3, 'num_kv_heads'),
    (dict(norm=dict(qk_norm='rms')), 0.3, 'qk_norm'),
    (dict(sharing=dict(scheme='universal')), 0.3, 'untied'),
    (dict(attention_sharing='kv_shared'), 0.3, 'attention_sharing'),
])
def test_head_sharing_errors(kw, rate, match):
  cfg, v = _head_model(**kw)
  with pytest.raises(ConfigError, match=match):
    head_share.to_head_shared(cfg, v, rate)


# ---- end to end --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('model', [{'model.attention_sharing': 'kv_shared'},
                                   {'model.masa.atoms': 2, 'model.num_layers': 4,
                                    'model.sharing.scheme': 'cycle',
                                    'model.sharing.num_unique': 2}])
def test_five_training_steps(tiny_config, tmp_path, model):
  config = tiny_config(**{'train.steps': 5, 'train.checkpoint_every': 5, **model})
  out = loop.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(out['eval_loss'])
  with open(tmp_path / 'config.json') as f:
    recorded = json.load(f)
  mcfg = ModelConfig.from_config(config.model, config.train.seq_len)
  n = accounting.params_unique(init_variables(DecoderLM(mcfg), jax.random.key(0)))
  assert recorded['params_unique'] == n
  if 'model.attention_sharing' in model:   # this run, not a second one: one compile fewer
    _loads_as_written_before_the_rename(config, str(tmp_path), out['eval_loss'])


def _loads_as_written_before_the_rename(config, workdir, eval_loss):
  """The run's config.json and checkpoint config saying qk_v, as runs before the rename wrote
  them: it loads as kv_shared, evaluates as before and resumes with no changed field."""
  saved = os.path.join(workdir, 'checkpoints', '5', 'config', 'metadata')
  for path in (os.path.join(workdir, 'config.json'), saved):
    text = open(path).read()
    assert '"attention_sharing": "kv_shared"' in text
    with open(path, 'w') as f:
      f.write(text.replace('"attention_sharing": "kv_shared"', '"attention_sharing": "qk_v"'))
  assert workdir_io.load_config(workdir).model.attention_sharing == 'kv_shared'
  np.testing.assert_allclose(eval_workdir.evaluate_workdir(workdir)['eval_loss'], eval_loss,
                             rtol=1e-5)
  prior = orbax_io.saved_config(orbax_io.manager(workdir, 3, async_save=False), 5)
  assert prior['model']['attention_sharing'] == 'qk_v'
  assert not resume.Changes(prior, config)


@pytest.mark.slow
def test_head_shared_conversion_of_a_trained_run_evaluates(tiny_config, tmp_path):
  src, dst = str(tmp_path / 'src'), str(tmp_path / 'dst')
  loop.train_and_evaluate(tiny_config(**{'train.steps': 5, 'train.checkpoint_every': 5,
                                              'model.num_layers': 3}), src)
  before = eval_workdir.evaluate_workdir(src)['eval_loss']
  opts = defaults.conversion_config()
  opts.to, opts.share_rate = 'head_shared', 0.3
  convert_workdir.convert_workdir(src, dst, opts)
  after = eval_workdir.evaluate_workdir(dst)['eval_loss']
  assert np.isfinite(before) and np.isfinite(after)
  with open(os.path.join(dst, 'config.json')) as f:
    rec = json.load(f)['head_sharing']
  assert len(rec['replaced']) == int(0.3 * 3 * 2) == 1
  assert rec['params_unique'] < json.load(open(os.path.join(src, 'config.json')))['params_unique']
  # PostShare through convert.py: post-trained on the calibration batch, then shared
  opts.post_train_steps, opts.post_train_lr, opts.calibration_windows = 5, 1e-3, 2
  post_dst = str(tmp_path / 'post')
  convert_workdir.convert_workdir(src, post_dst, opts)
  with open(os.path.join(post_dst, 'config.json')) as f:
    post = json.load(f)['head_sharing']
  assert post['method'].startswith('PostShare') and post['post_training']['steps'] == 5
  assert post['post_training']['similarity_after'] < post['post_training']['similarity_before']
  assert post['replaced'] == rec['replaced']
  assert np.isfinite(eval_workdir.evaluate_workdir(post_dst)['eval_loss'])
