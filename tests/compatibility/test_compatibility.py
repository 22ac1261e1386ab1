"""The compatibility table (sharenet/config/compat.py), tested from the table itself.

Every working pair sits in at least one covering row; each row is validated, initialised and
trained for one step abstractly (`jax.eval_shape` of the real train step, which traces every
module, transform and the optimizer update), and the rows holding an action (cached
generation, loop-by-loop inference) run it for real from their initialised state (slow tier).
Every refused pair is one ConfigError line naming both features. docs/compatibility.md is the
table's `markdown()`.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.models import scaling
from sharenet.config import compat, compat_coverage
from sharenet.train import experiment, sampled_depth, trainer
from sharenet.optim import matrix
from sharenet.models import sharing
from sharenet.errors import ConfigError
from sharenet.kernels import KERNELS
from sharenet.models import config as model_config
from sharenet.models import sections
from sharenet.transforms import project, reparam, update

ROWS = compat_coverage.covering_rows()
# Values that are defaults of their axis (the base config has them), or that need hardware
# this suite does not have: declared here, so a new value fails test_every_choice_is_declared.
NOT_FEATURES = {'sp', 'adamw', 'none', 'rmsnorm', 'pre', 'nested', 'xla', 'auto', 'float32',
                'float64',   # exactness tests run in float64; not a training setting
                'fixed',     # model.recurrence.depth's default
                'offload_dots'}   # offloads to pinned host memory: accelerators only


def make_config(tiny_config, names):
  """configs/tiny.py at 4 applied layers (a cycle of 2 sets) with the features `names` on."""
  overrides = {'model.num_layers': 4, 'model.sharing.scheme': 'cycle',
               'model.sharing.num_unique': 2, 'train.batch_size': 2, 'train.seq_len': 16,
               'train.eval_batch_size': 2}
  for n in names:
    overrides.update(dict(compat.BY_NAME[n].overrides))
  return tiny_config(**overrides)


def test_every_choice_is_declared():
  """Each value of a config choice is a feature of the table (or listed in NOT_FEATURES)."""
  choices = {*sharing.SCHEMES, *sections.ROUTINGS, *model_config.LOWERINGS,
             *model_config.ATTENTION_SHARINGS, *sections.NORMS, *sections.PLACEMENTS,
             *scaling.KINDS, *scaling.LOOP_RULES, *reparam.REPARAMS,
             *project.PROJECTIONS, *update.UPDATES, *model_config.REMATS, *KERNELS,
             *model_config.DTYPES, *matrix.OPTIMIZERS}
  choices |= {f'qk_{q}' for q in sections.QK_NORMS if q != 'none'}
  choices |= set(sections.DEPTHS) | {f'exit_{e}' for e in sampled_depth.EXIT_LOSSES if e != 'last'}
  choices |= {f'inject_{i}' for i in sections.INJECTIONS if i != 'none'}
  choices |= {f'init_{i}' for i in sections.STATE_INITS if i != 'embed'}
  choices |= {f'kv_{k}' for k in model_config.KV_SHARINGS if k != 'none'}
  choices |= set(sections.MOE_KINDS) | {f'moe_{d}' for d in sections.MOE_DISPATCHES if d != 'auto'}
  choices |= set(sections.MOE_ATTENTIONS)
  choices |= {f'rope_{k}' for k in sections.ROPE_SCALINGS if k != 'none'}
  choices -= {'none'}
  missing = sorted(choices - set(compat.BY_NAME) - NOT_FEATURES)
  assert not missing, f'undeclared in sharenet/config/compat.py: {missing}'


def test_the_table_is_consistent():
  for f in compat.FEATURES:
    for other, why, *_ in f.refuses:
      assert other in compat.BY_NAME, (f.name, other)
      assert why and '\n' not in why
  assert all(len({compat.BY_NAME[n].axis for n in row}) == len(row) for row in ROWS)
  covered = {frozenset((a, b)) for row in ROWS for a in row for b in row if a != b}
  for a, b, why in compat.pairs():
    assert (frozenset((a, b)) in covered) == (why is None), (a, b)


def test_docs_are_generated_from_the_table(repo_root):
  with open(os.path.join(repo_root, 'docs', 'compatibility.md')) as f:
    assert f.read() == compat_coverage.markdown(), \
        'regenerate: python -m sharenet.config.compat_coverage > docs/compatibility.md'


REFUSED = [(a, b) for a, b, why in compat.pairs() if why]


@pytest.mark.parametrize('a,b', REFUSED, ids=[f'{a}-{b}' for a, b in REFUSED])
def test_refused_pair_is_one_line(a, b, tiny_config):
  fa, fb = compat.BY_NAME[a], compat.BY_NAME[b]
  if fa.action or fb.action:
    action, feature = (a, b) if fa.action else (b, a)
    with pytest.raises(ConfigError) as e:
      compat.check_action(action, make_config(tiny_config, [feature]))
  else:
    with pytest.raises(ConfigError) as e:
      experiment.validate(make_config(tiny_config, [a, b]))
    for f in (fa, fb):
      assert f.label in str(e.value)
  assert '\n' not in str(e.value)


def _batch(config):
  t = config.train
  tokens = np.arange(t.batch_size * (t.seq_len + 1)).reshape(t.batch_size, -1) % 251
  tokens = jnp.asarray(tokens, jnp.int32)
  if config.data.segment_mask:
    return {'tokens': tokens, 'segment_ids': jnp.asarray(np.arange(tokens.shape[1]) // 6)[None]
            .repeat(t.batch_size, 0).astype(jnp.int32)}
  return tokens


def _trace(tiny_config, row, monkeypatch):
  """The row's config validated, and its train step from init evaluated abstractly."""
  config = make_config(tiny_config, row)
  # data.segment_mask reads documents from prepared shards (tests/data/test_arrayrecord.py); here
  # the model gets segment ids from _batch, so the data source is not checked.
  monkeypatch.setattr(experiment.data, 'validate_data_config', lambda *a, **k: None)
  exp = trainer.setup(config, experiment.validate(config))
  step = trainer.make_train_step(exp, config.train.grad_accum,
                                   loops=sampled_depth.step_loops(config.train, exp.model.cfg))
  # the init's trace is the role table's (config validation built it): the abstract state
  # adds the preset, the transforms and the optimizer's init
  state = trainer.abstract_state(exp.model, exp.tx, exp.tr, exp.pz)
  new, metrics = jax.eval_shape(step, state, _batch(config))
  assert metrics['loss'].shape == () and new.step.shape == ()
  if 'dynamic_tying' in row:
    _retie(config, new)


