"""u-muP (Blake et al., "u-muP: The Unit-Scaled Maximal Update Parametrization", arXiv:2407.17465).

Expectations are written out from the paper's scheme as its reference code states it
(graphcore-research/unit-scaling: optim.lr_scale_func_adam and scaled_parameters, _modules.Linear /
LinearReadout / Embedding / TransformerStack, functional.scaled_dot_product_attention /
cross_entropy / silu_glu, core.functional.transformer_residual_scaling_rule), never read back
from sharenet.models import scaling
from sharenet's implementation.
"""
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict

from sharenet.config import defaults
from sharenet.models import scaling
from sharenet.parametrization import rules as P
from sharenet.train import trainer
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.models import unit_scale


def tiny(d=32, L=4, **kw):
  base = dict(vocab_size=64, d_model=d, num_layers=L, num_heads=4, mlp_dim=3 * d // 2,
              sharing=dict(scheme='cycle', repeats=2), remat='none')
  return ModelConfig(**base).derive(**kw)


# ---- (a) the rule table -----------------------------------------------------------------------

def paper_rules(name, trunk, d, L, mlp_dim):
  """(init std, forward multiplier, Adam LR factor) of u-muP for one tensor.

  Every weight N(0, 1) (norm gains 1, biases 0); Linear forward 1/sqrt(fan_in), LinearReadout
  1/fan_in; Adam LR factors (lr_scale_func_adam): "weight" fan_in^-1/2 (an embedding's fan_in is
  its output width d), "norm"/"bias" 1, "output" 1, each times depth^-1/2 inside the
  DepthSequential stack (depth = transformer layers applied).
  """
  depth = L ** -0.5 if trunk else 1.0
  fan_in = {'wo': mlp_dim}.get(name, d)
  if name == 'embedding':
    return 1.0, 1.0, d ** -0.5
  if name in ('q', 'k', 'v', 'o', 'wi_gate', 'wi_up', 'wo'):
    return 1.0, fan_in ** -0.5, fan_in ** -0.5 * depth
  if name == 'readout':
    return 1.0, 1.0 / d, 1.0
  return None, 1.0, depth   # norm gains ("norm"), biases ("bias")


@pytest.mark.parametrize('d', [32, 128])
@pytest.mark.parametrize('L', [2, 6])
def test_rule_table_is_the_papers(d, L):
  cfg = tiny(d, L, reader_bias=True)
  pz = P.Parametrization(
      cfg.derive(parametrization=scaling.Settings('umup', base_d_model=16)))  # base: no effect
  seen = set()
  for path, r in pz.rules.items():
    name = path[-2] if path[-1] in ('kernel', 'scale') else path[-1]
    std, fwd, lr = paper_rules(name, 'stack' in path, d, L, cfg.mlp_dim)
    if name == 'bias':   # Linear scales (x W + b) as a whole: the kernel's forward multiplier
      fwd = paper_rules(path[-2], 'stack' in path, d, L, cfg.mlp_dim)[1]
    assert r.init_std == (None if std is None else pytest.approx(std, rel=1e-12)), path
    assert r.fwd_mult == pytest.approx(fwd, rel=1e-12), path
    assert r.lr_mult == pytest.approx(lr, rel=1e-12), path
    assert r.eps_mult == 1.0
    seen.add(name)
  assert {'embedding', 'q', 'o', 'wo', 'wi_up', 'readout', 'attn_norm', 'final_norm'} <= seen
  assert any(p[-1] == 'bias' and 'stack' in p for p in pz.rules)   # trunk biases covered
  c = pz.cfg
  assert c.attn_mult == pytest.approx(1.0 / c.d_head, rel=1e-12)   # mult / d_head, mult 1
  assert c.logits_mult == 1.0
  # transformer_residual_scaling_rule defaults residual_mult = residual_attn_ratio = 1:
  # alpha_mlp = 1 * sqrt(2 / (1 + 1)) = 1, alpha_attn = 1 * alpha_mlp.
  assert c.umup_residual == pytest.approx((1.0, 1.0), rel=1e-12) and c.umup_ops
  assert pz.loss_grad_scale == pytest.approx(64 / math.sqrt(63), rel=1e-12)
  assert pz.settings.independent_wd   # scaled_parameters(independent_weight_decay=True)
  assert pz.opt_multipliers().independent_wd


