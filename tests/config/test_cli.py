"""Config defaults in one place, every field settable from the command line, one-line errors,
and a library that imports none of its entry points."""
import ast
import dataclasses
import gc
import glob
import os
import subprocess
import sys

import ml_collections
import pytest
from absl import flags

from sharenet.config import cli, defaults
from sharenet.errors import ConfigError
from sharenet.models import ModelConfig
from sharenet.models.scaling import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ['configs/default.py', 'configs/norm_study.py', 'configs/mup/coord_check.py',
           'configs/mup/transfer.py', 'configs/mup/transfer_loops.py']


def _new_value(value):
  """A value of the field's type that differs from `value`, and its command-line spelling."""
  if isinstance(value, bool):
    return not value, str(not value).lower()
  if isinstance(value, int):
    return value + 3, str(value + 3)
  if isinstance(value, float):
    return value + 0.25, repr(value + 0.25)
  if isinstance(value, str):
    return value + 'x', value + 'x'
  if isinstance(value, tuple):
    new = (('embed', 'fsdp'), ('heads', None))
    return new, repr(new)
  raise AssertionError(f'no command-line value for {value!r}')


def _parse(define, argv):
  fv = flags.FlagValues()
  holder = define(fv, argv)
  cli.parse_flags(argv, fv)
  return holder.value


def _check_every_field(define, config, argv0):
  keys = cli.dotted_keys(config)
  want = {k: _new_value(v) for k, v in keys.items()}
  argv = argv0 + [f'--config.{k}={s}' for k, (_, s) in want.items()]
  got = cli.dotted_keys(_parse(define, argv))
  assert got == {k: v for k, (v, _) in want.items()}


@pytest.mark.parametrize('path', CONFIGS)
def test_every_field_of_a_config_file_is_settable_from_the_command_line(path):
  path = os.path.join(ROOT, path)
  define = lambda fv, argv: cli.define_config_file('config', path, '', fv, argv)
  config = _parse(define, ['prog', '--config', path])
  assert (set(cli.dotted_keys(defaults.default_config()))
          <= set(cli.dotted_keys(config)))
  _check_every_field(define, config, ['prog', '--config', path])


@pytest.mark.parametrize('make', [defaults.default_config, defaults.conversion_config])
def test_every_field_of_eval_and_convert_options_is_settable_from_the_command_line(make):
  define = lambda fv, argv: cli.define_config_dict('config', make(), '', fv, argv)
  _check_every_field(define, make(), ['prog'])


@pytest.mark.parametrize('arg,message', [
    ('--config.trian.steps=3',
     "--config.trian.steps: unknown config key 'trian.steps'; did you mean 'train.steps'?"),
    ('--config.model.sharing.shceme=cycle', "unknown config key 'model.sharing.shceme'; did you "
     "mean 'model.sharing.scheme'?"),
    ('--config.train.lr=fast', "--config.train.lr=fast: config key 'train.lr' takes a float, "
     "got 'fast'"),
    ('--config.train.progress=maybe', "config key 'train.progress' takes a bool"),
    ('--wrokdir=x', "Unknown command line flag 'wrokdir'"),
])
def test_a_bad_override_is_one_line_with_exit_status_2(arg, message, capsys):
  path = os.path.join(ROOT, 'configs', 'tiny.py')
  fv = flags.FlagValues()
  flags.DEFINE_string('workdir', '', '', flag_values=fv)
  argv = ['prog', '--config', path, arg]
  cli.define_config_file('config', path, '', fv, argv)
  with pytest.raises(SystemExit) as e:
    cli.parse_flags(argv, fv)
  err = capsys.readouterr().err.splitlines()
  assert e.value.code == 2 and len(err) == 1 and err[0].startswith('error: ') and message in err[0]


def test_entry_points_run_the_collector_at_gc_thresholds(monkeypatch):
  """cli.run sets GC_THRESHOLDS before the entry point's main runs (docs/performance.md,
  "Garbage collection")."""
  seen = []
  monkeypatch.setattr(cli.app, 'run', lambda main, **_: main(['prog']))
  before = gc.get_threshold()
  try:
    gc.set_threshold(700, 10, 10)   # CPython's defaults
    cli.run(lambda argv: seen.append(gc.get_threshold()))
  finally:
    gc.set_threshold(*before)
  assert seen == [cli.GC_THRESHOLDS] and cli.GC_THRESHOLDS[0] > 700


