"""Mixture-of-Recursions routing (sharenet/models/routing.py, arXiv:2507.10524).

The invariants of expert choice and token choice are checked on the routing functions with a
token-wise stand-in for the K-layer scan and a fixed linear router (numpy recomputes what they
should do); the model-level tests use the real blocks. The 8-device run is this file's
`__main__` in a subprocess (as tests/train/test_sharding.py).
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.train import experiment, loop, trainer
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, accounting, init_variables, lm, routing
from sharenet.models.block import Shared, Stream
from sharenet.models.stack import Stack


def _stack(cfg, params, x, positions):
  """The layer stack of `cfg` alone: x (B, T, D) -> x."""
  return Stack(cfg).apply({'params': params}, Stream(x), Shared(positions))[0].x_BTD

B, T, D = 2, 16, 32


def tiny_cfg(**kw) -> ModelConfig:
  base = ModelConfig(d_model=D, num_layers=4, num_heads=2, mlp_dim=64, remat='none',
                     sharing=dict(scheme='cycle', num_unique=2), routing=dict(kind='expert_choice'))
  return base.derive(**kw)


class FixedRouter:
  """Router stand-in: logits = x . w[r] (expert choice) or x W^T (token choice)."""

  def __init__(self, w_RD):
    self.w_RD = jnp.asarray(w_RD)

  def expert_logits(self, x_BND, r):
    return x_BND @ self.w_RD[r]

  def token_logits(self, x_BTD):
    return jnp.einsum('btd,rd->btr', x_BTD, self.w_RD)


def tokenwise(x):
  """Token-wise stand-in for the K-layer stack (numpy and jax)."""
  return np.tanh(x) * 2.0 + 0.5 if isinstance(x, np.ndarray) else jnp.tanh(x) * 2.0 + 0.5


class RecordingLevel:
  """Stand-in for the K-layer scan: token-wise f (plus 0.01 x position), records its inputs."""

  def __init__(self):
    self.calls = []

  def __call__(self, x_BKD, pos_BK, seg_BK):
    self.calls.append((np.asarray(x_BKD), None if pos_BK is None else np.asarray(pos_BK),
                       None if seg_BK is None else np.asarray(seg_BK)))
    return tokenwise(x_BKD) + 0.01 * pos_BK[:, :, None].astype(x_BKD.dtype), None


def run_expert(cfg, seed=0, segment_ids=None):
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  w = rng.normal(size=(cfg.recursions, D)).astype(np.float32)
  level, sown = RecordingLevel(), {}
  out = routing.expert_choice(jnp.asarray(h), jnp.arange(T), segment_ids, cfg=cfg,
                              router=FixedRouter(w), level=level,
                              sow=lambda k, v: sown.__setitem__(k, np.asarray(v)))
  return h, w, np.asarray(out), level.calls, sown


# ---- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize('overrides, match', [
    (dict(sharing=dict(scheme='untied', num_unique=0)), 'valid schemes: cycle, middle_cycle'),
    (dict(sharing=dict(scheme='sequence')), 'valid schemes: cycle, middle_cycle'),
    (dict(routing=dict(kind='mixture')), 'model.routing.kind'),
    (dict(routing=dict(router='conv')), 'model.routing.router'),
    (dict(routing=dict(capacity='0.5,1')), 'non-increasing'),
    (dict(routing=dict(capacity='1')), 'needs 2 fractions'),
    (dict(routing=dict(capacity='1,0')), r'in \(0, 1\]'),
    (dict(routing=dict(capacity='1,x')), 'comma list'),
    (dict(routing=dict(balancing='bias')), 'balancing=bias balances token choice'),
    (dict(routing=dict(kind='token_choice', balancing='bias', bias_rate=0.0)),
     'bias_rate=0.0'),
    (dict(routing=dict(kind='token_choice', capacity='1,0.5')), 'token_choice picks'),
    (dict(sharing=dict(lora_rank=2)), 'per-layer parts are not routed'),
    (dict(scan_lowering='flat'), 'scan_lowering=nested'),
    (dict(routing=dict(aux_loss=-0.5)), 'aux_loss=-0.5'),
    (dict(routing=dict(z_loss=-2.0)), 'z_loss=-2.0'),
    (dict(routing=dict(buckets=3)), r'1\.\.2 \(R = 2'),
    (dict(routing=dict(kind='token_choice', buckets=1)), 'token choice is one scan'),
])
def test_bad_routing_is_one_line_config_error(overrides, match):
  with pytest.raises(ConfigError, match=match) as e:
    tiny_cfg(**overrides)
  assert '\n' not in str(e.value)


def test_routing_keys_round_trip_and_default_is_none(tiny_config):
  c = tiny_config(**{'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 1,
                     'model.routing.kind': 'expert_choice', 'model.routing.capacity': '1,0.25'})
  mcfg = experiment.validate(c)
  assert (mcfg.routing.kind, mcfg.capacities, mcfg.router_alpha, mcfg.aux_loss_coeff,
          mcfg.z_loss_coeff) == ('expert_choice', (1.0, 0.25), 0.1, 0.001, 0.0)
  assert ModelConfig.from_config(mcfg.to_config()) == mcfg
  plain = experiment.validate(tiny_config())
  assert plain.routing.kind == 'none' and plain.routed_segment is None
  token = mcfg.derive(routing=dict(kind='token_choice', capacity=''))
  # The reference's configs (conf/pretrain/*mor_token*zloss_1e-5.yaml): alpha 1, coeff 0.1, z 1e-5.
  assert (token.router_alpha, token.aux_loss_coeff, token.z_loss_coeff) == (1.0, 0.1, 1e-5)


def test_capacity_warmup_steps_is_gone_and_old_workdirs_still_load(repo_root):
  """The key only ever trained at 0 (any other value was refused): it is no longer a key, and a
  workdir's config.json that carries it (written before) loads without it."""
  from sharenet.config import defaults
  from sharenet.train import workdir_io
  assert 'capacity_warmup_steps' not in defaults.default_config().model.routing
  work = os.path.join(repo_root, 'tests', 'fixtures', 'workdirs_v2', 'mor_token_choice')
  with open(os.path.join(work, 'config.json')) as f:
    assert json.load(f)['model']['routing']['capacity_warmup_steps'] == 0
  config = workdir_io.load_config(work)
  assert 'capacity_warmup_steps' not in config.model.routing
  assert experiment.validate(config).routing.kind == 'token_choice'