def test_weight_decay_auto_resolves_without_overriding_an_explicit_choice():
  assert defaults.default_config().parametrization.wd_mode == 'auto'
  assert scaling.Settings('umup').independent_wd
  assert not scaling.Settings('mup').independent_wd and not scaling.Settings('sp').independent_wd
  assert not scaling.Settings('umup', wd_mode='lr_coupled').independent_wd
  assert scaling.Settings('mup', wd_mode='independent').independent_wd
  # An old run's parametrization group (no residual keys) still builds.
  old = {'kind': 'umup', 'wd_mode': 'lr_coupled'}
  s = scaling.Settings.from_config(old)
  assert (s.residual_mult, s.residual_attn_ratio, s.independent_wd) == (1.0, 1.0, False)


@pytest.mark.parametrize('settings, cfg_kw, match', [
    (dict(wd_mode='decoupled'), {}, r"wd_mode='decoupled' is unknown; valid: auto, lr_coupled"),
    (dict(residual_mult=0.0), {}, r'residual_mult=0.0 must be > 0'),
    (dict(residual_attn_ratio=-1.0), {}, r'residual_attn_ratio=-1.0 must be > 0'),
    ({}, dict(norm=dict(placement='post')),
     r'kind=umup: u-muP.s residual rule needs pre or peri norms'),
    ({}, dict(sharing=dict(lora_rank=2)),
     r'u-muP defines no rule for depth-wise LoRA factors; valid'),
])
def test_bad_umup_settings_one_line_error(settings, cfg_kw, match):
  with pytest.raises(ConfigError, match=match) as e:
    P.Parametrization(tiny(**cfg_kw).derive(parametrization=scaling.Settings('umup', **settings)))
  assert '\n' not in str(e.value)


# ---- (d) the residual rule ----------------------------------------------------------------------

