"""Core model invariants: parameter counts, tied gradients, LoRA, causality, remat."""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.models import accounting, layout
from sharenet.models.config import REMATS
from sharenet.errors import ConfigError
from sharenet.models.params import PER_LAYER
from sharenet.models.sharing import SCHEMES
from conftest import rel_err as _rel_err

SCHEME_KW = {   # model.sharing keys of each scheme's tiny model
    'untied': {}, 'universal': {}, 'cycle': dict(repeats=2), 'sequence': dict(repeats=2),
    'middle_cycle': dict(repeats=2), 'middle_sequence': dict(repeats=2), 'sandwich': {},
    'groups': dict(num_unique=3), 'explicit': dict(pattern='0,1,1,0,2,2'),
}


def tiny(scheme='cycle', **kw):
  base = ModelConfig(vocab_size=64, d_model=32, num_layers=6, num_heads=4, mlp_dim=48,
                     remat='none', sharing=dict(scheme=scheme, **SCHEME_KW[scheme]))
  return base.derive(**kw)


def tokens(B=2, T=12, seed=0, vocab=64):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)


@pytest.mark.slow
def test_init_is_one_cached_trace_of_flax_init():
  """init_variables evaluates the flax init's trace, cached per config and shared with the
  role table: its values are flax's own, bit for bit; a raw uint32 key and float64 mode (other
  input types, other trace-time settings) get traces of their own."""
  from sharenet.models import lm, param_table
  cfg = tiny('cycle', sharing=dict(lora_rank=2, untie_norms=True))
  param_table.cache_clear()
  key = jax.random.key(3)
  got = init_variables(DecoderLM(cfg), key)
  chex.assert_trees_all_equal(
      got, jax.jit(lambda k: nn.unbox(lm.init_boxed(DecoderLM(cfg), k)))(key))
  assert set(param_table(cfg)) == {('params',) + p for p in flatten_dict(got['params'])} | {
      (PER_LAYER,) + p for p in flatten_dict(got[PER_LAYER])}
  assert lm._init_trace.cache_info().currsize == 1   # the table read the init's trace
  raw = init_variables(DecoderLM(cfg), jax.random.PRNGKey(3))
  with jax.enable_x64(True):
    wide = init_variables(DecoderLM(cfg), key)
  assert lm._init_trace.cache_info().currsize == 3
  chex.assert_trees_all_equal_shapes_and_dtypes(raw, got)
  chex.assert_trees_all_equal(wide, got)


@pytest.mark.slow
def test_state_collections_come_from_the_init_trace(monkeypatch):
  """A statistics norm's initial statistics (loss-free balancing's bias takes the same path,
  lm.init_collection) are read from the init's cached trace: flax's own values, with the flax
  modules traced once for the role table, the abstract state and the init together."""
  from sharenet.models import norm_stats
  from sharenet.train import trainer
  from sharenet.models import param_table
  cfg = tiny('cycle', norm={'kind': 'powernorm'})
  param_table.cache_clear()
  flax_init, calls = DecoderLM.init, []
  monkeypatch.setattr(DecoderLM, 'init',
                      lambda self, *a, **k: calls.append(1) or flax_init(self, *a, **k))
  model, tx = DecoderLM(cfg), optax.sgd(0.1)
  abstract = trainer.abstract_state(model, tx)
  state = trainer.init_state(model, tx, jax.random.key(1))
  assert len(calls) == 1
  key = jax.random.key(0)
  want = flax_init(model, {'params': key, PER_LAYER: key}, tokens(1, 2))[norm_stats.NORM_STATS]
  chex.assert_trees_all_equal(state.tstate, {norm_stats.NORM_STATS: want})
  chex.assert_trees_all_equal_shapes_and_dtypes(abstract.tstate, state.tstate)


@functools.partial(jax.jit, static_argnums=0)
def init(cfg: ModelConfig, seed: int = 0):
  return init_variables(DecoderLM(cfg), jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=0)
def apply(cfg: ModelConfig, variables, toks):
  return DecoderLM(cfg).apply(variables, toks)