def test_example_config_validates(repo_root):
  sys.path.insert(0, repo_root)
  from configs import mor_tiny
  mcfg = experiment.validate(mor_tiny.get_config())
  assert (mcfg.routing.kind, mcfg.sharing.scheme, mcfg.recursions, mcfg.routed_segment) == \
      ('expert_choice', 'middle_cycle', 3, 1)


@pytest.mark.slow
def test_unrouted_model_has_no_router_and_sows_nothing():
  cfg = tiny_cfg(routing=dict(kind='none'))
  model = DecoderLM(cfg)
  v = init_variables(model, jax.random.key(0), 1, 8)
  assert 'router' not in v['params']['stack']['segment_0']
  _, sown = model.apply(v, jnp.zeros((1, 8), jnp.int32), mutable=[routing.ROUTING])
  assert not sown


def test_loop_by_loop_inference_of_a_routed_model_is_rejected():
  """Cached generation of routed models: tests/models/test_routed_decoding.py."""
  from sharenet.inference import loop_by_loop
  with pytest.raises(ConfigError, match='routing picks the loops'):
    loop_by_loop.check_recursive(DecoderLM(tiny_cfg()), {})


# ---- expert choice on the routing function --------------------------------------------------

@pytest.mark.slow
def test_expert_choice_subsets_counts_order_and_untouched_tokens():
  cfg = tiny_cfg(num_layers=6, sharing=dict(num_unique=2),
                 routing=dict(capacity='0.75,0.5,0.25'))  # R = 3
  h, w, out, calls, sown = run_expert(cfg)
  assert cfg.capacity_tokens(T) == (12, 8, 4)
  prev = [set(range(T))] * B
  touched = [set() for _ in range(B)]
  for r, (x, pos, seg) in enumerate(calls):
    assert x.shape == (B, cfg.capacity_tokens(T)[r], D) and seg is None
    for b in range(B):
      assert np.all(np.diff(pos[b]) > 0)                  # causal order, no repeats
      assert set(pos[b]) <= prev[b]                       # hierarchical subsets
      prev[b] = set(pos[b])
      touched[b] |= prev[b]
    np.testing.assert_allclose(sown[f'capacity_{r}'], cfg.capacity_tokens(T)[r] / T)
  for b in range(B):
    idle = sorted(set(range(T)) - touched[b])
    assert len(idle) == T - 12
    np.testing.assert_array_equal(out[b, idle], h[b, idle])   # bit for bit


@pytest.mark.slow
def test_expert_choice_matches_a_numpy_recomputation():
  """Top-k of alpha * sigmoid among the previous survivors, H <- H + g f(H); BCE of the logits
  against top-k membership, summed over the candidates, divided by batch x candidates; the
  z-loss (one logit per token: logsumexp = the logit) the mean squared logit of the candidates
  (the reference's router_z_loss, expert_choice_router.py)."""
  cfg = tiny_cfg(routing=dict(capacity='0.5,0.25'))
  h, w, out, _, sown = run_expert(cfg, seed=1)
  want = h.astype(np.float64).copy()
  bce, z = np.zeros(2), np.zeros(2)
  for b in range(B):
    cand = np.arange(T)
    for r, k in enumerate((8, 4)):
      logits = want[b, cand] @ w[r]
      gate = 0.1 / (1 + np.exp(-logits))
      top = np.sort(np.argsort(-gate, kind='stable')[:k])
      member = np.isin(np.arange(len(cand)), top).astype(np.float64)
      bce[r] += np.sum(np.maximum(logits, 0) - logits * member +
                       np.log1p(np.exp(-np.abs(logits)))) / (B * len(cand))
      z[r] += np.sum(logits ** 2) / (B * len(cand))
      sel = cand[top]
      f = np.tanh(want[b, sel]) * 2 + 0.5 + 0.01 * sel[:, None]
      want[b, sel] += gate[top][:, None] * f
      cand = sel
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  for r in range(2):
    np.testing.assert_allclose(sown[f'aux_loss_{r}'], bce[r], rtol=1e-5)
    np.testing.assert_allclose(sown[f'z_loss_{r}'], z[r], rtol=1e-5)