@pytest.mark.slow
def test_train_py_typo_and_wrong_type_exit_2_in_one_line(tmp_path):
  """Without --config the default config file is parsed (with the overrides) while the flags
  are defined; with it, when absl parses argv: both paths give the same line."""
  run = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'),
                                   f'--workdir={tmp_path}', *a], capture_output=True, text=True,
                                  env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  res = run('--config.train.stpes=3')
  assert res.returncode == 2 and res.stderr.splitlines() == [
      "error: --config.train.stpes: unknown config key 'train.stpes'; did you mean "
      "'train.steps'?"]
  res = run('--config', os.path.join(ROOT, 'configs', 'tiny.py'), '--config.train.steps=abc')
  assert res.returncode == 2 and res.stderr.splitlines() == [
      "error: --config.train.steps=abc: config key 'train.steps' takes an int, got 'abc'"]
  assert not os.listdir(tmp_path)


def test_model_config_defaults_and_keys_come_from_the_default_config():
  m = defaults.default_config().model
  assert ModelConfig() == ModelConfig.from_config(m)
  assert ModelConfig().remat == 'dots'
  assert ModelConfig().to_config() == m.to_dict()      # every config.model key is a field
  cfg = ModelConfig(d_model=64, norm=dict(kind='layernorm'), head_dim=16,
                    sharing=dict(scheme='cycle', repeats=2, lora_targets=('q', 'mlp_in')))
  assert ModelConfig.from_config(ml_collections.ConfigDict(cfg.to_config())) == cfg
  assert (cfg.norm.kind, cfg.sharing.scheme, cfg.sharing.lora_targets) == (
      'layernorm', 'cycle', ('q', 'mlp_in'))
  assert cfg.to_config()['sharing']['lora_targets'] == 'q,mlp_in'
  partial = m.to_dict()
  del partial['norm']['eps']
  with pytest.raises(ConfigError, match='model.norm.eps is missing'):
    ModelConfig.from_config(ml_collections.ConfigDict(partial))


def test_model_config_sentinels_are_resolved_once_and_again_on_derive():
  """Keys keep their values (0 = derived); resolved fields are not keys, and a derived config
  resolves them from its own keys."""
  cfg = ModelConfig(d_model=64, num_heads=4)
  assert (cfg.head_dim, cfg.d_head, cfg.num_kv_heads, cfg.kv_heads) == (0, 16, 0, 4)
  assert cfg.attn_mult == 16 ** -0.5 and cfg.logits_mult == 1.0 and cfg.umup_residual == ()
  wide = cfg.derive(d_model=128, num_heads=2, norm={'kind': 'layernorm'})
  assert (wide.d_head, wide.kv_heads, wide.norm.kind, wide.norm.placement) == (
      64, 2, 'layernorm', 'pre')
  pinned = cfg.derive(head_dim=8).derive(d_model=128)
  assert pinned.d_head == 8                  # a head_dim key is kept by a derived config
  assert 'd_head' not in cfg.to_config() and 'plan' not in cfg.to_config()
  with pytest.raises(ConfigError, match='model.sharing.scheme=.spiral. is unknown'):
    cfg.derive(sharing={'scheme': 'spiral'})
  with pytest.raises(ConfigError, match='model.norm_placement is unknown'):
    cfg.derive(norm_placement='post')      # the flat names are gone


def test_parametrization_settings_are_the_config_group():
  p = defaults.default_config().parametrization
  assert sorted(f.name for f in dataclasses.fields(Settings)) == sorted(p.keys())
  assert Settings() == Settings.from_config(p) == Settings.from_config({})


def test_an_old_workdir_config_is_completed_from_the_defaults():
  old = {'model': {'d_model': 64, 'norm': {'kind': 'layernorm'}}, 'train': {'steps': 7}}
  c = defaults.complete(old)
  assert (c.model.d_model, c.model.norm.kind, c.model.norm.eps, c.train.steps) == (
      64, 'layernorm', 1e-6, 7)
  assert c.parametrization.kind == 'sp' and c.transforms.reparam == ''
  assert ModelConfig.from_config(c.model).d_model == 64
  # A run written before model.sharing.lora_layers put LoRA on every layer: it keeps doing so.
  old['model']['sharing'] = {'scheme': 'middle_cycle', 'lora_rank': 2}
  assert defaults.complete(old).model.sharing.lora_layers == 'all'
  assert defaults.default_config().model.sharing.lora_layers == 'shared'


def _imports(path):
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      yield node.module


def test_the_library_imports_no_entry_point_or_config_file():
  entry_points = {'train', 'eval', 'convert', 'configs'}
  upper = ('sharenet.main', 'sharenet.train', 'sharenet.studies', 'sharenet.config.cli')
  files = glob.glob(os.path.join(ROOT, 'sharenet', '**', '*.py'), recursive=True)
  assert len(files) > 30
  for path in files:
    for name in _imports(path):
      assert name.split('.')[0] not in entry_points, (path, name)
      if os.sep + 'transforms' + os.sep in path:   # the conversion math stays below the CLI
        assert not name.startswith(upper), (path, name)
