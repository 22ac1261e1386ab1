"""The parameter bank (model.bank.*, models/bank.py; Shapeshifter Networks, arXiv:2006.10598):
the generated kernels against a numpy restatement of the definition, the stored count against
the budget below and above the model's own size, muP's rule for the bank, and bad sizes."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, accounting, init_variables
from sharenet.models import scaling
from sharenet.parametrization import rules as P

D, H, F, L = 32, 2, 48, 3
# kernel name -> (path below the block, reader?, the columns one template takes)
KERNELS = {'q': (('attn', 'q'), True, D), 'k': (('attn', 'k'), True, D),
           'v': (('attn', 'v'), True, D), 'o': (('attn', 'o'), False, D),
           'wi': (('mlp', 'wi'), True, F), 'wo': (('mlp', 'wo'), False, F)}
MODEL_KERNELS = L * (4 * D * D + 2 * D * F)   # the untied model's block kernels


def _cfg(**kw):
  base = dict(vocab_size=64, d_model=D, num_layers=L, num_heads=H, mlp_dim=F, mlp='gelu',
              remat='none')
  return ModelConfig(**base).derive(**kw)


def _block(path):
  return tuple(path[path.index('block') + 1:]) if 'block' in path else None


def _templates(bank, n, reader):
  """The definition, restated: ceil(C / n) windows of n consecutive columns, the first at
  column 0 and the last ending at column C, evenly spaced (rounded); a writer's window is
  transposed and scaled by sqrt(D / n)."""
  C = bank.shape[1]
  S = math.ceil(C / n)
  starts = [0] if S == 1 else [int(np.round(s * (C - n) / (S - 1))) for s in range(S)]
  if reader:
    return [bank[:, a:a + n] for a in starts]
  return [bank[:, a:a + n].T * math.sqrt(D / n) for a in starts]


@pytest.mark.slow
@pytest.mark.parametrize('columns', [100, 500])   # below and above the model's kernels
def test_generated_kernels_are_the_restated_combinations(columns):
  """Each stored set's kernel W = sum_s c_s T_s from the numpy templates, put in an untied
  model, gives the bank model's logits (float64)."""
  with jax.enable_x64(True):
    kw = dict(dtype='float64', param_dtype='float64')
    cfg, untied = _cfg(bank=dict(size=D * columns), **kw), _cfg(**kw)
    v = flatten_dict(init_variables(DecoderLM(cfg), jax.random.key(0)))
    v = {p: x + 0.1 * jax.random.normal(jax.random.key(i), x.shape, x.dtype)   # off the init
         for i, (p, x) in enumerate(sorted(v.items()))}
    bank = np.asarray(v[('params', 'bank', 'bank')])
    u = flatten_dict(init_variables(DecoderLM(untied), jax.random.key(1)))
    for p in u:
      name = p[-2] if p[-1] == 'kernel' and _block(p) else None
      if name is None:
        u[p] = v[p]
        continue
      path, reader, n = KERNELS[name]
      coef = np.asarray(v[p[:-1] + ('masa_coef',)])           # (sets, S)
      T = _templates(bank, n, reader)
      assert coef.shape == (L, len(T))
      u[p] = jnp.asarray(np.stack([sum(c * t for c, t in zip(row, T)) for row in coef])
                         .reshape(u[p].shape))
    toks = jax.random.randint(jax.random.key(7), (2, 10), 0, 64)
    np.testing.assert_allclose(DecoderLM(cfg).apply(unflatten_dict(v), toks),
                               DecoderLM(untied).apply(unflatten_dict(u), toks),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize('columns', [60, 200, 500])
def test_the_bank_holds_the_budget_below_and_above_the_model(columns):
  """The bank stores exactly model.bank.size parameters at any budget (60 x 32 is under a
  tenth of the block kernels, 500 x 32 above them); the per-set mappings add
  ceil(C / n_p) scalars per kernel; every generated kernel's FLOPs are the untied model's;
  a training loss's gradient reaches the bank and every mapping."""
  size = D * columns
  cfg = _cfg(bank=dict(size=size), sharing=dict(scheme='cycle', num_unique=1))
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  flat = flatten_dict(v['params'])
  assert flat[('bank', 'bank')].size == size
  assert not [p for p in flat if p[-1] == 'kernel' and _block(p)]
  mappings = sum(math.ceil(columns / n) for _, _, n in KERNELS.values())   # one stored set
  plain = _cfg(sharing=dict(scheme='cycle', num_unique=1))
  n_plain = accounting.params_unique(init_variables(DecoderLM(plain), jax.random.key(0)))
  kernels = MODEL_KERNELS // L                                             # one stored set
  assert accounting.params_unique(v) == n_plain - kernels + size + mappings
  assert accounting.matmul_params_per_layer(cfg) == accounting.matmul_params_per_layer(plain)
  toks = jax.random.randint(jax.random.key(7), (2, 11), 0, 64)

  def loss(params):
    logits = DecoderLM(cfg).apply({'params': params}, toks[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))

  grads = flatten_dict(jax.grad(loss)(v['params']))
  reached = {p: float(jnp.max(jnp.abs(g))) for p, g in grads.items()
             if p[0] == 'bank' or p[-1] == 'masa_coef'}
  assert len(reached) == 1 + len(KERNELS) and min(reached.values()) > 0, reached


def test_generated_kernels_start_at_their_default_scale():
  """Readers and writers start near their own default std fan_in^-1/2 (writers through the
  constant sqrt(d_model / n))."""
  cfg = _cfg(d_model=128, num_heads=4, mlp_dim=512, bank=dict(size=128 * 2048))
  model = DecoderLM(cfg)
  v = init_variables(model, jax.random.key(0))
  atoms = model.apply(v, method=lambda m: m.atoms())
  coef = {p[-2]: x for p, x in flatten_dict(v['params']).items() if p[-1] == 'masa_coef'}
  for name, fan_in in (('q', 128), ('wi', 128), ('o', 128), ('wo', 512)):
    w = jnp.tensordot(coef[name][0], atoms[name], axes=1)
    assert float(jnp.std(w)) == pytest.approx(fan_in ** -0.5, rel=0.05), name


def test_mup_reads_the_bank_as_a_hidden_matrix():
  """Its columns scale with the width: at base width 16 the base model's bank has half the
  columns, and muP gives the bank the hidden rule (Adam LR x base / width, SP init)."""
  from sharenet.models.scaling import Settings
  cfg = _cfg(bank=dict(size=D * 100), parametrization=Settings(kind='mup', base_d_model=16))
  assert scaling.base_config(cfg).bank.size == 16 * 50
  rule = P.Parametrization(cfg).rules[('params', 'bank', 'bank')]
  assert rule.role == 'hidden' and rule.lr_mult == pytest.approx(0.5)
  assert rule.init_std == pytest.approx(D ** -0.5)


@pytest.mark.parametrize('bank, match', [
    (dict(size=D * 100 + 3), r'model.bank.size=3203 is not a multiple of d_model=32 .*valid: '
                             r'e.g. 3200'),
    (dict(size=D * 40), r'model.bank.size=1280 is smaller than the largest matrix a layer '
                        r'generates from it \(mlp_in: 32 x 48 = 1536\); valid: model.bank.size '
                        r'>= 1536'),
    (dict(size=D * 40, targets='q,k'), None),
    (dict(size=-1), r'model.bank.size=-1 must be >= 0'),
    (dict(size=D * 100, targets='q,ffn'), r"model.bank.targets='ffn'"),
])
@pytest.mark.slow
def test_bad_bank_settings_are_one_line(bank, match):
  if match is None:   # attention-only targets need D x D columns at most
    _cfg(bank=bank)
    return
  with pytest.raises(ConfigError, match=match) as e:
    _cfg(bank=bank)
  assert '\n' not in str(e.value)