def test_mlp_router_uses_the_exact_gelu():
  """The reference's MLPRouter is Linear -> torch nn.GELU() (erf form) -> Linear."""
  import math
  rng = np.random.default_rng(4)
  x = rng.normal(size=(B, 5, D))
  w_in, w = rng.normal(size=(3, D, 2 * D)) / D ** 0.5, rng.normal(size=(3, 2 * D))
  with jax.enable_x64(True):
    got = np.asarray(routing.expert_logits((jnp.asarray(w_in), jnp.asarray(w)),
                                           jnp.asarray(x), 1))
  z = x @ w_in[1]
  gelu = 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
  np.testing.assert_allclose(got, gelu @ w[1], rtol=1e-12, atol=1e-12)


def test_expert_choice_passes_segment_ids_of_the_kept_tokens():
  cfg = tiny_cfg(routing=dict(capacity='0.5,0.5'))
  seg = jnp.asarray(np.repeat(np.arange(4), 4)[None].repeat(B, 0) + 10 * np.arange(B)[:, None])
  _, _, _, calls, _ = run_expert(cfg, segment_ids=seg)
  for _, pos, s in calls:
    np.testing.assert_array_equal(s, np.take_along_axis(np.asarray(seg), pos, axis=1))


def test_buckets_group_the_recursions_larger_groups_last():
  cfg = tiny_cfg(num_layers=10, sharing=dict(num_unique=2))                               # R = 5
  assert cfg.expert_buckets == ((0,), (1,), (2,), (3,), (4,))
  got = {n: cfg.derive(routing=dict(buckets=n)).expert_buckets
         for n in (1, 2, 3, 5)}
  assert got == {1: ((0, 1, 2, 3, 4),), 2: ((0, 1), (2, 3, 4)), 3: ((0,), (1, 2), (3, 4)),
                 5: ((0,), (1,), (2,), (3,), (4,))}


@pytest.mark.parametrize('buckets', [1, 2, 4])
def test_bucketed_expert_choice_pads_and_equals_one_scan_per_recursion(buckets):
  """Bucketed: each recursion of a bucket runs the bucket's first k tokens, those out of the
  recursion each their own attention segment; outputs and aux losses equal the per-recursion
  lowering, and the tokens that run (own segment or not) are the same subsets."""
  cfg = tiny_cfg(num_layers=8, sharing=dict(num_unique=2),
                 routing=dict(capacity='0.75,0.5,0.5,0.25'))  # R = 4
  seg = jnp.asarray(np.repeat(np.arange(2), 8)[None].repeat(B, 0))
  _, _, want, want_calls, want_sown = run_expert(cfg, seed=3, segment_ids=seg)
  bucketed = cfg.derive(routing=dict(buckets=buckets))
  _, _, got, calls, sown = run_expert(bucketed, seed=3, segment_ids=seg)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert sown.keys() == want_sown.keys()
  for k in sown:
    np.testing.assert_allclose(sown[k], want_sown[k], rtol=1e-6, atol=1e-7)
  ks = cfg.capacity_tokens(T)
  r = 0
  for bucket in bucketed.expert_buckets:
    for _ in bucket:
      x, pos, s = calls[r]
      assert x.shape == (B, ks[bucket[0]], D)                  # padded to the bucket's first k
      _, want_pos, want_seg = want_calls[r]
      for b in range(B):
        running = s[b] >= 0                                   # the others are alone (< 0)
        np.testing.assert_array_equal(pos[b, running], want_pos[b])
        np.testing.assert_array_equal(s[b, running], want_seg[b])
        assert len(set(s[b, ~running])) == (~running).sum()
      r += 1
  assert r == len(calls) == 4