def loss_fn(variables, model, toks):
  logits = model.apply(variables, toks[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()


_GRAD = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)


@functools.cache
def nested_loss_and_grads(cfg: ModelConfig):
  """(variables, loss, grads) of cfg's model at init (seed 0; LoRA's B randomised where it has
  LoRA) on tokens(): computed once per config for the tests that compare against it."""
  v = init(cfg)
  v = randomize_lora_b(v) if cfg.sharing.lora_rank else v
  loss, g = _GRAD(v, DecoderLM(cfg), tokens())
  return v, loss, g


def randomize_lora_b(variables, seed=1):
  """B = 0 at init makes LoRA invisible; give it values so identities are not vacuous."""
  flat = flatten_dict(variables[PER_LAYER])
  keys = jax.random.split(jax.random.key(seed), len(flat))
  out = {}
  for k, (path, leaf) in zip(keys, flat.items()):
    if path[-1] == 'lora_b':
      leaf = 0.1 * jax.random.normal(k, leaf.shape)
    out[path] = leaf
  return {**variables, PER_LAYER: unflatten_dict(out)}


# ---- parameter counts ---------------------------------------------------------------------

def lora_layer_count(cfg: ModelConfig) -> int:
  """Applied layers holding LoRA: all, or (lora_layers='shared', RRT) those whose set another
  applied layer of the same scan segment also uses; from the plan index alone."""
  if not cfg.sharing.lora_rank:
    return 0
  if cfg.sharing.lora_layers == 'all':
    return cfg.num_layers
  n, start = 0, 0
  for seg in cfg.plan.segments:
    idx = cfg.plan.index[start:start + seg.num_applied]
    n += len(idx) if len(set(idx)) < len(idx) else 0
    start += seg.num_applied
  return n


def expected_params(cfg: ModelConfig, lora_layers: int | None = None) -> int:
  """Counts from the plan and the layer shapes alone, independent of the module tree."""
  D, F, V, H, K, Dh = (cfg.d_model, cfg.mlp_dim, cfg.vocab_size, cfg.num_heads, cfg.kv_heads,
                       cfg.d_head)
  norm_size = {'layernorm': 2 * D, 'rmsnorm': D, 'none': 0}[cfg.norm.kind]
  n_norms = 4 if cfg.norm.placement == 'peri' else 2
  attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D + (2 * Dh if cfg.norm.qk_norm != 'none' else 0)
  n_in = 2 if cfg.mlp == 'swiglu' else 1
  mlp = (n_in + 1) * D * F
  block_tied = attn + mlp + (0 if cfg.sharing.untie_norms else n_norms * norm_size)
  per_layer = n_norms * norm_size if cfg.sharing.untie_norms else 0
  lora_shapes = {'q': (D, H * Dh), 'k': (D, K * Dh), 'v': (D, K * Dh), 'o': (H * Dh, D),
                 'mlp_in': (D, F), 'mlp_out': (F, D)}
  lora = sum((n_in if t == 'mlp_in' else 1) * cfg.sharing.lora_rank * sum(lora_shapes[t])
             for t in cfg.sharing.lora_targets)
  U, L = max(cfg.plan.index) + 1, cfg.num_layers
  outer = V * D + (0 if cfg.tie_embeddings else D * V) + (0 if cfg.norm.placement == 'post'
                                                          else norm_size)
  n_lora = lora_layer_count(cfg) if lora_layers is None else lora_layers
  return outer + U * block_tied + L * per_layer + n_lora * lora


@pytest.mark.slow
@pytest.mark.parametrize('scheme', SCHEMES)
@pytest.mark.parametrize(
    'extra', [{},
              dict(sharing=dict(untie_norms=True)),
              dict(sharing=dict(lora_rank=2, lora_targets=('q', 'v', 'mlp_in'))),
              dict(sharing=dict(untie_norms=True, lora_rank=3, lora_targets=('k', 'o', 'mlp_out')),
                   norm=dict(kind='layernorm', placement='peri', qk_norm='rms'),
                   tie_embeddings=True, num_kv_heads=2, mlp='gelu')])
def test_stored_param_count_matches_plan(scheme, extra):
  if scheme == 'untied' and extra.get('sharing', {}).get('lora_rank'):
    # 'shared' LoRA needs a shared layer (own test)
    extra = dict(extra, sharing={**extra.get('sharing', {}), 'lora_layers': 'all'})
  cfg = tiny(scheme, **extra)
  shapes = jax.eval_shape(lambda: init(cfg))
  assert accounting.params_unique(shapes) == expected_params(cfg)
  untied = cfg.derive(sharing=dict(scheme='untied', num_unique=0, repeats=0, pattern='',
                                    lora_layers='all'))   # LoRA layers counted from cfg below
  assert accounting.params_applied(shapes, cfg) == expected_params(untied, lora_layer_count(cfg))


def test_flops_per_token_counts_applied_depth():
  tied, untied = tiny('universal'), tiny('untied')
  assert accounting.flops_per_token(tied, 64) == accounting.flops_per_token(untied, 64)
  D, F, V, L, T = 32, 48, 64, 6, 64
  per_layer = 4 * D * D + 3 * D * F
  assert accounting.flops_per_token(untied, T) == 3 * (2 * (L * per_layer + D * V) + 2 * L * T * D)


# ---- tied-gradient identity ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('scheme, lora', [
    (s, False) for s in ('cycle', 'sequence', 'middle_cycle', 'universal', 'groups', 'sandwich',
                         'explicit')] + [(s, True) for s in ('cycle', 'sequence', 'middle_cycle')])