def _retie(config, state):
  """A dynamic-tying row's plan change (sharenet/train/dynamic_tying.py): the trained state
  taken over set by set into another plan, whose train step then runs on it (abstractly)."""
  from sharenet.train import dynamic_tying
  def exp_of(pattern):
    c = dynamic_tying.with_pattern(config, pattern)
    return trainer.setup(c, experiment.validate(c))
  abstract = lambda p: (lambda e: trainer.abstract_state(e.model, e.tx, e.tr, e.pz))(exp_of(p))
  old, new = (0, 1, 1, 0), (0, 0, 1, 1)
  per_set = dynamic_tying.per_set_leaves(abstract, 4)
  moved = jax.eval_shape(lambda s: dynamic_tying.carry_over(
      s, per_set, dynamic_tying.sources(old, new)), state)
  exp = exp_of(new)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), moved) == jax.tree.map(
      lambda a: (a.shape, a.dtype), abstract(new))
  step = trainer.make_train_step(exp, config.train.grad_accum,
                                 loops=sampled_depth.step_loops(config.train, exp.model.cfg))
  _, metrics = jax.eval_shape(step, moved, _batch(config))
  assert metrics['loss'].shape == ()


@pytest.mark.slow
@pytest.mark.parametrize('row', ROWS, ids=[f'row{i}' for i in range(len(ROWS))])
def test_row_traces(row, tiny_config, monkeypatch):
  """Fast tier: the train step of every row traces (abstract evaluation)."""
  _trace(tiny_config, row, monkeypatch)


CONVERSION_ACTIONS = {f'convert_{to}' for to in compat.CONVERSIONS}
ACTION_ROWS = [r for r in ROWS if {'generation', 'loop_inference', 'test_time_depth',
                                   *CONVERSION_ACTIONS} & set(r)]
# Options of each conversion on a row's 4-layer model; rmsnorm, crmsnorm and fold_unified_norm
# compute the source's function (eval mode), the others build a model of their own.
CONVERSION_OPTIONS = {'recursive': {'num_unique': 2}, 'merge_lora_experts': {'expert_weights': '1,0'},
                      'wider': {'d_model': 64}, 'mpo': {'mpo_cores': 3}}
PRESERVING = ('rmsnorm', 'crmsnorm', 'fold_unified_norm')