@pytest.mark.slow
def test_bucketed_model_equals_the_per_recursion_model_with_gradients():
  """The model under buckets 1 and 2: same loss, aux losses (BCE and z-loss, both weighted into
  the loss) and gradients (every router row included) as one scan per recursion, on one stored
  tree (float64)."""
  with jax.enable_x64(True):
    cfg = tiny_cfg(num_layers=6, sharing=dict(num_unique=2),
                   routing=dict(capacity='0.75,0.5,0.25', router='mlp',
                                z_loss=0.1), dtype='float64', param_dtype='float64')  # R = 3
    v = jax.jit(lambda: init_variables(DecoderLM(cfg), jax.random.key(0), B, T))()
    batch = jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg.vocab_size)

    def run(c):   # one compiled program per config (op by op, ~700 small compiles)
      model = DecoderLM(c)
      (loss, metrics), g = jax.jit(jax.value_and_grad(
          lambda p: trainer.loss_fn(p, {}, batch, model=model), has_aux=True))(v)
      return loss, metrics, g
    loss0, m0, g0 = run(cfg)
    for n in (1, 2):     # ((0, 1, 2),) and ((0,), (1, 2)); all singletons: the test above
      c = cfg.derive(routing=dict(buckets=n))
      assert jax.tree.structure(jax.eval_shape(
          lambda: init_variables(DecoderLM(c), jax.random.key(0), B, T))) == \
          jax.tree.structure(v)
      loss, m, g = run(c)
      np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-12)
      for k in m0:
        if k.startswith('routing_'):
          np.testing.assert_allclose(float(m[k]), float(m0[k]), rtol=1e-10, atol=1e-14)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12), g, g0)


# ---- token choice on the routing function ---------------------------------------------------

def token_choice_numpy(h, w, alpha, bias=0.0):
  """Token choice recomputed in float64 with the token-wise stand-in: each token exits at
  argmax(alpha p + bias) and leaves with h + alpha p_exit f^(exit+1)(h). -> (outputs, logits,
  p, exits)."""
  logits = h.astype(np.float64) @ w.T.astype(np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  exit_ = (alpha * p + bias).argmax(-1)
  want = np.empty(h.shape, np.float64)
  for b in range(h.shape[0]):
    for t in range(h.shape[1]):
      y = h[b, t].astype(np.float64)
      for _ in range(exit_[b, t] + 1):
        y = tokenwise(y)
      want[b, t] = h[b, t] + alpha * p[b, t, exit_[b, t]] * y
  return want, logits, p, exit_


def test_token_choice_exits_outputs_and_balancing_loss():
  cfg = tiny_cfg(num_layers=6, sharing=dict(num_unique=2),
                 routing=dict(kind='token_choice', alpha=0.7))  # R = 3
  R = cfg.recursions
  rng = np.random.default_rng(2)
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  w = rng.normal(size=(R, D)).astype(np.float32)
  seen, sown = [], {}

  def level(x, pos, seg):
    seen.append(np.asarray(seg))
    return tokenwise(x), None

  out = np.asarray(routing.token_choice(jnp.asarray(h), jnp.arange(T), None, cfg=cfg,
                                        router=FixedRouter(w), level=level,
                                        sow=lambda k, v: sown.__setitem__(k, np.asarray(v))))
  want, logits, p, exit_ = token_choice_numpy(h, w, 0.7)
  assert len(set(exit_.ravel())) > 1          # the check below sees more than one depth
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  frac = np.stack([(exit_ == i).mean() for i in range(R)])
  # The reference (token_choice_router.py): P_i = mean of router_probs = alpha * softmax,
  # f_i = R x exit fraction, loss sum_i P_i f_i; z-loss mean logsumexp(logits)^2.
  np.testing.assert_allclose(sown['aux_loss_0'], R * np.sum(0.7 * p.mean((0, 1)) * frac),
                             rtol=1e-5)
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(sown['z_loss_0'], np.mean(lse ** 2), rtol=1e-5)
  for r in range(R):
    active = exit_ >= r
    np.testing.assert_allclose(sown[f'capacity_{r}'], active.mean())
    assert np.all(seen[r][active] == 0)                            # one segment of the active
    np.testing.assert_array_equal(seen[r][~active], (-1 - np.arange(T))[None].repeat(B, 0)[~active])


def test_loss_free_bias_picks_the_exit_and_leaves_the_gate_unbiased():
  """Loss-free balancing (the reference's token_choice_router.py, balancing loss_free): the
  exit is argmax(alpha * p + b), the gate alpha * p_exit without b; exit_r sows the fractions."""
  cfg = tiny_cfg(num_layers=6, sharing=dict(num_unique=2),
                 routing=dict(kind='token_choice', balancing='bias', alpha=0.5))  # R = 3
  R = cfg.recursions
  rng = np.random.default_rng(6)
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  w = rng.normal(size=(R, D)).astype(np.float32)
  bias = np.array([-0.3, 0.05, 0.2], np.float32)        # moves some tokens off their top depth
  sown = {}
  out = np.asarray(routing.token_choice(jnp.asarray(h), jnp.arange(T), None, cfg=cfg,
                                        router=FixedRouter(w),
                                        level=lambda x, p, s: (tokenwise(x), None),
                                        sow=lambda k, v: sown.__setitem__(k, np.asarray(v)),
                                        bias_R=jnp.asarray(bias)))
  want, _, p, exit_ = token_choice_numpy(h, w, 0.5, bias)
  assert (exit_ != p.argmax(-1)).any()                   # the bias changed some exits
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  for r in range(R):
    np.testing.assert_allclose(sown[f'exit_{r}'], (exit_ == r).mean())
  assert cfg.aux_loss_coeff == 0.0    # the reference drops the balancing loss under loss_free


@pytest.mark.slow
def test_loss_free_bias_is_state_updated_by_sign_after_each_step():
  """The bias lives in TrainState.tstate at the model's own path, reaches the forward pass, is
  never trained, and after each step moves by rate * sign(1/R - f_i) (the reference's
  trainer_pt.py; rate 0.001 as its configs' u)."""
  cfg = tiny_cfg(num_layers=6, sharing=dict(num_unique=2),
                 routing=dict(kind='token_choice', balancing='bias'))
  model = DecoderLM(cfg)
  v = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  want = lm.initial_state(cfg)[routing.BALANCE]
  assert jax.tree.structure(v[routing.BALANCE]) == jax.tree.structure(want)
  import optax
  tx = optax.sgd(0.1)
  state = trainer.init_state(model, tx, jax.random.key(0))
  bias0 = state.tstate[routing.BALANCE]
  assert set(state.params) == {'params'}                  # not a trainable collection
  batch = jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg.vocab_size)
  step = jax.jit(lambda s, b: trainer.train_step(s, b, model=model, tx=tx))
  new, metrics = step(state, batch)
  f = np.array([float(metrics[f'routing_exit_{r}']) for r in range(3)])
  np.testing.assert_allclose(f.sum(), 1.0, rtol=1e-6)
  got = jax.tree.leaves(new.tstate[routing.BALANCE])[0]
  np.testing.assert_allclose(got, jax.tree.leaves(bias0)[0] + 0.001 * np.sign(1 / 3 - f))
  # The forward pass reads it: a bias that forces every token to depth 0 changes the loss.
  forced = jax.tree.map(lambda b: b + jnp.array([10.0, 0.0, 0.0]), new.tstate[routing.BALANCE])
  loss = lambda ts: float(trainer.loss_fn(new.params, ts, batch, model=model)[0])
  _, m = trainer.loss_fn(new.params, {routing.BALANCE: forced}, batch, model=model)
  assert float(m['routing_exit_0']) == 1.0
  assert loss({routing.BALANCE: forced}) != loss(new.tstate)


