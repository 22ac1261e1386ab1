"""model.dtype=bfloat16 with float32 parameters (mixed precision).

The rule, checked on the jaxpr of the bf16 train step: every matmul (dot_general) takes bfloat16
operands; its result is bfloat16 except the readout's, whose logits come out float32 unrounded
(layers.einsum_f32, float32 accumulation). float32 activations appear only where they are meant
to: norm statistics, the attention softmax, the logits and the loss (and the embedding lookup,
which reads the float32 table so that its gradient scatter-adds in float32). No float64 anywhere.
Parameters and optimizer state stay float32 (model.param_dtype), so checkpoints move between
dtypes. The default config (CPU) stays float32.
"""
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from jax._src import source_info_util

from configs import default, tiny
from sharenet.train import experiment, loop, trainer
from sharenet.config import defaults
from sharenet.train.metrics import read_metrics

B, T = 3, 8   # no parameter has a dimension 3: a value with one in front is an activation


def test_default_config_computes_in_float32():
  for c in (defaults.default_config(), default.get_config(), tiny.get_config()):
    assert c.model.dtype == 'float32' and c.model.param_dtype == 'float32'


def _experiment(tiny_config, **overrides):
  c = tiny_config(**{'model.dtype': 'bfloat16', 'train.batch_size': B, 'train.seq_len': T,
                     **overrides})
  exp = trainer.setup(c, experiment.validate(c))
  state = trainer.abstract_state(exp.model, exp.tx, exp.tr, exp.pz)
  return c, exp, state


