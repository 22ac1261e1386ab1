"""The output layer's operator norms (sharenet/train/output_norm.py) in the train step's metrics."""
import jax
import jax.numpy as jnp
import numpy as np

from sharenet.models import param_table
from sharenet.train import experiment, output_norm, trainer


def test_norms_are_the_rms_to_inf_norm_and_the_largest_singular_value():
  rng = np.random.default_rng(0)
  u, _ = np.linalg.qr(rng.standard_normal((16, 16)))
  v, _ = np.linalg.qr(rng.standard_normal((40, 16)))
  w = (u * np.asarray([5.0, 1.0] + [0.5] * 14)) @ v.T   # (d_in 16, vocab 40), a clear top value
  out = output_norm.norms(jnp.asarray(w, jnp.float32))
  want = np.sqrt(16) * np.max(np.linalg.norm(w, axis=0))   # max_v ||w_v||_2 sqrt(d_in)
  np.testing.assert_allclose(float(out['output_norm/rms_to_inf']), want, rtol=1e-5)
  np.testing.assert_allclose(float(out['output_norm/spectral']), 5.0, rtol=1e-4)


def test_the_step_reports_the_readout_as_the_model_applies_it(tiny_config):
  """muP at twice the base width (logits multiplier 1/2) and tied embeddings: the metric is
  the norm of the applied readout after the update."""
  for tie in (False, True):
    c = tiny_config(**{'model.d_model': 64, 'model.mlp_dim': 128,
                       'parametrization.kind': 'mup', 'parametrization.base_d_model': 32,
                       'model.tie_embeddings': tie})
    exp = trainer.setup(c, experiment.validate(c))
    state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
    batch = jnp.asarray(np.arange(4 * 33).reshape(4, 33) % 251, jnp.int32)
    new, metrics = jax.jit(trainer.make_train_step(exp))(state, batch)
    p = trainer.effective_params(new, exp.tr, exp.pz)['params']
    w = np.asarray(p['embed']['embedding']).T if tie else np.asarray(p['readout']['kernel'])
    w = w * exp.model.cfg.logits_mult
    assert exp.model.cfg.logits_mult == 0.5
    want = np.sqrt(64) * np.max(np.linalg.norm(w, axis=0))
    np.testing.assert_allclose(float(metrics['output_norm/rms_to_inf']), want, rtol=1e-5)
    assert 0 < float(metrics['output_norm/spectral']) <= np.linalg.norm(w, 2) * (1 + 1e-5)