# ---- the real model --------------------------------------------------------------------------

@pytest.mark.slow
def test_full_capacity_is_the_gated_plain_recursion():
  """Capacity 1 everywhere: every recursion keeps all tokens in order, so the routed stack is
  h <- h + g_r F(h) with F the plain model's K-layer stack (the reference's update, whose F
  includes the residual); computed here from the plain model's Stack (float64)."""
  with jax.enable_x64(True):
    cfg = tiny_cfg(num_layers=4, sharing=dict(num_unique=2), routing=dict(capacity='1,1'),
                   dtype='float64', param_dtype='float64')
    plain = cfg.derive(num_layers=2, routing=dict(kind='none', capacity=''))
    model = DecoderLM(cfg)
    v = init_variables(model, jax.random.key(0), B, T)
    stack = v['params']['stack']
    h = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float64)
    got = _stack(cfg, stack, h, jnp.arange(T))
    plain_stack = {'segment_0': {'level': stack['segment_0']['level']}}
    want = h
    for r in range(2):
      f = _stack(plain, plain_stack, want, jnp.arange(T))
      g = 0.1 * jax.nn.sigmoid(want @ stack['segment_0']['router']['kernel'][r])
      want = want + g[:, :, None] * f
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_kept_tokens_attend_among_themselves_at_their_own_positions():
  """The K-layer pass of a kept subset equals the plain stack on that subsequence alone (so
  dropped tokens are invisible), with RoPE at the original positions (float64)."""
  with jax.enable_x64(True):
    cfg = tiny_cfg(num_layers=2, sharing=dict(num_unique=1), routing=dict(capacity='1,0.5'),
                   dtype='float64', param_dtype='float64')
    plain = cfg.derive(num_layers=1, routing=dict(kind='none', capacity=''))
    v = init_variables(DecoderLM(cfg), jax.random.key(0), B, T)
    stack = v['params']['stack']
    h = jax.random.normal(jax.random.key(3), (B, T, D), jnp.float64)
    plain_stack = {'segment_0': {'level': stack['segment_0']['level']}}
    run = lambda x, pos: _stack(plain, plain_stack, x, pos)
    got = np.asarray(_stack(cfg, stack, h, jnp.arange(T)))
    w = stack['segment_0']['router']['kernel']
    h1 = h + (0.1 * jax.nn.sigmoid(h @ w[0]))[:, :, None] * run(h, jnp.arange(T))
    g1 = np.asarray(0.1 * jax.nn.sigmoid(h1 @ w[1]))
    for b in range(B):
      keep = np.sort(np.argsort(-g1[b], kind='stable')[:8])
      f = run(h1[b:b + 1, keep], jnp.asarray(keep))[0]
      want = np.asarray(h1[b]).copy()
      want[keep] += g1[b, keep][:, None] * np.asarray(f)
      np.testing.assert_allclose(got[b], want, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_token_choice_model_runs_each_recursion_on_its_tokens_alone():
  """The routed model (one scan over recursions, masked at full length) equals running each
  recursion's active tokens as a subsequence alone through the plain K-layer stack at their
  original positions, exits leaving with x_in + alpha p_exit f (float64)."""
  with jax.enable_x64(True):
    cfg = tiny_cfg(num_layers=6, sharing=dict(num_unique=2), routing=dict(kind='token_choice'),
                   dtype='float64', param_dtype='float64')  # K = 2, R = 3
    plain = cfg.derive(num_layers=2, routing=dict(kind='none'))
    v = init_variables(DecoderLM(cfg), jax.random.key(0), B, T)
    stack = v['params']['stack']
    plain_stack = {'segment_0': {'level': stack['segment_0']['level']}}
    run = lambda x, pos: np.asarray(_stack(plain, plain_stack, x, pos))
    h = jax.random.normal(jax.random.key(4), (B, T, D), jnp.float64)
    got = np.asarray(_stack(cfg, stack, h, jnp.arange(T)))
    logits = np.asarray(h) @ np.asarray(stack['segment_0']['router']['kernel']).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    exit_ = p.argmax(-1)
    assert len(set(exit_.ravel())) == 3
    for b in range(B):
      cur, want = np.asarray(h[b]).copy(), np.zeros((T, D))
      for r in range(3):
        idx = np.where(exit_[b] >= r)[0]
        if not len(idx):
          break
        f = run(jnp.asarray(cur[idx])[None], jnp.asarray(idx))[0]
        for j, t in enumerate(idx):
          if exit_[b, t] == r:
            want[t] = np.asarray(h[b, t]) + p[b, t, r] * f[j]
        cur[idx] = f
      np.testing.assert_allclose(got[b], want, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize('kind, router', [('expert_choice', 'linear'), ('token_choice', 'mlp'),
                                          ('expert_choice', 'mlp')])
def test_gradients_reach_every_router(kind, router):
  cfg = tiny_cfg(num_layers=6, sharing=dict(num_unique=2), routing=dict(kind=kind, router=router))
  model = DecoderLM(cfg)
  v = init_variables(model, jax.random.key(0), B, T)
  batch = jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg.vocab_size)
  grads = jax.jit(jax.grad(lambda p: trainer.loss_fn(p, {}, batch, model=model)[0]))(v)
  for name, g in grads['params']['stack']['segment_0']['router'].items():
    g = np.asarray(g).reshape(g.shape[0], -1)
    assert np.all(np.abs(g).sum(axis=1) > 0), (name, np.abs(g).sum(axis=1))


@pytest.mark.slow
def test_training_loss_adds_the_weighted_aux_loss_and_eval_does_not():
  cfg = tiny_cfg(routing=dict(aux_loss=0.5, z_loss=0.25))
  model = DecoderLM(cfg)
  v = init_variables(model, jax.random.key(0), B, T)
  batch = jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg.vocab_size)
  loss, metrics = trainer.loss_fn(v, {}, batch, model=model)
  from sharenet.train import evaluation
  nll, _ = evaluation.token_nll(model, v, batch)
  aux = float(metrics['routing_aux_loss_0'] + metrics['routing_aux_loss_1'])
  z = float(metrics['routing_z_loss_0'] + metrics['routing_z_loss_1'])
  np.testing.assert_allclose(float(loss), float(jnp.mean(nll)) + 0.5 * aux + 0.25 * z,
                             rtol=1e-6)
  assert aux > 0 and z > 0