def test_parameters_and_optimizer_state_stay_float32(tiny_config):
  _, _, state = _experiment(tiny_config)
  floats = [x.dtype for x in jax.tree.leaves((state.params, state.opt_state))
            if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and set(floats) == {jnp.dtype('float32')}


# Where a float32 activation may come from: (file, function; None = any).
ALLOWED_F32 = {
    ('norms.py', 'Norm._norm'),                        # norm statistics (jnp path)
    ('attention.py', 'reference'),                     # the attention softmax (kernels/)
    ('lm.py', 'DecoderLM.__call__'),                   # logits
    ('einsum.py', 'einsum_f32'),                       # float32 logits and attention scores
    ('layers.py', 'Embed.__call__'),                   # lookup in the float32 table
    ('_classification.py', None),                      # optax cross entropy: the loss
    ('evaluation.py', 'token_nll'),
    ('evaluation.py', 'mean_nll'),                     # the loss's mean (over a loss mask)
    ('trainer.py', 'loss_fn'),
    ('trainer.py', '_loss'),                          # the loss (loss_fn's body)
}


def _eqns(jaxpr):
  """Every equation, descending into scan / remat / custom_vjp / pjit sub-jaxprs."""
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          yield from _eqns(inner)


def _where(e):
  frame = source_info_util.user_frame(e.source_info.traceback)
  return None if frame is None else (os.path.basename(frame.file_name), frame.function_name)


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_bf16_train_step_jaxpr(tiny_config, remat):
  c, exp, state = _experiment(tiny_config, **{'model.remat': remat})
  V = c.model.vocab_size
  batch = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
  jaxpr = jax.make_jaxpr(trainer.make_train_step(exp))(state, batch).jaxpr
  eqns = list(_eqns(jaxpr))
  bf16, f32 = jnp.dtype('bfloat16'), jnp.dtype('float32')
  dots = [e for e in eqns if e.primitive.name == 'dot_general']
  assert len(dots) > 10
  for e in dots:
    ins = [v.aval.dtype for v in e.invars]
    out = e.outvars[0].aval
    assert ins == [bf16, bf16], (ins, _where(e))
    # float32 results: the readout's logits [.., V] and the attention scores (rank 5: B, K and
    # the free dims T, S and G in dot_general's order).
    scores = out.ndim == 5 and list(out.shape[2:]).count(T) == 2
    assert out.dtype == bf16 or (out.dtype == f32 and (out.shape[-1] == V or scores)), (
        out, _where(e))
  assert any(e.outvars[0].aval.dtype == f32 and e.outvars[0].aval.shape[-1] == V
             for e in dots), 'the readout should give float32'
  assert any(e.outvars[0].aval.dtype == f32 and e.outvars[0].aval.ndim == 5
             for e in dots), 'the attention scores should be float32 (einsum_f32)'
  avals = [v.aval for e in eqns for v in (*e.invars, *e.outvars) if hasattr(v.aval, 'dtype')]
  assert not [a for a in avals if a.dtype == jnp.float64]
  # Ops with sub-jaxprs (scan, remat, custom_vjp) only pass on what their bodies computed,
  # and those bodies are checked; ops with no user frame are autodiff's transposes of checked
  # ones.
  stray = set()
  for e in eqns:
    if any(hasattr(getattr(p, 'jaxpr', p), 'eqns') for p in e.params.values()
                             if not isinstance(p, (list, tuple))):
      continue
    acts = [v.aval for v in e.outvars if getattr(v.aval, 'dtype', None) == f32
            and B in v.aval.shape[:2]]
    where = _where(e)
    if acts and where is not None and where not in ALLOWED_F32 and (where[0], None) not in \
        ALLOWED_F32:
      stray.add((*where, e.primitive.name))
  assert not stray, f'float32 activations outside norms / softmax / logits / loss: {stray}'


def _run(tiny_config, workdir, **overrides):
  return loop.train_and_evaluate(tiny_config(**overrides), str(workdir))


@pytest.mark.slow
def test_bf16_run_tracks_float32_for_50_steps(tiny_config, tmp_path, losses):
  # Observed on the tiny model: at most 0.002 nats apart over 50 steps (bf16 rounds to 8
  # significant bits, ~0.2 %). Bound: 0.02 nats per step, 0.01 on the final eval loss.
  common = {'train.steps': 50, 'train.checkpoint_every': 50}
  out32 = _run(tiny_config, tmp_path / 'f32', **common)
  out16 = _run(tiny_config, tmp_path / 'bf16', **common, **{'model.dtype': 'bfloat16'})
  l32, l16 = losses(str(tmp_path / 'f32')), losses(str(tmp_path / 'bf16'))
  assert sorted(l16) == list(range(1, 51))
  diffs = [abs(l32[s] - l16[s]) for s in range(1, 51)]
  assert max(diffs) <= 0.02, max(diffs)
  assert max(diffs) > 0, 'bit-identical to float32: the bf16 path did not run'
  assert l16[50] < l16[1] - 1.0
  assert abs(out16['eval_loss'] - out32['eval_loss']) <= 0.01


# The LR schedule must not depend on train.steps, so that a 10-step run resumed to 20 steps
# follows the same path as an uninterrupted 20-step run.
RESUME = {'train.schedule': 'constant', 'train.checkpoint_every': 10}


@pytest.fixture(scope='module')
def float32_reference(tmp_path_factory, tiny_config):
  workdir = tmp_path_factory.mktemp('f32_ref')
  loop.train_and_evaluate(tiny_config(**RESUME, **{'train.steps': 20}), str(workdir))
  return {r['step']: r['loss'] for r in read_metrics(str(workdir)) if 'loss' in r}


@pytest.mark.slow
@pytest.mark.parametrize('first, then', [('float32', 'bfloat16'), ('bfloat16', 'float32')])
def test_checkpoint_resumes_in_the_other_dtype(tiny_config, tmp_path, capsys, losses,
                                               float32_reference, first, then):
  _run(tiny_config, tmp_path, **RESUME, **{'train.steps': 10, 'model.dtype': first})
  state = ocp.CheckpointManager(os.path.join(tmp_path, 'checkpoints')).restore(
      10, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
  assert {x.dtype for x in jax.tree.leaves(state) if x.dtype.kind == 'f'} == {
      jnp.dtype('float32')}   # written as float32 whatever the compute dtype
  capsys.readouterr()
  _run(tiny_config, tmp_path, **RESUME, **{'train.steps': 20, 'model.dtype': then})
  out = capsys.readouterr().out
  assert 'resumed from checkpoint at step 10' in out
  note = [l for l in out.splitlines() if 'resuming with changed fields' in l]
  assert len(note) == 1 and f"model.dtype '{first}' -> '{then}'" in note[0]
  assert 'none changes the train state' in note[0]
  got = losses(str(tmp_path))
  assert sorted(got) == list(range(1, 21))
  ref = float32_reference
  for s in range(1, 21):
    assert abs(got[s] - ref[s]) <= 0.02, (s, got[s], ref[s])
  if first == 'float32':   # the first 10 steps are the reference run's own
    assert [got[s] for s in range(1, 11)] == [ref[s] for s in range(1, 11)]


def test_einsum_f32_keeps_the_product_unrounded_and_its_gradients_low_precision():
  from sharenet.models.layers import einsum_f32
  ka, kb, kg = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(ka, (3, 5, 16)).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (16, 7)).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (3, 5, 7))
  y, vjp = jax.vjp(lambda a, b: einsum_f32('...i,io->...o', a, b), a, b)
  # bf16 x bf16 products are exact in float32: only the summation order differs.
  exact = jnp.einsum('tsi,io->tso', a.astype(jnp.float32), b.astype(jnp.float32))
  assert y.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(y - exact))) <= 1e-5 * float(jnp.max(jnp.abs(exact)))
  # Rounded to bf16 the logits would be ~2^-9 off: einsum_f32 is far closer than that.
  assert float(jnp.max(jnp.abs(exact.astype(jnp.bfloat16).astype(jnp.float32) - exact))) > 1e-3
  da, db = vjp(g)
  assert da.dtype == db.dtype == jnp.bfloat16
  g16 = g.astype(jnp.bfloat16).astype(jnp.float32)
  da_ref = jnp.einsum('tso,io->tsi', g16, b.astype(jnp.float32))
  db_ref = jnp.einsum('tso,tsi->io', g16, a.astype(jnp.float32))
  for got, ref in ((da, da_ref), (db, db_ref)):
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref))) <= 2 ** -7 * float(
        jnp.max(jnp.abs(ref)))