@pytest.mark.parametrize('mult, ratio', [(1.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize('L', [3, 8])
def test_residual_rule_contributions_are_the_papers(mult, ratio, L):
  """transformer_residual_scaling_rule's stated properties, from the taus alone: with
  x <- (x + tau f) / sqrt(1 + tau^2) and unit, independent branches, the final stream is unit;
  every attention branch contributes the same, every MLP branch the same; attention / MLP total
  = ratio^2; the average of the two totals / the embedding = mult^2."""
  alphas = unit_scale.residual_alphas(mult, ratio)
  taus = [unit_scale.residual_tau(i, L, alphas) for i in range(2 * L)]
  # Variance share of the embedding and of branch i in the final stream.
  after = lambda i: math.prod(1 / (1 + t ** 2) for t in taus[i + 1:])
  emb = after(-1)
  share = [taus[i] ** 2 / (1 + taus[i] ** 2) * after(i) for i in range(2 * L)]
  attn, mlp = share[0::2], share[1::2]
  assert emb + sum(share) == pytest.approx(1.0, rel=1e-12)
  np.testing.assert_allclose(attn, attn[0], rtol=1e-12)
  np.testing.assert_allclose(mlp, mlp[0], rtol=1e-12)
  assert sum(attn) / sum(mlp) == pytest.approx(ratio ** 2, rel=1e-12)
  assert (sum(attn) + sum(mlp)) / 2 / emb == pytest.approx(mult ** 2, rel=1e-12)


def test_residual_branch_forward_and_u_mup_backward():
  """residual_split / residual_add: forward (x + tau f(x)) / sqrt(1 + tau^2); the branch's own
  parameters get the unscaled output gradient (unit scaling delays tau / sqrt(1 + tau^2) to the
  branch input), the stream the true gradient."""
  tau, w = 0.3, 1.7
  x = jnp.asarray([0.4, -1.2, 2.0])
  denom = math.sqrt(1 + tau ** 2)
  out = lambda x, w: jnp.sum(unit_scale.residual_apply(lambda h: w * jnp.tanh(h), x, tau))
  np.testing.assert_allclose(out(x, w), jnp.sum((x + tau * w * jnp.tanh(x)) / denom), rtol=1e-6)
  gx, gw = jax.grad(out, argnums=(0, 1))(x, w)
  np.testing.assert_allclose(gx, (1 + tau * w * (1 - jnp.tanh(x) ** 2)) / denom, rtol=1e-6)
  np.testing.assert_allclose(gw, jnp.sum(jnp.tanh(x)), rtol=1e-6)   # not x tau / denom


@pytest.mark.slow
def test_shared_set_gets_one_tau_per_application():
  """The rule counts applied layers: a 2-set cycle applied twice == 4 untied layers holding the
  same weights (u-muP's TransformerStack of 4 slots)."""
  from sharenet.models import layout
  cfg = tiny(32, 4)
  pz = P.Parametrization(cfg.derive(parametrization=scaling.Settings('umup')))
  v = pz.forward(pz.init(init_variables(DecoderLM(pz.cfg), jax.random.key(0))))
  ucfg, uv = layout.to_untied(v, pz.cfg)
  toks = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
  np.testing.assert_allclose(DecoderLM(pz.cfg).apply(v, toks), DecoderLM(ucfg).apply(uv, toks),
                             rtol=1e-5, atol=1e-6)


# ---- (b) unit scale at init ---------------------------------------------------------------------

def _fake_lm():
  """A stand-in model whose `apply` returns the given logits (so d loss / d logits is a grad);
  unrouted, without experts and not recurrent, as loss_fn reads model.cfg.routing, .moe and
  .recurrent_segment."""
  return types.SimpleNamespace(apply=lambda params, tokens, mutable=(): (params, {}),
                               cfg=types.SimpleNamespace(
                                   routing=types.SimpleNamespace(kind='none'),
                                   moe=types.SimpleNamespace(kind='none', aux=False),
                                   recurrent_segment=None))


def logits_grad(logits_BTV, tokens_BT1, pz):
  """d trainer.loss_fn / d logits, the loss hook and reduction exactly as training uses them."""
  fake_pz = types.SimpleNamespace(loss_grad_scale=pz.loss_grad_scale, has_forward=False)
  f = lambda lg: trainer.loss_fn(lg, None, tokens_BT1, model=_fake_lm(), pz=fake_pz)[0]
  return jax.grad(f)(logits_BTV)


def init_rms(kind, d):
  """RMS per applied use at init: residual stream, attention and MLP outputs; logits gradient."""
  cfg = tiny(d, 2, num_heads=4)
  pz = P.Parametrization(cfg.derive(parametrization=scaling.Settings(kind, base_d_model=32)))
  model = DecoderLM(pz.cfg)
  v = pz.forward(pz.init(init_variables(model, jax.random.key(0))))
  toks = jax.random.randint(jax.random.key(1), (4, 65), 0, 64)
  logits, inter = model.apply(v, toks[:, :-1], capture_intermediates=True,
                              mutable=['intermediates'])
  flat = flatten_dict(inter['intermediates'])
  blk = ('stack', 'segment_0', 'level', 'block')
  stream = flat[blk + ('__call__',)][0][0].x_BTD   # the block's carry: a Stream
  rms = lambda a: np.sqrt(np.mean(np.square(np.asarray(a, np.float64)).reshape(
      -1, math.prod(a.shape[-3:])), axis=1))
  return dict(residual=rms(stream), attn=rms(flat[blk + ('attn', '__call__')][0]),
              mlp=rms(flat[blk + ('mlp', '__call__')][0]),
              logits_grad=rms(logits_grad(logits, toks, pz)[None]))


def _unit(values, tol):
  return bool(np.all((np.asarray(values) > 1 / tol) & (np.asarray(values) < tol)))


@pytest.mark.slow
@pytest.mark.parametrize('d', [64, 256])
def test_umup_is_unit_scaled_at_init_and_sp_mup_are_not(d):
  """RMS at init within a factor of 1: the residual stream, MLP outputs and logit gradients
  within 2; attention outputs within 1.5 in the first layer, where the values are independent
  across positions as u-muP's empirical attention model assumes, and within 2.5 in the next
  (its input already mixes positions, so the flat-softmax model over-scales: measured 2.1-2.3)."""
  got = init_rms('umup', d)
  for k in ('residual', 'mlp', 'logits_grad'):
    assert _unit(got[k], 2.0), (k, got[k])
  assert _unit(got['attn'][:1], 1.5) and _unit(got['attn'], 2.5), got['attn']
  for kind in ('sp', 'mup'):
    ctrl = init_rms(kind, d)
    # Plain mean cross entropy: logit gradients ~ sqrt(V - 1) / V / N; 1/d_head (mup) or SP
    # attention at init averages its values: output RMS ~0.3-0.4.
    assert not _unit(ctrl['logits_grad'], 2.0), (kind, ctrl)
    assert not _unit(ctrl['attn'][:1], 1.5), (kind, ctrl)


# ---- (c) loss gradient scale --------------------------------------------------------------------

def test_loss_value_is_cross_entropy_and_its_logit_gradient_unit_scaled():
  """u-muP cross_entropy: d loss / d logits = vocab / sqrt(vocab - 1) (softmax - onehot) per
  token (sum reduction in the backward, mean only in the value); the value is the true mean."""
  V, B, T = 64, 3, 5
  pz = P.Parametrization(tiny().derive(parametrization=scaling.Settings('umup')))
  logits = jax.random.normal(jax.random.key(0), (B, T, V))
  toks = jax.random.randint(jax.random.key(1), (B, T + 1), 0, V)
  fake_pz = types.SimpleNamespace(loss_grad_scale=pz.loss_grad_scale, has_forward=False)
  loss, _ = trainer.loss_fn(logits, None, toks, model=_fake_lm(), pz=fake_pz)
  p = jax.nn.softmax(logits.astype(jnp.float64) if jax.config.jax_enable_x64 else logits)
  onehot = jax.nn.one_hot(toks[:, 1:], V)
  want_loss = -jnp.mean(jnp.sum(onehot * jnp.log(p), axis=-1))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(logits_grad(logits, toks, pz), V / math.sqrt(V - 1) * (p - onehot),
                             rtol=1e-5, atol=1e-7)
  # Uniform logits: per-token gradient RMS exactly 1.
  g = logits_grad(jnp.zeros((B, T, V)), toks, pz)
  np.testing.assert_allclose(jnp.sqrt(jnp.mean(g ** 2, axis=-1)), 1.0, rtol=1e-5)
  # Evaluation and the other presets keep the plain mean loss and its gradient.
  sp = P.Parametrization(tiny().derive(parametrization=scaling.Settings('sp')))
  np.testing.assert_allclose(logits_grad(logits, toks, sp), (p - onehot) / (B * T), rtol=1e-5,
                             atol=1e-9)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:])
  np.testing.assert_allclose(loss, jnp.mean(nll), rtol=1e-6)


def test_attention_output_scale_is_the_papers_model():
  """scaled_dot_product_attention: 1 / log-interp(alpha = 1 / (1 + 4 d_head / mult^2),
  lower = sqrt(ln T / T) causal, upper = 1); d_head 16, T 64, mult 1 worked out by hand."""
  alpha = 1 / (1 + 64)
  lower = math.sqrt(math.log(64) / 64)
  want = 1 / (lower ** (1 - alpha))
  assert unit_scale.attention_output_scale(64, 16) == pytest.approx(want, rel=1e-12)
  assert unit_scale.attention_output_scale(64, 16, causal=False) == pytest.approx(
      8 ** (1 - alpha), rel=1e-12)
