"""model.dense_grad: the flattened-rows weight gradient (layers.matmul_rows) is the same gradient
as jax's own transpose rule, for the function and for whole models (tied plans, LoRA, remat)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict

from sharenet import kernels
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, init_variables
from sharenet.models.layers import matmul_rows


def test_matmul_rows_has_the_product_and_gradients_of_x_at_w():
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (3, 5, 16))      # leading batch axes are flattened into rows
  w = jax.random.normal(kw, (16, 24))
  g = jax.random.normal(kg, (3, 5, 24))
  y, vjp = jax.vjp(matmul_rows, x, w)
  y_ref, vjp_ref = jax.vjp(lambda a, b: a @ b, x, w)
  np.testing.assert_allclose(y, y_ref, rtol=1e-6)
  (dx, dw), (dx_ref, dw_ref) = vjp(g), vjp_ref(g)
  # independent: dw = sum over rows of outer(x_row, g_row); dx = g w^T
  dw_np = np.einsum('abi,abo->io', np.asarray(x, np.float64), np.asarray(g, np.float64))
  np.testing.assert_allclose(dw, dw_np, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)


def _loss_and_grads(cfg, toks):
  model = DecoderLM(cfg)
  variables = init_variables(model, jax.random.key(0))

  def loss(v):
    logits = model.apply(v, toks[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()
  return jax.jit(jax.value_and_grad(loss))(variables)


@pytest.mark.slow
@pytest.mark.parametrize('extra', [
    dict(sharing=dict(scheme='untied'), remat='dots'),
    dict(sharing=dict(scheme='cycle', repeats=2, lora_rank=2, untie_norms=True, lora_layers='all',
                      lora_targets=('q', 'v', 'mlp_in', 'mlp_out')), remat='dots_no_batch'),
    dict(sharing=dict(scheme='middle_cycle', repeats=2), remat='none', num_kv_heads=2,
         scan_lowering='flat'),
])
def test_rows_and_xla_weight_gradients_agree_on_whole_models(extra):
  base = dict(vocab_size=64, d_model=32, num_layers=6, num_heads=4, mlp_dim=48)
  toks = jax.random.randint(jax.random.key(1), (2, 13), 0, 64)
  loss_x, g_x = _loss_and_grads(ModelConfig(**base, **extra, dense_grad='xla'), toks)
  loss_r, g_r = _loss_and_grads(ModelConfig(**base, **extra, dense_grad='rows'), toks)
  np.testing.assert_allclose(loss_r, loss_x, rtol=1e-6)
  flat_x, flat_r = flatten_dict(g_x), flatten_dict(g_r)
  assert flat_x.keys() == flat_r.keys()
  for path, gx in flat_x.items():
    scale = float(jnp.max(jnp.abs(gx))) + 1e-30
    assert float(jnp.max(jnp.abs(flat_r[path] - gx))) / scale <= 1e-5, path


def test_dense_grad_auto_means_rows_on_cpu_and_bad_values_are_one_line_errors():
  assert kernels.backend() == 'cpu'
  assert kernels.rows_weight_grad('auto') and kernels.rows_weight_grad('rows')
  assert not kernels.rows_weight_grad('xla')
  with pytest.raises(ConfigError, match=r"model.dense_grad='fast' is unknown; valid: auto, xla, "
                                        r"rows"):
    ModelConfig(dense_grad='fast')