@pytest.mark.slow
def test_accounting_counts_kept_tokens_and_routers_once():
  cfg = tiny_cfg(num_layers=6, sharing=dict(num_unique=2), routing=dict(capacity='1,0.5,0.25'))
  v = init_variables(DecoderLM(cfg), jax.random.key(0), 1, T)
  plain = cfg.derive(routing=dict(kind='none', capacity=''))
  pv = init_variables(DecoderLM(plain), jax.random.key(0), 1, T)
  R, K = 3, 2
  assert accounting.params_unique(v) == accounting.params_unique(pv) + R * D
  assert accounting.params_applied(v, cfg) == accounting.params_applied(pv, plain) + R * D
  P = accounting.matmul_params_per_layer(cfg)
  HD = cfg.num_heads * cfg.d_head
  layer = lambda n: (n / T) * (2 * P + 2 * n * HD)
  want = 2 * D * cfg.vocab_size + sum(K * layer(n) for n in (16, 8, 4))
  want += 2 * D * (16 + 16 + 8) / T                        # routers score their candidates
  assert accounting.flops_per_token(cfg, T, train=False) == pytest.approx(want)
  assert accounting.flops_per_token(cfg, T) == pytest.approx(3 * want)
  # Bucketed (1 | 2: (0,), (1, 2)): each recursion of a bucket runs its first k tokens, and the
  # in-scan router scores them again.
  one = cfg.derive(routing=dict(buckets=1))
  want1 = 2 * D * cfg.vocab_size + 3 * K * layer(16) + 2 * D * (16 + 3 * 16) / T
  assert accounting.flops_per_token(one, T, train=False) == pytest.approx(want1)
  two = cfg.derive(routing=dict(buckets=2))
  want2 = 2 * D * cfg.vocab_size + K * layer(16) + 2 * K * layer(8)
  want2 += 2 * D * (16 + 16 + 16 + 2 * 8) / T
  assert accounting.flops_per_token(two, T, train=False) == pytest.approx(want2)
  full = cfg.derive(routing=dict(capacity='1,1,1'))
  assert accounting.flops_per_token(full, T, train=False) == pytest.approx(
      accounting.flops_per_token(plain, T, train=False) + 2 * D * 3)


