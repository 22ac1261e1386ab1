"""Normalize-and-Project (Lyle et al., "Normalization and effective learning rates in
reinforcement learning", NeurIPS 2024, arXiv:2407.01800): a norm before each nonlinearity
(model.norm.pre_activation) and a post-step projection of each hidden weight matrix onto the
sphere of its initial Frobenius norm (transforms.project=nap)."""
import functools

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from sharenet.config import defaults
from sharenet.optim import chain
from sharenet.train import trainer
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, init_variables
from sharenet.models.config import ModelConfig
from sharenet.models.mlp import Mlp
from sharenet.transforms import Transforms
from sharenet.transforms.project import projection

KERNEL = 'kernel'


def _cfg(tiny_config, **model):
  c = tiny_config()
  c.model.norm.pre_activation = 'layernorm'
  for k, v in model.items():
    node = c.model
    *groups, leaf = k.split('.')
    for g in groups:
      node = node[g]
    node[leaf] = v
  return c


def _run(c, steps, data_seed=1):
  """(transforms, [params after 0..steps optimizer steps]) on a few fixed random batches."""
  model = DecoderLM(ModelConfig.from_config(c.model))
  tr = Transforms(c.transforms, model)
  tx = chain.make_optimizer(c.train, tr)
  state = trainer.init_state(model, tx, jax.random.key(0), tr)
  step = jax.jit(functools.partial(trainer.train_step, model=model, tx=tx, grad_accum=1, tr=tr))
  data = jax.random.randint(jax.random.key(data_seed), (4, 4, 33), 0, 256)
  out = [state.params]
  for i in range(steps):
    state, _ = step(state, data[i % len(data)])
    out.append(state.params)
  return tr, [{k: np.asarray(v) for k, v in flatten_dict(p).items()} for p in out]


def _frobenius(w, num_stack):   # one norm per stacked set, computed in float64
  w = np.asarray(w, np.float64)
  return np.sqrt((w.reshape(w.shape[:num_stack] + (-1,)) ** 2).sum(-1))


@pytest.mark.slow
def test_nap_holds_every_projected_norm_at_its_initial_value_after_every_step(tiny_config):
  c = _cfg(tiny_config, **{'norm.kind': 'layernorm', 'norm.qk_norm': 'rms'})
  c.transforms.project = 'nap'
  c.train.lr, c.train.weight_decay = 3e-2, 0.0
  tr, params = _run(c, 4)
  infos = tr.infos
  # The paper: every hidden weight matrix (here reader / writer kernels and the untied input
  # embedding), each layer separately.
  mats = [p for p, l in infos.items() if l.role in ('reader', 'writer', 'embedding')]
  # Norm gains and offsets inside blocks, jointly per norm module.
  groups = {}
  for p, l in infos.items():
    if l.role in ('norm_in', 'norm_out') and l.branch is not None:
      groups.setdefault(p[:-1], []).append(p)
  assert any('wi_gate' in p for p in mats) and any('gate_norm' in m for m in groups)
  assert all(len(v) == 2 for v in groups.values() if 'mlp_norm' in v[0])   # layernorm: gain+bias

  def norms(flat):
    out = [_frobenius(flat[p], infos[p].num_stack) for p in mats]
    for members in groups.values():
      n = infos[members[0]].num_stack
      out.append(np.sqrt(sum(_frobenius(flat[p], n) ** 2 for p in members)))
    return out

  n0 = norms(params[0])
  for i, flat in enumerate(params[1:], 1):
    for a, b in zip(norms(flat), n0):
      np.testing.assert_allclose(a, b, rtol=2e-5, err_msg=f'step {i}')
  # The parameters did move (the projection is not a frozen model).
  for p in mats:
    assert not np.allclose(params[0][p], params[-1][p])


