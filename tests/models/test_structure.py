"""Structure as metadata (sharenet/models/params.py): consumers read a parameter's segment, stored
sets, uses and applied layers from where it was created, never from module names; the
recursion-core failures that reading names caused; old workdirs still serve and resume."""
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models import scaling
from sharenet.parametrization import rules
from sharenet.models import DecoderLM, ModelConfig, layout, lm, param_table, stack
from sharenet.models.accounting import params_applied, params_unique
from sharenet.models.lm import init_variables
from sharenet.models import routing

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'fixtures',
                        'workdirs_v2')
TINY = dict(vocab_size=256, d_model=16, num_heads=2, mlp_dim=32)


def _cfg(**kw):
  return ModelConfig(**TINY).derive(**kw)


@pytest.mark.slow
def test_python_loop_stack_counts_applied_params():
  """Formerly a traceback (accounting parsed int('set_0'.removeprefix('segment_')))."""
  cfg = _cfg(num_layers=4, sharing=dict(scheme='cycle', num_unique=2))
  loop = _cfg(num_layers=4, sharing=dict(scheme='cycle', num_unique=2), scan_layers=False)
  untied = _cfg(num_layers=4, sharing=dict(scheme='untied'))
  v_scan, v_loop, v_untied = (init_variables(DecoderLM(c), jax.random.key(0))
                              for c in (cfg, loop, untied))
  assert params_unique(v_loop) == params_unique(v_scan) < params_unique(v_untied)
  assert params_applied(v_loop, loop) == params_applied(v_scan, cfg) == \
      params_unique(v_untied)
  rules = _pz(loop, loop_rule='inv_R').rules
  assert {r.repeats for r in rules.values() if r.role == 'hidden'} == {2}


def _pz(cfg, **settings):
  """The parametrization of `cfg` under `settings` (config.parametrization keys)."""
  return rules.Parametrization(
      cfg.derive(parametrization=scaling.Settings(**settings)))


@pytest.mark.slow
def test_expert_choice_blocks_are_built_from_the_masa_atoms():
  """Formerly the routed segment got no `masa`: plain kernels, atoms trained for nothing."""
  cfg = _cfg(num_layers=4, sharing=dict(scheme='cycle', num_unique=2),
             routing=dict(kind='expert_choice'), masa=dict(atoms=2))
  table = param_table(cfg)
  routed = [i for i in table.values() if i.segment == cfg.routed_segment and i.in_block]
  names = {i.local for i in routed}
  assert ('attn', 'q', 'masa_coef') in names and ('attn', 'q', 'kernel') not in names
  model = DecoderLM(cfg)
  variables = init_variables(model, jax.random.key(0))
  tokens = jax.numpy.arange(16, dtype=jax.numpy.int32)[None] % 7
  base = model.apply(variables, tokens)
  moved = jax.tree.map(lambda x: x, variables)
  moved['params']['masa'] = jax.tree.map(lambda a: a * 2.0, variables['params']['masa'])
  assert not np.allclose(base, model.apply(moved, tokens))


@pytest.mark.parametrize('kind', ['mup', 'completep'])
@pytest.mark.parametrize('router', ['expert_choice', 'token_choice'])
def test_mixture_of_recursions_has_a_mup_rule(kind, router):
  """Formerly refused ('a hidden matrix whose fan-in or fan-out does not vary'): a router
  (D -> one logit per recursion) is a TP5 output weight, init constant, forward x 1/m."""
  cfg = _cfg(num_layers=4, sharing=dict(scheme='cycle', num_unique=2), routing=dict(kind=router),
             d_model=32, mlp_dim=64, num_heads=4)
  pz = _pz(cfg, kind=kind, base_d_model=16)
  routers = [r for p, r in pz.rules.items() if param_table(cfg)[p].role == 'router']
  assert routers and all(r.fwd_mult == 0.5 and r.init_scale == 2 ** 0.5 for r in routers)


def _consumers(cfg, variables):
  """What every consumer of the structure computes for `cfg`, keyed without module paths."""
  table = param_table(cfg)
  pz = _pz(cfg, kind='mup', base_d_model=16, loop_rule='inv_R')
  by_local = lambda rules: sorted([(table[p].segment, table[p].local, table[p].sets,
                                    r.fwd_mult, r.lr_mult, r.init_std)
                                   for p, r in rules.items()], key=repr)
  out = {'unique': params_unique(variables), 'applied': params_applied(variables, cfg),
         'rules': by_local(pz.rules)}
  for name, view in (('sets', layout.unique_sets(variables['params'], cfg)),
                     ('layers', layout.applied_per_layer(variables['per_layer'], cfg))):
    out[name] = {p: np.asarray(v) for p, v in view.items()}
  ucfg, untied = layout.to_untied(variables, cfg)
  out['untied'] = sorted(float(np.sum(x)) for x in jax.tree.leaves(untied))
  return out