def test_tied_gradient_is_sum_of_untied_gradients(scheme, lora):
  extra = dict(sharing=dict(lora_rank=2, lora_targets=('q', 'v', 'mlp_out'),
                            untie_norms=True)) if lora else {}
  cfg = tiny(scheme, **extra)
  v, loss, g = nested_loss_and_grads(cfg)
  ucfg, uv = layout.untied_config(cfg), jax.jit(lambda v: layout.to_untied(v, cfg)[1])(v)
  uloss, ug = _GRAD(uv, DecoderLM(ucfg), tokens())
  np.testing.assert_allclose(loss, uloss, rtol=1e-6)

  tied = layout.unique_sets(g['params'], cfg)
  per_applied = layout.unique_sets(ug['params'], ucfg)   # untied: one set per applied layer
  plan = cfg.plan
  spread = 0.0
  for path, gt in tied.items():
    for u in range(plan.num_unique):
      expected = sum(per_applied[path][l] for l in plan.uses(u))
      assert _rel_err(gt[u], expected) <= 1e-5, (path, u)
      if len(plan.uses(u)) > 1:  # the per-use grads differ, so the check is not vacuous
        uses = [per_applied[path][l] for l in plan.uses(u)]
        spread = max(spread, _rel_err(uses[0], uses[1]))
  assert spread > 1e-3
  if lora:  # per-layer parts: exactly the untied model's per-layer gradients
    for path, gl in layout.applied_per_layer(g[PER_LAYER], cfg).items():
      ul = layout.applied_per_layer(ug[PER_LAYER], ucfg)[path]
      assert _rel_err(gl, ul) <= 1e-5, path
  for path, gx in flatten_dict(g['params']).items():
    if path[0] != 'stack':
      assert _rel_err(gx, flatten_dict(ug['params'])[path]) <= 1e-5, path


# ---- depth-wise LoRA ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('lora_layers', ['shared', 'all'])
@pytest.mark.parametrize('scheme', ['middle_cycle', 'middle_sequence', 'sandwich', 'cycle',
                                    'explicit'])
def test_lora_sits_on_shared_sets_only_under_shared(scheme, lora_layers):
  """Relaxed Recursive Transformers (arXiv:2410.20672) relax the looped layers only: under
  lora_layers='shared' the unique first and last layers of middle schemes hold no LoRA; 'all'
  puts it on every applied layer."""
  cfg = tiny(scheme, sharing=dict(lora_rank=2, lora_targets=('q', 'mlp_out'),
                                  lora_layers=lora_layers))
  per_layer = jax.eval_shape(lambda: init(cfg))[PER_LAYER]
  holders = {p[1]: p for p in flatten_dict(per_layer) if p[-1] in ('lora_a', 'lora_b')}
  middle = scheme in ('middle_cycle', 'middle_sequence', 'sandwich')
  n_seg = 3 if middle else 1
  want = {'segment_1'} if middle and lora_layers == 'shared' else \
      {f'segment_{i}' for i in range(n_seg)}
  assert set(holders) == want
  # LoRA factors per applied layer that holds them: 6 - 2 unique layers under 'shared'.
  lora = layout.applied_per_layer(init(cfg)[PER_LAYER], cfg)[('attn', 'q', 'lora_a')]
  held = [l for l in range(6) if np.any(np.asarray(lora[l]) != 0)]
  assert held == ([1, 2, 3, 4] if middle and lora_layers == 'shared' else list(range(6)))


