"""The role table (sharenet/models/params.py): every leaf has a role; renaming a module changes
nothing."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models import scaling
from sharenet.optim import chain
from sharenet.parametrization import rules as P
from sharenet.models import DecoderLM, ModelConfig, init_variables, layers, lm, mlp, param_table
from sharenet.models.params import ROLES
from sharenet.transforms import convert


def _cfg(**kw):
  base = dict(vocab_size=64, d_model=32, num_layers=4, num_heads=4, mlp_dim=48, remat='none',
              sharing=dict(scheme='cycle', repeats=2))
  return ModelConfig(**base).derive(**kw)


@pytest.mark.slow
@pytest.mark.parametrize('kw', [
    dict(),
    dict(tie_embeddings=True, reader_bias=True),
    dict(sharing=dict(lora_rank=2, lora_targets=('q', 'k', 'v', 'o', 'mlp_in',
                                                 'mlp_out'), untie_norms=True)),
    dict(norm=dict(qk_norm='rms', kind='layernorm', placement='peri')),
    dict(norm=dict(qk_norm='l2', kind='dyt'), mlp='gelu', reader_bias=True),
    dict(norm=dict(kind='scalenorm'), position='learned', max_len=16, scan_lowering='flat'),
])
def test_every_trainable_leaf_has_a_role(kw):
  cfg = _cfg(**kw)
  table = param_table(cfg)
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  assert table.keys() == flatten_dict(v).keys()
  for path, info in table.items():
    assert info.role in ROLES and info.role != 'reparam', path
    assert 0 <= info.num_stack + info.num_in <= len(info.shape), path


def _rename_wo(monkeypatch, new_name):
  """Creates the MLP's output projection under another module name."""
  dense = layers.Dense

  def renamed(*args, name=None, **kw):
    return dense(*args, name=new_name if name == 'wo' else name, **kw)

  monkeypatch.setattr(mlp, 'Dense', renamed)
  lm.param_table.cache_clear()


def _renamed_view(tree, old, new):
  return {tuple(new if k == old else k for k in p): x for p, x in flatten_dict(tree).items()}


@pytest.fixture
def clean_table():
  lm.param_table.cache_clear()
  yield
  lm.param_table.cache_clear()


def _state(cfg, settings, xcfg, v0):
  """What a rename must not change: rule table, decay masks, and an ln_to_rms conversion."""
  pz = P.Parametrization(cfg.derive(parametrization=settings))
  v = jax.eval_shape(lambda: init_variables(DecoderLM(cfg), jax.random.key(0)))
  masks = {g: _renamed_view(chain.decay_mask(v, param_table(cfg), roles), 'down', 'wo')
           for g, roles in chain.DECAY_GROUPS.items()}
  renamed = {tuple('down' if k == 'wo' else k for k in p): x for p, x in v0.items()}
  names = {p for p in flatten_dict(init_variables(DecoderLM(xcfg), jax.random.key(0)))}
  src = unflatten_dict(renamed if names == renamed.keys() else v0)
  _, v1 = convert.ln_to_rms(xcfg, src)
  rules = {tuple('wo' if k == 'down' else k for k in p): r for p, r in pz.rules.items()}
  return rules, masks, _renamed_view(v1, 'down', 'wo'), src


@pytest.mark.slow
def test_renaming_a_projection_keeps_multipliers_masks_and_conversions(monkeypatch, clean_table):
  cfg = _cfg(d_model=64, mlp_dim=96)
  settings = scaling.Settings('completep', base_d_model=32, base_depth=1, loop_rule='inv_R')
  with jax.enable_x64(True):
    xcfg = _cfg(norm=dict(kind='layernorm'), dtype='float64', param_dtype='float64',
                position='learned', max_len=16)
    v0 = flatten_dict(init_variables(DecoderLM(xcfg), jax.random.key(0)))
    v0 = {p: x + 0.1 * jax.random.normal(jax.random.key(i), x.shape, x.dtype)
          for i, (p, x) in enumerate(v0.items())}   # non-trivial norm gains and biases
    rules0, masks0, conv0, _ = _state(cfg, settings, xcfg, v0)
    _rename_wo(monkeypatch, 'down')
    assert any('down' in p for p in param_table(cfg))
    rules1, masks1, conv1, src = _state(cfg, settings, xcfg, v0)
    assert rules1.keys() == rules0.keys() and masks1 == masks0 and conv1.keys() == conv0.keys()
    for path, r in rules1.items():
      assert dataclasses.replace(r, path=path) == rules0[path], path
    for path, x in conv1.items():
      assert bool(jnp.array_equal(x, conv0[path])), path
    toks = jax.random.randint(jax.random.key(7), (2, 10), 0, 64)
    cfg1, v1 = convert.ln_to_rms(xcfg, src)
    logits0, logits1 = DecoderLM(xcfg).apply(src, toks), DecoderLM(cfg1).apply(v1, toks)
    assert float(jnp.max(jnp.abs(logits1 - logits0))) <= 1e-9


def test_a_parameter_created_without_a_role_fails_loudly(monkeypatch, clean_table):
  class Bare(nn.Module):
    @nn.compact
    def __call__(self, x):
      w = self.param('kernel', nn.with_logical_partitioning(nn.initializers.ones,
                                                            ('mlp', 'embed')), (x.shape[-1], 32))
      return x @ w

  dense = layers.Dense

  def patched(*args, name=None, **kw):
    return Bare(name=name) if name == 'wo' else dense(*args, name=name, **kw)

  monkeypatch.setattr(mlp, 'Dense', patched)
  with pytest.raises(Exception, match='has no role'):
    P.Parametrization(_cfg().derive(parametrization=scaling.Settings('mup', base_d_model=16)))