@pytest.mark.slow
def test_renamed_stack_modules_change_no_consumer(monkeypatch):
  cfg = _cfg(
      num_layers=6, sharing=dict(scheme='middle_cycle', num_unique=4, lora_rank=2,
                                 lora_targets=('q', 'v'), untie_norms=True), d_model=32, mlp_dim=64,
      num_heads=4)
  param_table.cache_clear()
  variables = init_variables(DecoderLM(cfg), jax.random.key(0))
  old = param_table(cfg)
  want = _consumers(cfg, variables)
  monkeypatch.setattr(lm, 'STACK', 'trunk_renamed')
  for key, value in (('segment', 'part{}'), ('level', 'loop'), ('block', 'layer')):
    monkeypatch.setitem(stack.NAMES, key, value)
  param_table.cache_clear()
  new = param_table(cfg)
  # The same arrays under the new names, matched by metadata (init RNGs follow the names).
  ident = lambda p, i: (p[0], i.segment, i.local, i.sets, i.layers) if i.segment is not None \
      else p
  flat = flatten_dict(variables)
  by_ident = {ident(p, i): flat[p] for p, i in old.items()}
  renamed = unflatten_dict({p: by_ident[ident(p, i)] for p, i in new.items()})
  got = _consumers(cfg, renamed)
  paths = {'/'.join(p) for p in new}
  assert any('trunk_renamed/part1/loop/layer' in p for p in paths)   # the rename took
  assert got['unique'] == want['unique'] and got['applied'] == want['applied']
  assert got['rules'] == want['rules'] and got['untied'] == want['untied']
  for name in ('sets', 'layers'):
    assert got[name].keys() == want[name].keys()
    for p in want[name]:
      np.testing.assert_array_equal(got[name][p], want[name][p])
  param_table.cache_clear()


def test_no_module_path_is_named_outside_models(repo_root):
  """Only sharenet/models/ builds the stack's tree, so only it may spell its names."""
  pattern = re.compile(r"""['"/](stack|segment_\d*|level|block|set_\d*)['"/]""")
  offenders = []
  for base, _, files in os.walk(os.path.join(repo_root, 'sharenet')):
    if os.path.join('sharenet', 'models') in base:
      continue
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(base, f)
        for n, line in enumerate(open(path), 1):
          if pattern.search(line.split('#')[0]):
            offenders.append(f'{os.path.relpath(path, repo_root)}:{n}: {line.strip()}')
  assert not offenders, '\n'.join(offenders)


def test_loss_free_balance_state_is_the_models_own_collection():
  cfg = _cfg(num_layers=4, sharing=dict(scheme='cycle', num_unique=2),
             routing=dict(kind='token_choice', balancing='bias'))
  want = jax.eval_shape(lambda: DecoderLM(cfg).init(
      {'params': jax.random.key(0), 'per_layer': jax.random.key(0)},
      jax.numpy.zeros((1, 2), jax.numpy.int32)))[routing.BALANCE]
  got = lm.initial_state(cfg)[routing.BALANCE]
  assert jax.tree.structure(got) == jax.tree.structure(want)


# ---- workdirs written before the restructure (tests/fixtures/workdirs_v2) -----------------

EXPECTED = json.load(open(os.path.join(FIXTURES, 'EXPECTED.json')))


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(EXPECTED['eval']))
def test_old_workdir_evaluates_as_it_did(name, tmp_path):
  from sharenet.main import eval_workdir
  work = shutil.copytree(os.path.join(FIXTURES, name), tmp_path / name)
  out = eval_workdir.evaluate_workdir(str(work))
  assert out['step'] == EXPECTED['eval'][name]['step']
  np.testing.assert_allclose(out['eval_loss'], EXPECTED['eval'][name]['eval_loss'], rtol=1e-6)


@pytest.mark.slow
def test_old_workdir_generates_and_resumes(tmp_path):
  from sharenet.train import loop, workdir_io
  from sharenet.main import eval_workdir
  work = str(shutil.copytree(os.path.join(FIXTURES, 'middle_cycle_lora'), tmp_path / 'w'))
  want = EXPECTED['generate']['middle_cycle_lora']
  rows = eval_workdir.generate_from_workdir(
      work, None, {}, [want['prompt']], max_new_tokens=want['max_new_tokens'], temperature=0.0,
      top_k=0, top_p=1.0, seed=0, num_samples=1, eos_id=None)
  assert rows[0]['text'] == want['text']
  config = workdir_io.load_config(work)
  config.train.steps = 5
  out = loop.train_and_evaluate(config, work)   # resumes at step 4
  assert np.isfinite(out['loss'])
  steps = [json.loads(l)['step'] for l in open(os.path.join(work, 'metrics.jsonl'))]
  assert steps[-1] == 5 and steps.count(1) == 1   # step 1 was not redone