def test_shared_lora_without_a_shared_layer_is_one_line_error():
  with pytest.raises(ConfigError, match='valid: model.sharing.lora_layers=all'):
    tiny('untied', sharing=dict(lora_rank=2))
  with pytest.raises(ConfigError, match='model.sharing.lora_layers'):
    tiny('cycle', sharing=dict(lora_rank=2, lora_layers='middle'))
  assert tiny('untied', sharing=dict(lora_rank=2, lora_layers='all')).sharing.lora_rank == 2


@pytest.mark.slow
@pytest.mark.parametrize('lora_layers', ['shared', 'all'])
@pytest.mark.parametrize('scheme', ['middle_cycle'])
def test_zero_lora_equals_strict_plan(scheme, lora_layers):
  strict = tiny(scheme)
  relaxed = strict.derive(sharing=dict(lora_rank=4, lora_layers=lora_layers,
                                       lora_targets=('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out')))
  v_strict = init(strict)
  v_relaxed = init(relaxed)
  v_relaxed = {'params': v_strict['params'], PER_LAYER: v_relaxed[PER_LAYER]}
  toks = tokens()
  np.testing.assert_array_equal(apply(strict, v_strict, toks), apply(relaxed, v_relaxed, toks))
  # LoRA factors are per applied layer, and each layer holding LoRA got its own draw of A
  # (layers without LoRA read as zeros).
  lora = layout.applied_per_layer(v_relaxed[PER_LAYER], relaxed)
  a = lora[('attn', 'q', 'lora_a')]
  assert a.shape[0] == relaxed.num_layers
  draws = {np.asarray(a[l]).tobytes() for l in range(a.shape[0]) if np.any(a[l] != 0)}
  assert len(draws) == lora_layer_count(relaxed) == (4 if lora_layers == 'shared' else 6)


@pytest.mark.slow
def test_lora_zero_a_starts_a_at_zero_and_b_at_one_over_sqrt_rank():
  """lora_zero='a': A = 0 (x A starts at 0), B ~ N(0, 1/r); the model starts as the strict plan
  and A, not B, gets the first gradient (B's gradient is A^T x^T g = 0)."""
  strict = tiny('cycle')
  relaxed = strict.derive(sharing=dict(lora_rank=8, lora_zero='a', lora_layers='all',
                                       lora_targets=('q', 'v', 'mlp_in')))
  v = init(relaxed)
  v_strict = {'params': v['params']}
  toks = tokens()
  np.testing.assert_allclose(apply(relaxed, v, toks), apply(strict, v_strict, toks), atol=1e-6)
  flat = flatten_dict(v[PER_LAYER])
  for path, x in flat.items():
    x = np.asarray(x)
    if path[-1] == 'lora_a':
      assert not np.any(x)
    elif path[-1] == 'lora_b':
      assert abs(x.std() - 8 ** -0.5) < 0.1 * 8 ** -0.5, path
  grads = jax.grad(loss_fn)(v, DecoderLM(relaxed), tokens(T=13))
  g = flatten_dict(grads[PER_LAYER])
  assert all(np.any(np.asarray(x)) for p, x in g.items() if p[-1] == 'lora_a')
  assert not any(np.any(np.asarray(x)) for p, x in g.items() if p[-1] == 'lora_b')
  with pytest.raises(ConfigError, match="model.sharing.lora_zero='c' is unknown; valid: b, a"):
    tiny('cycle', sharing=dict(lora_rank=2, lora_zero='c'))


# ---- causality, shapes, remat ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('scheme', SCHEMES)
def test_causal_shapes_finite(scheme):
  cfg = tiny(scheme, sharing=dict(untie_norms=scheme == 'cycle',
                                  lora_rank=2 if scheme == 'sequence' else 0))
  model = DecoderLM(cfg)
  v = init_variables(model, jax.random.key(0))
  B, T, t = 2, 10, 4
  toks = tokens(B, T)
  logits = apply(cfg, v, toks)
  chex.assert_shape(logits, (B, T, cfg.vocab_size))
  chex.assert_tree_all_finite(logits)

  def out_at_t(delta_BTD):
    out = model.apply({**v, 'perturbations': {'embedded': delta_BTD}}, toks)
    return out[:, t].sum()

  g_BTD = jax.jit(jax.grad(out_at_t))(jnp.zeros((B, T, cfg.d_model)))
  assert float(jnp.abs(g_BTD[:, t + 1:]).max()) == 0.0
  assert float(jnp.abs(g_BTD[:, :t + 1]).min(axis=-1).max()) > 0.0