def test_pre_activation_norm_makes_the_mlp_invariant_to_the_scale_of_its_input_kernels(
    tiny_config):
  x = jax.random.normal(jax.random.key(3), (2, 5, 32))
  for mlp in ('gelu', 'swiglu'):
    for kind in ('layernorm', 'rmsnorm', 'none'):
      c = _cfg(tiny_config, mlp=mlp, **{'norm.pre_activation': kind, 'norm.eps': 1e-12})
      cfg = ModelConfig.from_config(c.model)
      mod = Mlp(cfg)
      params = nn.unbox(mod.init(jax.random.key(0), x)['params'])
      y = mod.apply({'params': params}, x)
      scaled = {k: ({KERNEL: 7.0 * v[KERNEL]} if k.startswith('wi') else v)
                for k, v in params.items()}
      y7 = mod.apply({'params': scaled}, x)
      if kind == 'none':   # without the norm the kernels' scale reaches the output
        assert not np.allclose(y, y7, rtol=1e-2)
      else:
        # Each input kernel alone: N(c x W) = N(x W) for LayerNorm and RMSNorm.
        np.testing.assert_allclose(y7, y, rtol=1e-4, atol=1e-6, err_msg=f'{mlp}/{kind}')
        for name in [k for k in params if k.startswith('wi')]:
          one = {**params, name: {KERNEL: 0.2 * params[name][KERNEL]}}
          np.testing.assert_allclose(mod.apply({'params': one}, x), y, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('tie', [pytest.param(False, marks=pytest.mark.slow), True])
def test_nap_leaves_the_layers_the_paper_does_not_project_as_the_optimizer_left_them(
    tiny_config, tie):
  c = _cfg(tiny_config, reader_bias=True, tie_embeddings=tie,
           **{'norm.kind': 'dyt', 'norm.qk_norm': 'l2'})   # scalars: DyT alpha, logit scale
  c.transforms.project = 'nap'
  model = DecoderLM(ModelConfig.from_config(c.model))
  tr = Transforms(c.transforms, model)
  params = init_variables(model, jax.random.key(0))
  updates = jax.tree.map(lambda p: 0.3 * jax.random.normal(jax.random.key(5), p.shape), params)
  tx = projection('nap', tr.infos)
  projected, _ = jax.jit(tx.update)(updates, tx.init(params), params)
  raw, out, before = flatten_dict(updates), flatten_dict(projected), flatten_dict(params)
  # The final layer (readout, or the tied table), the final norm feeding it, biases, scalars.
  free = [p for p, l in tr.infos.items()
          if l.role in ('readout', 'bias') or (l.role == 'embedding' and tie)
          or (l.role == 'norm_out' and l.branch is None) or l.shape[l.num_stack:] == ()]
  assert any(tr.infos[p].role == 'bias' for p in free)
  assert any(p[-1] == 'alpha' for p in free) and any(p[-1] == 'qk_scale' for p in free)
  assert any(p[-2] == 'final_norm' for p in free)
  for p in free:   # the new values, up to the rounding of (params + update) - params
    np.testing.assert_allclose(before[p] + out[p], before[p] + raw[p], rtol=1e-6, atol=1e-7,
                               err_msg='/'.join(p))
  # ... while the hidden kernels are changed by it.
  hidden = [p for p, l in tr.infos.items() if l.role in ('reader', 'writer')]
  for p in hidden:
    assert not np.allclose(out[p], raw[p], rtol=1e-3), '/'.join(p)


def _angular_updates(tiny_config, project, steps, lr):
  """||W_{t+1} - W_t|| / ||W_t|| of the MLP gate kernel (scale-invariant under the
  pre-activation norm) and its norm, per step, averaged over layers."""
  c = _cfg(tiny_config)
  c.transforms.project = project
  # Constant LR, no decay; b1 = b2 = 0 makes Adam's step sign(g): a fixed-size update, so any
  # change of the angular step comes from ||W|| alone.
  c.train.update(lr=lr, schedule='constant', warmup_steps=0, weight_decay=0.0, b1=0.0, b2=0.0,
                 eps=1e-12, grad_clip=0.0)
  tr, params = _run(c, steps)
  (path,) = [p for p in tr.infos if p[-2] == 'wi_gate']
  n = tr.infos[path].num_stack
  ws = [flat[path] for flat in params]
  norms = np.stack([_frobenius(w, n) for w in ws])                       # (steps+1, layers)
  steps_ = np.stack([_frobenius(b - a, n) for a, b in zip(ws, ws[1:])])  # (steps, layers)
  return (steps_ / norms[:-1]).mean(-1), norms.mean(-1)


@pytest.mark.slow
def test_angular_update_stays_constant_with_nap_and_decays_as_the_norm_grows_without(
    tiny_config):
  steps, lr = 16, 0.06
  ang_nap, norm_nap = _angular_updates(tiny_config, 'nap', steps, lr)
  ang_free, norm_free = _angular_updates(tiny_config, 'none', steps, lr)
  early, late = slice(0, 4), slice(-4, None)
  # NaP: the norm is pinned, so the effective (angular) step keeps its size.
  np.testing.assert_allclose(norm_nap, norm_nap[0], rtol=1e-5)
  assert 0.85 < ang_nap[late].mean() / ang_nap[early].mean() < 1.15
  # Without projection the scale-invariant kernel's norm grows and its angular step shrinks
  # as 1 / ||W|| (the paper's implicit learning-rate decay).
  assert norm_free[-1] > 1.5 * norm_free[0]
  decay = ang_free[late].mean() / ang_free[early].mean()
  assert decay < 0.75
  np.testing.assert_allclose(decay, norm_free[early].mean() / norm_free[-5:-1].mean(),
                             rtol=0.1)


def test_nap_needs_the_pre_activation_norm_and_names_the_fix(tiny_config):
  c = tiny_config()
  c.transforms.project = 'nap'
  model = DecoderLM(ModelConfig.from_config(c.model))
  with pytest.raises(ConfigError, match='model.norm.pre_activation=layernorm or rmsnorm'):
    Transforms(c.transforms, model)
  Transforms({'project': 'norm_project'}, model)   # the projection alone stays available
  c.model.norm.pre_activation = 'batchnorm'
  with pytest.raises(ConfigError, match="model.norm.pre_activation='batchnorm' is unknown"):
    ModelConfig.from_config(c.model)


def test_runs_written_before_the_pre_activation_key_load_nap_as_norm_project(tiny_config):
  old = tiny_config().to_dict()
  del old['model']['norm']['pre_activation']
  old['transforms']['project'] = 'nap'
  assert defaults.complete(old).transforms.project == 'norm_project'
  new = tiny_config().to_dict()
  new['transforms']['project'] = 'nap'
  assert defaults.complete(new).transforms.project == 'nap'
