"""Block choices before tying (sharenet/transforms/block_select.py): FoldGPT's gate-ranked
removal, FlexiGPT's replacement by a donor plus an SVD adapter, and extension by tied copies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables, layout, param_table
from sharenet.transforms import block_select, recursive, similarity

IDLE = (2, 5)   # the fixture's blocks that write nothing into the stream
TARGETS = ('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out')


@pytest.fixture(scope='module')
def eight(tiny_config):
  """An 8-layer untied model whose blocks IDLE have zero writers (x + 0: identities), its
  calibration tokens and logits."""
  cfg = ModelConfig.from_config(tiny_config(**{'model.num_layers': 8}).model)
  v = init_variables(DecoderLM(cfg), jax.random.key(0), seq_len=16)
  writers = block_select._writers(cfg)
  layers = layout.applied_params(v['params'], cfg)
  layers = {p: x.at[jnp.asarray(IDLE)].set(0.0) if p in writers else x for p, x in layers.items()}
  v = {**v, 'params': layout.from_unique_sets(v['params'], layers, cfg)}
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 33))
  return cfg, v, tokens, np.asarray(DecoderLM(cfg).apply(v, jnp.asarray(tokens)))


def _logits(cfg, v, tokens):
  return np.asarray(DecoderLM(cfg).apply(v, jnp.asarray(tokens)))


@pytest.mark.slow
def test_gates_scale_what_each_block_writes(eight):
  cfg, v, tokens, ref = eight
  ones = {**v, 'params': block_select.gated(cfg, v['params'], jnp.ones((8,)))}
  np.testing.assert_array_equal(_logits(cfg, ones, tokens), ref)
  # gate 0 on a block = that block removed (x + 0 f(x) = x): logits of the 7 other layers
  g = jnp.ones((8,)).at[3].set(0.0)
  off = {**v, 'params': block_select.gated(cfg, v['params'], g)}
  kept = [l for l in range(8) if l != 3]
  dcfg, dv = recursive._assemble(cfg, v, cfg.derive(num_layers=7), [[k] for k in kept], kept, 0)
  np.testing.assert_allclose(_logits(cfg, off, tokens), _logits(dcfg, dv, tokens), atol=1e-5)


@pytest.mark.slow
def test_removal_at_rate_quarter_removes_the_two_blocks_the_gates_rank_lowest(eight):
  """The idle blocks have no say in the loss, so the L1 penalty drives their gates lowest; the
  conversion removes exactly the 2 of least |gate| and keeps the function (they were
  identities), then folds the remaining 6 into 3 groups."""
  cfg, v, tokens, ref = eight
  gates = block_select.gate_importance(cfg, v, tokens, 100, 0.02, 0.01)
  assert block_select.least(gates, 2) == list(IDLE)
  select = recursive.Selection(remove_rate=0.25, gate_steps=100, gate_lr=0.02, gate_l1=0.01)
  ncfg, nv, info = recursive.convert(cfg, v, 'explicit', 6, 'similar', calibration=tokens,
                                     select=select)
  assert info['removed'] == list(IDLE) and ncfg.num_layers == 6
  np.testing.assert_allclose(info['importance'], gates, atol=1e-5)
  np.testing.assert_allclose(_logits(ncfg, nv, tokens), ref, atol=1e-5)
  fcfg, _, info = recursive.convert(cfg, v, 'explicit', 3, 'similar', calibration=tokens,
                                    select=select)
  assert fcfg.plan.num_unique == 3 and len(info['pattern'].split(',')) == 6


@pytest.mark.slow
def test_block_influence_equals_a_numpy_restatement(eight):
  cfg, v, tokens, _ = eight
  h = similarity.layer_outputs(cfg, v, tokens)
  x0 = np.asarray(DecoderLM(cfg).apply(v, jnp.asarray(tokens), method=DecoderLM.embed))
  stream = np.concatenate([x0[None], h])
  cos = lambda a, b: (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
  want = [1 - cos(stream[l], stream[l + 1]).mean() for l in range(8)]
  got = block_select.block_influence(cfg, v, tokens)
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert block_select.least(got, 2) == list(IDLE)   # an identity block has influence 0
  sel = recursive.Selection(remove_rate=0.25, importance='influence')
  assert recursive.convert(cfg, v, 'explicit', 6, 'similar', calibration=tokens,
                           select=sel)[2]['removed'] == list(IDLE)


@pytest.mark.slow
def test_a_replaced_block_is_its_donor_plus_the_svd_adapters_product(eight):
  """init=replace (FlexiGPT): the 2 blocks of least influence take the kept block whose
  difference a rank-r adapter reconstructs best (the metric restated in numpy), and each
  replaced kernel is W_donor + scale * A B = W_donor + trunc_r(W_pruned - W_donor); at full rank
  the model is the source."""
  cfg, v, tokens, ref = eight
  rank = 4
  ncfg, nv, info = recursive.convert(cfg, v, 'explicit', 0, 'replace', lora_rank=rank,
                                     lora_init='svd', lora_targets=TARGETS, calibration=tokens,
                                     select=recursive.Selection(replace_rate=0.25))
  assert info['pruned'] == list(IDLE) and ncfg.num_layers == 8
  src = layout.applied_params(v['params'], cfg)
  table = param_table(ncfg)
  kernels = {i.local[:-1]: i for i in table.values() if i.role == 'writer' or i.role == 'reader'}
  adapted = {}
  for i in table.values():
    if i.role == 'lora':
      adapted.setdefault(kernels[i.local[:-1]].local, {})['a' if i.axes[-1] == 'lora' else 'b'] \
          = i.local

  def residual(p, d):
    total = 0.0
    for path in adapted:
      n_in = kernels[path[:-1]].num_in
      w = np.asarray(src[path], np.float64)
      s = np.linalg.svd((w[p] - w[d]).reshape(int(np.prod(w.shape[1:1 + n_in])), -1),
                        compute_uv=False)
      total += np.sum(s[rank:] ** 2) / np.mean([np.sum(x ** 2) for x in w])
    return total

  kept = [l for l in range(8) if l not in IDLE]
  pattern = [int(x) for x in info['pattern'].split(',')]
  sets = layout.unique_sets(nv['params'], ncfg)
  per_layer = layout.applied_per_layer(nv['per_layer'], ncfg)
  scale = ncfg.sharing.lora_scale
  for p in IDLE:
    donor = info['donors'][str(p)]
    assert donor == min(kept, key=lambda d: (residual(p, d), abs(p - d), d))
    assert kept[pattern[p]] == donor
    for path, ab in adapted.items():
      n_in = kernels[path[:-1]].num_in
      wp, wd = np.asarray(src[path][p], np.float64), np.asarray(src[path][donor], np.float64)
      np.testing.assert_array_equal(np.asarray(sets[path][pattern[p]]), wd)
      shape = (int(np.prod(wp.shape[:n_in])), -1)
      u, s, vt = np.linalg.svd((wp - wd).reshape(shape), full_matrices=False)
      want = wd.reshape(shape) + (u[:, :rank] * s[:rank]) @ vt[:rank]
      a = np.asarray(per_layer[ab['a']][p], np.float64).reshape(shape[0], rank)
      b = np.asarray(per_layer[ab['b']][p], np.float64).reshape(rank, -1)
      np.testing.assert_allclose(wd.reshape(shape) + scale * a @ b, want, atol=1e-5)
  full, fv, _ = recursive.convert(cfg, v, 'explicit', 0, 'replace', lora_rank=cfg.mlp_dim,
                                  lora_init='svd', lora_targets=TARGETS, untie_norms=True,
                                  calibration=tokens,
                                  select=recursive.Selection(replace_rate=0.25))
  np.testing.assert_allclose(_logits(full, fv, tokens), ref, atol=1e-4)


@pytest.mark.slow
def test_extend_inserts_tied_copies(eight):
  """init=extend: a tied copy after each listed layer; copies of the idle blocks are
  identities, so the 10-layer model computes the source's function with 8 stored sets."""
  cfg, v, tokens, ref = eight
  ncfg, nv, info = recursive.convert(cfg, v, 'explicit', 0, 'extend', lora_rank=2,
                                     lora_targets=('q', 'v'), untie_norms=True,
                                     select=recursive.Selection(insert_after='5,2'))
  assert info['pattern'] == '0,1,2,2,3,4,5,5,6,7'
  assert ncfg.num_layers == 10 and ncfg.plan.num_unique == 8
  np.testing.assert_allclose(_logits(ncfg, nv, tokens), ref, atol=1e-5)
  more, mv, _ = recursive.convert(cfg, v, 'explicit', 0, 'extend',
                                  select=recursive.Selection(insert_after='0'))
  assert np.abs(_logits(more, mv, tokens) - ref).max() > 1e-3   # a working block, repeated