def _convert(row, exp, state, variables):
  """The row's conversion (sharenet/main/convert_workdir.py convert_model, the code path of
  convert.py after restoring) of the initialised model: the converted model applies, and a
  function-preserving conversion computes the source's logits."""
  from sharenet.config import defaults
  from sharenet.main import convert_workdir
  from sharenet.models import DecoderLM
  from sharenet.models.norm_stats import NORM_STATS
  to = next(n for n in row if n in CONVERSION_ACTIONS)[len('convert_'):]
  # A trained model's parameters: the init's unit gains and zero biases would make a fold of
  # the norms' affine maps trivially right. Every float parameter moves by 0.2 of its rms.
  leaves, tree = jax.tree.flatten(state.params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  def jitter(key, x):
    rms = jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))
    noise = 0.2 * jnp.where(rms > 0, rms, 1.0) * jax.random.normal(key, x.shape)
    return x + noise.astype(x.dtype)
  state = state.replace(params=jax.tree.unflatten(tree, [
      jitter(k, x) if jnp.issubdtype(x.dtype, jnp.floating) else x for k, x in zip(keys, leaves)]))
  if state.tstate.get(NORM_STATS):   # and statistic: the init's 0 would scale every logit ~1e5
    state = state.replace(tstate={**state.tstate, NORM_STATS: jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.ones_like(x) if 'running_var' in str(path[-1]) else x,
        state.tstate[NORM_STATS])})
  variables = trainer.effective_params(state, exp.tr, exp.pz)
  opts = defaults.conversion_config()
  opts.to = to
  opts.update(CONVERSION_OPTIONS.get(to, {}))
  params = convert_workdir.source_variables(state, exp, to)
  new_cfg, new_vars, _ = convert_workdir.convert_model(
      exp.model.cfg, params, opts, jax.device_get(state.tstate.get(NORM_STATS, {})))
  tokens = jnp.asarray([[3, 141, 59, 26, 5, 35]])
  logits = DecoderLM(new_cfg).apply(new_vars, tokens)
  assert np.all(np.isfinite(np.asarray(logits))), to
  if to in PRESERVING:   # the maths, in float32 (bfloat16 rounds the two differently), before
    # the logit soft-cap: a fixed map after the logits that would hide their scale (a row's
    # jittered model reached pre-cap logits of 2e6, whose float32 rounding the cap left as a
    # 4e-4 error relative to its output's 5)
    f32 = lambda c: DecoderLM(c.derive(dtype='float32', logit_softcap=0.0))
    want = np.asarray(f32(exp.model.cfg).apply(variables, tokens))
    got = np.asarray(f32(new_cfg).apply(new_vars, tokens))
    error = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1)
    assert error <= 1e-4, (to, error)


# The serving row holding loop-by-loop inference with the most features.
SAMPLED_ROW = max((r for r in ACTION_ROWS if 'loop_inference' in r), key=len)


@pytest.mark.slow
@pytest.mark.parametrize('row', ACTION_ROWS, ids=[f'actions{i}' for i in range(len(ACTION_ROWS))])
def test_row_serves(row, tiny_config, monkeypatch):
  """Slow tier: rows holding an action serve from their initialised state (the row's train
  step is test_row_traces'): a conversion converts it (`_convert`); cached greedy generation
  runs, loop-by-loop inference that
  never exits early equals it token for token (greedy; sampled under a never-firing kl
  criterion on SAMPLED_ROW: sampling reads the logits greedy decoding compared, with no
  feature of its own); at test-time depth the plan's R through a schedule is the plan and
  cached decoding at one loop runs."""
  from sharenet.inference import test_time_depth
  from sharenet.inference import generate as gen
  from sharenet.inference import loop_by_loop as ri
  from sharenet.models.loops import Schedule
  config = make_config(tiny_config, row)
  monkeypatch.setattr(experiment.data, 'validate_data_config', lambda *a, **k: None)
  exp = trainer.setup(config, experiment.validate(config))
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(0), exp.tr, exp.pz)
  variables = trainer.effective_params(state, exp.tr, exp.pz)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(variables)), 'a non-finite init'
  if CONVERSION_ACTIONS & set(row):   # a conversion row holds no other action
    return _convert(row, exp, state, variables)
  prompts = [[3, 141, 59], [27]]
  greedy = gen.generate(exp.model, variables, prompts, 3, temperature=0).tokens
  assert [len(t) for t in greedy] == [3, 3]
  if 'loop_inference' in row:
    out = ri.generate_early_exit(exp.model, variables, prompts, 3, exit_threshold=1.0)
    assert out.tokens == greedy
  if row == SAMPLED_ROW:   # sampling draws from the same logits: once, on the widest row
    out = ri.generate_early_exit(exp.model, variables, prompts, 3, exit='kl:0', temperature=1.0,
                                 rng=jax.random.key(1))
    assert out.tokens == gen.generate(exp.model, variables, prompts, 3, temperature=1.0,
                                      rng=jax.random.key(1)).tokens
  if 'test_time_depth' in row:   # the plan's depth through a schedule; cached decoding at 1
    R = test_time_depth.check_depth(exp.model.cfg, 1).loops
    tokens = jnp.asarray([[3, 141, 59]])
    tol = 0.05 if 'bfloat16' in row else 1e-4   # other lowerings sum in another order
    apply = jax.jit(exp.model.apply, static_argnames='schedule')   # one program per call
    np.testing.assert_allclose(apply(variables, tokens, schedule=Schedule(loops=R)),
                               apply(variables, tokens), rtol=tol, atol=tol)
    shallow = gen.generate(exp.model, variables, prompts, 3, temperature=0, loops=1).tokens
    assert [len(t) for t in shallow] == [3, 3]