@pytest.mark.slow
@pytest.mark.parametrize('kind, scheme', [('expert_choice', 'cycle'),
                                          ('token_choice', 'middle_cycle'),
                                          ('token_choice_bias', 'cycle')])
def test_five_training_steps(kind, scheme, tiny_config, losses, tmp_path):
  """Each router trains through train.py's loop (token_choice_bias: loss-free balancing, whose
  bias is checkpointed with the state and used by eval.py's code)."""
  from sharenet.main import eval_workdir
  from sharenet.train import workdir_io
  from sharenet.train.metrics import read_metrics
  balancing = 'bias' if kind == 'token_choice_bias' else 'loss'
  kind = 'token_choice' if balancing == 'bias' else kind
  c = tiny_config(**{'model.num_layers': 4 if scheme == 'cycle' else 5,
                     'model.sharing.scheme': scheme,
                     'model.sharing.num_unique': 2 if scheme == 'cycle' else 3,
                     'model.routing.kind': kind, 'model.routing.balancing': balancing,
                     'train.steps': 5, 'train.warmup_steps': 1, 'train.checkpoint_every': 5})
  out = loop.train_and_evaluate(c, str(tmp_path))
  got = losses(str(tmp_path))
  assert sorted(got) == [1, 2, 3, 4, 5]
  assert all(np.isfinite(list(got.values())))
  assert got[5] < got[1], got
  assert np.isfinite(out['eval_loss'])
  rows = [r for r in read_metrics(str(tmp_path)) if 'loss' in r]
  assert 'routing_aux_loss_0' in rows[-1] and 'routing_capacity_1' in rows[-1]
  config = json.load(open(tmp_path / 'config.json'))
  assert config['model']['routing']['kind'] == kind
  if balancing == 'bias':
    state = workdir_io.restore_state(workdir_io.load_config(str(tmp_path)), str(tmp_path)).state
    bias = np.asarray(jax.tree.leaves(state.tstate[routing.BALANCE])[0])
    # five sign steps of 0.001 from zero: an odd multiple of 0.001 in [-0.005, 0.005]
    assert np.allclose(np.abs(bias) * 1000 % 2, 1, atol=1e-4) and np.all(np.abs(bias) <= 0.0051)
    assert eval_workdir.evaluate_workdir(str(tmp_path))['eval_loss'] == pytest.approx(
        out['eval_loss'], rel=1e-6)


# ---- 8 simulated devices ---------------------------------------------------------------------

MESHES = {'data': {'data': 8}, 'data_fsdp_tensor': {'data': 2, 'fsdp': 2, 'tensor': 2},
          'data_expert': {'data': 2, 'expert': 4}}
MOE_KINDS = ('sigma_moe', 'switch', 'moeut')   # model.moe (models/moe.py) rides here too;
# moeut: sigma_moe with SwitchHead attention (4 experts per head) and MoEUT's norm placement