@pytest.mark.slow
@pytest.mark.parametrize('remat', REMATS)
def test_remat_policies_same_loss_and_grads(remat):
  ref_cfg = tiny('cycle', sharing=dict(lora_rank=2, untie_norms=True))
  _, loss, g = nested_loss_and_grads(ref_cfg.derive(remat=remat))   # the same variables:
  _, ref_loss, ref_g = nested_loss_and_grads(ref_cfg)                # remat leaves the init
  chex.assert_tree_all_finite(g)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    assert _rel_err(a, b) <= 1e-5


def test_untied_and_universal_share_one_code_path():
  """Same module tree shape: only the stacked set count changes."""
  shapes = {}
  for s in ('untied', 'universal'):
    cfg = tiny(s)
    tree = jax.eval_shape(lambda: init(cfg))
    shapes[s] = {k: v.shape for k, v in flatten_dict(tree['params']).items()}
  assert shapes['untied'].keys() == shapes['universal'].keys()
  q = ('stack', 'segment_0', 'level', 'block', 'attn', 'q', 'kernel')
  assert shapes['untied'][q][0] == 6 and shapes['universal'][q][0] == 1


def test_gqa_and_tied_embeddings_run():
  cfg = tiny('cycle', num_kv_heads=2, tie_embeddings=True,
             norm=dict(qk_norm='rms', kind='layernorm', placement='post'), mlp='gelu',
             position='learned')
  model = DecoderLM(cfg)
  v = init_variables(model, jax.random.key(0))
  chex.assert_tree_all_finite(model.apply(v, tokens()))
  assert 'readout' not in v['params']


def test_split_transpose_same_loss_and_grads():
  cfg = tiny('cycle', sharing=dict(lora_rank=2, untie_norms=True), remat='dots_no_batch')
  v, loss, g = nested_loss_and_grads(cfg)
  ref_loss, ref_g = _GRAD(v, DecoderLM(cfg.derive(scan_split_transpose=False)), tokens())
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    assert _rel_err(a, b) <= 1e-5


def _boxed_layout(tree):
  """{path: (shape, logical names)} of every stored variable, boxes included."""
  is_box = lambda x: isinstance(x, nn.Partitioned)
  flat = flatten_dict(jax.tree.map(lambda x: x, tree, is_leaf=is_box))
  return {k: (x.value.shape, x.names) if is_box(x) else (x.shape, None) for k, x in flat.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    'scheme, extra',
    [('cycle', {}), ('sequence', dict(remat='dots_no_batch')), ('universal', {}), ('untied', {}),
     ('sandwich', {}), ('groups', {}),
     ('middle_cycle',
      dict(sharing=dict(lora_rank=2, untie_norms=True, lora_targets=('q', 'v', 'mlp_out')))),
     ('middle_sequence', dict(sharing=dict(untie_norms=True)))])
def test_flat_lowering_stores_the_nested_tree_and_computes_the_same(scheme, extra):
  """scan_lowering='flat' is one scan over gathered sets: same checkpoint, same numbers."""
  cfg = tiny(scheme, **extra)
  flat = cfg.derive(scan_lowering='flat')
  assert _boxed_layout(jax.eval_shape(lambda: init(flat))) == _boxed_layout(
      jax.eval_shape(lambda: init(cfg)))
  v, loss, g = nested_loss_and_grads(cfg)
  toks = tokens()
  flat_loss, flat_g = _GRAD(v, DecoderLM(flat), toks)
  np.testing.assert_allclose(flat_loss, loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(flat_g), jax.tree.leaves(g)):
    assert _rel_err(a, b) <= 1e-5
  # The flat program really is a single scan per segment, not the nested one.
  jaxpr = str(jax.make_jaxpr(lambda v: DecoderLM(flat).apply(v, toks))(v))
  assert jaxpr.count(' scan[') == len(cfg.plan.segments)


def test_unknown_scan_lowering_is_one_line_error():
  with pytest.raises(ConfigError,
                     match="model.scan_lowering=.tiled. is unknown; valid: nested, flat"):
    tiny('cycle', scan_lowering='tiled')