@pytest.mark.parametrize('init, select, match', [
    ('similar', dict(remove_rate=1.5), r'config.remove_rate=1.5 of 8 layers .*valid: 0 < '),
    ('similar', dict(remove_rate=0.01), r'selects 0 blocks'),
    ('similar', dict(remove_rate=0.25, importance='size'), "importance='size' is unknown"),
    ('similar', dict(remove_rate=0.25, gate_steps=0), 'gate_steps=0'),
    ('similar', dict(replace_rate=0.25), 'replace_rate=0.25 with config.init=similar'),
    ('replace', dict(), 'replace_rate=0.0 with config.init=replace'),
    ('extend', dict(insert_after='8'), r"insert_after='8'; valid: .* 0..7"),
    ('similar', dict(insert_after='1'), 'belong to init=extend'),
])
def test_bad_block_choices_are_one_line(eight, init, select, match):
  cfg, v, tokens, _ = eight
  with pytest.raises(ConfigError, match=match) as e:
    recursive.convert(cfg, v, 'explicit', 4, init, calibration=tokens,
                      select=recursive.Selection(**select))
  assert '\n' not in str(e.value)


def test_gates_refuse_the_peri_placement(tiny_config):
  cfg = ModelConfig.from_config(tiny_config(**{'model.norm.placement': 'peri'}).model)
  with pytest.raises(ConfigError, match='config.importance=influence'):
    block_select.gate_importance(cfg, None, np.zeros((1, 4), np.int32), 1, 0.1, 0.0)
