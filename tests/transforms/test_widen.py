"""Growing a trained model wider (sharenet/transforms/widen.py, convert.py --config.to=wider):
the row-column draw restated in numpy, the function kept where the ansatz keeps it, the
parametrization's multipliers, and bad widths as one line."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables, param_table
from sharenet.transforms import widen

TOKENS = np.random.default_rng(0).integers(0, 256, (2, 12))


def _model(tiny_config, **over):
  """A tiny model with grouped-query attention, a cycle and depth-wise LoRA, every parameter
  moved off its init (unit gains and zero LoRA B would hide a wrong copy)."""
  cfg = ModelConfig.from_config(tiny_config(**{
      'model.num_layers': 4, 'model.num_heads': 4, 'model.num_kv_heads': 2,
      'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2,
      'model.sharing.lora_rank': 2, 'model.sharing.lora_targets': 'q,v,mlp_in', **over}).model)
  v = nn.unbox(init_variables(DecoderLM(cfg), jax.random.key(0), seq_len=16))
  leaves, tree = jax.tree.flatten(v)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  v = jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape)
                                for k, x in zip(keys, leaves)])
  return cfg, jax.device_get(v)


def _logits(cfg, v):
  return np.asarray(DecoderLM(cfg).apply(v, jnp.asarray(TOKENS)), np.float64)


@pytest.mark.slow
def test_doubling_keeps_the_function(tiny_config):
  """A multiple of the width: every unit copied equally, so the norms see the old stream tiled
  and the grown model (heads, kv groups, MLP, LoRA, readout) computes the same logits."""
  cfg, v = _model(tiny_config)
  new_cfg = widen.target(cfg, 2 * cfg.d_model)
  assert (new_cfg.num_heads, new_cfg.kv_heads, new_cfg.mlp_dim, new_cfg.d_head) == (
      8, 4, 2 * cfg.mlp_dim, cfg.d_head)
  grown = widen.widen(cfg, v, new_cfg)
  ref = _logits(cfg, v)
  np.testing.assert_allclose(_logits(new_cfg, grown), ref, atol=1e-4 * np.abs(ref).max())


def test_an_uneven_draw_keeps_every_matrix_product(tiny_config):
  """mlp_dim x 1.5 at the same d_model: units copied unequally (some once, some not), no norm
  reads the MLP width, so the function is kept by the multiplicity scaling alone; a d_model
  x 1.5 moves it (the norms see the resampled stream)."""
  cfg, v = _model(tiny_config)
  ref = _logits(cfg, v)
  mlp = widen.target(cfg, cfg.d_model, mlp_dim=cfg.mlp_dim * 3 // 2)
  np.testing.assert_allclose(_logits(mlp, widen.widen(cfg, v, mlp)), ref,
                             atol=1e-4 * np.abs(ref).max())
  wide = widen.target(cfg, cfg.d_model * 3 // 2)
  assert np.abs(_logits(wide, widen.widen(cfg, v, wide)) - ref).max() > 1e-3


def test_the_draw_restates_in_numpy(tiny_config):
  """Each grown kernel is the source gathered by sigma on each grown axis and divided by the
  copied unit's multiplicity on its fan-in axes: the MLP output (mlp in, embed out), the query
  (embed in, heads out) and the readout (embed in)."""
  cfg, v = _model(tiny_config)
  new_cfg = widen.target(cfg, cfg.d_model * 3 // 2)
  grown = widen.widen(cfg, v, new_cfg, seed=3)
  # the draw: the trained units first, then whole rounds, then a sample without replacement
  rng = np.random.default_rng(3)
  d, dn = cfg.d_model, new_cfg.d_model
  s_embed = np.concatenate([np.arange(d), np.sort(rng.choice(d, dn - d, replace=False))])
  m, mn = cfg.mlp_dim, new_cfg.mlp_dim
  s_mlp = np.concatenate([np.arange(m), np.sort(rng.choice(m, mn - m, replace=False))])
  n_embed, n_mlp = np.bincount(s_embed), np.bincount(s_mlp)
  table = param_table(cfg)
  get = lambda tree, path: tree[path[0]] if len(path) == 1 else get(tree[path[0]], path[1:])
  for path, info in table.items():
    if info.local[-2:] == ('wo', 'kernel') and path[0] == 'params':
      src, got = get(v, path), get(grown, path)   # (layers, mlp, embed)
      want = src[:, s_mlp][:, :, s_embed] / n_mlp[s_mlp][None, :, None]
      np.testing.assert_allclose(got, want, rtol=1e-6)
    if info.local[-2:] == ('q', 'kernel') and path[0] == 'params':
      src, got = get(v, path)[:, s_embed] / n_embed[s_embed][None, :, None, None], get(grown, path)
      assert got.shape[2] == new_cfg.num_heads
      np.testing.assert_allclose(got[:, :, :cfg.num_heads], src, rtol=1e-6)
    if info.role == 'readout':
      want = get(v, path)[s_embed] / n_embed[s_embed][:, None]
      np.testing.assert_allclose(get(grown, path), want, rtol=1e-6)
    if info.role == 'embedding':   # an output axis: copied, not scaled
      np.testing.assert_allclose(get(grown, path), get(v, path)[:, s_embed], rtol=1e-6)


@pytest.mark.parametrize('d_model,over,match', [
    (16, {}, 'needs d_model >= the source'),
    (36, {}, 'not divisible by the source\'s head_dim'),
    (32, {}, 'are the source\'s'),
    (40, {}, 'query heads per kv head'),      # 5 heads over groups of 2
    (64, {'num_heads': 6}, 'not divisible')])  # 6 x head_dim 8 is not 64
def test_bad_widths_are_one_line(tiny_config, d_model, over, match):
  cfg, _ = _model(tiny_config)
  with pytest.raises(ConfigError, match=match) as e:
    widen.target(cfg, d_model, **over)
  assert '\n' not in str(e.value)


@pytest.mark.slow
def test_convert_py_grows_a_mup_workdir_keeping_its_function(tmp_path, tiny_config):
  """convert.py --config.to=wider on a trained muP run (logits multiplier base / width): the
  grown workdir's effective weights compute the source's logits and its zero-shot loss is the
  source's; the wider run trains on (resume from the converted checkpoint)."""
  from sharenet.config import defaults
  from sharenet.main import convert_workdir
  from sharenet.train import loop, trainer, workdir_io
  src, out = str(tmp_path / 'src'), str(tmp_path / 'wide')
  loop.train_and_evaluate(tiny_config(**{'train.steps': 3, 'parametrization.kind': 'mup',
                                         'parametrization.base_d_model': 32}), src)
  opts = defaults.conversion_config()
  opts.to, opts.d_model = 'wider', 64
  info = convert_workdir.convert_workdir(src, out, opts)
  z = info['zero_shot']
  assert z['max_abs_logit_diff'] < 1e-4 and z['wider_loss'] == pytest.approx(
      z['source_loss'], abs=1e-5)
  logits = {}
  for w in (src, out):
    state, _, exp = workdir_io.restore_state(workdir_io.load_config(w), w)
    variables = trainer.effective_params(state, exp.tr, exp.pz)
    logits[w] = _logits(exp.model.cfg, variables)
  # muP at twice the base width: the logits and attention multipliers changed, and the grown
  # readout and queries carry the difference
  assert exp.model.cfg.d_model == 64 and exp.model.cfg.logits_mult == 0.5
  np.testing.assert_allclose(logits[out], logits[src], atol=1e-4)
  config = workdir_io.load_config(out)
  config.train.steps = 5
  final = loop.train_and_evaluate(config, out)
  assert np.isfinite(final['eval_loss'])