def _mesh_losses(out_path: str, tmp: str, corpus: str, kind: str, mesh: str) -> None:
  """Runs in a subprocess: 4 routed steps, on one device or on `mesh` over 8. `kind`
  'expert_choice_buckets' is expert choice in one bucketed scan (model.routing.buckets=1),
  'token_choice_bias' token choice with loss-free balancing (its bias replicated, updated from
  the global batch's exit fractions). A model.moe kind (MOE_KINDS) is an unrouted cycle with
  4 experts per block (sharded over mesh.expert in 'data_expert'; switch drops tokens at its
  capacity over the global batch; moeut also has 4 SwitchHead experts per head, sharded too)."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import conftest
  buckets = int(kind == 'expert_choice_buckets')
  balancing = 'bias' if kind == 'token_choice_bias' else 'loss'
  kind = {'expert_choice_buckets': 'expert_choice', 'token_choice_bias': 'token_choice'}.get(
      kind, kind)
  routed = kind if kind not in MOE_KINDS else 'none'
  c = conftest.make_tiny_config(**{
      'model.num_layers': 4, 'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2,
      'model.routing.kind': routed, 'model.routing.buckets': buckets,
      'model.routing.balancing': balancing,
      'model.routing.capacity': '0.5,0.25' if kind == 'expert_choice' else '',
      'model.moe.kind': ('sigma_moe' if kind == 'moeut' else kind) if kind in MOE_KINDS
      else 'none', 'model.moe.num_experts': 4, 'model.moe.capacity_factor': 1.0,
      'model.moe.attention': 'switchhead' if kind == 'moeut' else 'none',
      'model.moe.attention_experts': 4,
      'model.norm.placement': 'moeut' if kind == 'moeut' else 'pre',
      'data.source': 'bin', 'data.path': corpus,
      'train.steps': 4, 'train.batch_size': 8, 'train.schedule': 'constant',
      'train.warmup_steps': 0, 'train.checkpoint_every': 4})
  if jax.device_count() > 1:
    for axis, size in MESHES[mesh].items():
      c.mesh[axis] = size
  loop.train_and_evaluate(c, tmp)
  with open(out_path, 'w') as f:
    json.dump(conftest.read_losses(tmp), f)


# XLA:CPU's concurrency-optimized scheduler (on by default in jaxlib 0.10.2) deadlocks token
# choice's train step on 8 simulated devices with data=8: device threads wait at different
# all-reduces of one step until the rendezvous aborts. Reproduced every time on the 2-core CPU;
# --xla_cpu_enable_concurrency_optimized_scheduler=false makes it pass (docs/routing.md).
CPU_SCHEDULER_WORKAROUND = ' --xla_cpu_enable_concurrency_optimized_scheduler=false'


EIGHT = [('expert_choice', 'data'), ('token_choice_bias', 'data'),
         ('expert_choice_buckets', 'data_fsdp_tensor'), ('token_choice', 'data_fsdp_tensor'),
         ('moeut', 'data_expert'), ('switch', 'data_expert')]


@pytest.fixture(scope='module')
def eight_device_losses(tmp_path_factory, repo_root, subprocess_env):
  """{(kind, mesh): losses} of every EIGHT case on 8 simulated devices, one subprocess for all
  (JAX fixes the device count at start-up), and the random-token corpus they read."""
  tmp = tmp_path_factory.mktemp('eight')
  corpus = str(tmp / 'train.bin')
  np.random.default_rng(0).integers(0, 256, 60_000).astype(np.uint16).tofile(corpus)
  e = dict(subprocess_env)
  e['JAX_PLATFORMS'] = 'cpu'
  # 8 simulated devices on 2 cores: a slow device thread is not a hung collective
  e['XLA_FLAGS'] = (e.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
                    ' --xla_cpu_collective_timeout_seconds=900'
                    ' --xla_cpu_collective_call_terminate_timeout_seconds=900'
                    + CPU_SCHEDULER_WORKAROUND)
  res = subprocess.run([sys.executable, __file__, str(tmp), corpus], env=e, capture_output=True,
                       text=True, timeout=1800, cwd=repo_root)
  assert res.returncode == 0, res.stderr[-4000:]
  return {case: json.loads((tmp / f'{case[0]}-{case[1]}.json').read_text()) for case in EIGHT}, \
      corpus


@pytest.mark.slow
@pytest.mark.parametrize('kind, mesh', EIGHT)
def test_eight_devices_match_one(kind, mesh, eight_device_losses, tmp_path):
  """Routers replicated, the gathers along the sequence axis sharded with the activations: 8
  simulated devices give one device's losses (this process). Random tokens: on text, repeated
  tokens (indentation) give hidden states that are equal in exact arithmetic, so which of them
  a top-k keeps is decided by rounding, which differs between shardings (both choices are valid
  top-k's)."""
  losses, corpus = eight_device_losses
  out = tmp_path / 'one.json'
  _mesh_losses(str(out), str(tmp_path / 'run'), corpus, kind, mesh)
  want, got = json.loads(out.read_text()), losses[(kind, mesh)]
  assert len(want) == 4
  for step, w in want.items():
    assert abs(got[step] - w) <= 1e-5 * abs(w), (step, got[step], w)


if __name__ == '__main__':
  _tmp, _corpus = sys.argv[1:3]
  for _kind, _mesh in EIGHT:
    _mesh_losses(os.path.join(_tmp, f'{_kind}-{_mesh}.json'),
                 os.path.join(_tmp, f'run-{_kind}-{_mesh}'), _corpus, _kind, _mesh)
