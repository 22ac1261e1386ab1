"""The command line of every entry point (train.py, eval.py, convert.py, sharenet.studies.*,
sharenet.data.prepare, ...): absl flags with ml_collections config_flags, where a mistake is one
line on stderr and exit status 2."""
from __future__ import annotations

import difflib
import gc
import os
import re
import sys
from typing import Any, Callable, NoReturn

import ml_collections
from absl import app, flags
from ml_collections import config_flags
from ml_collections.config_flags import config_flags as config_flags_lib

from sharenet.errors import ConfigError, NonFiniteLoss

# CPython's cyclic collector at its default thresholds (700, 10, 10) makes a full collection,
# which walks every live object, every few seconds while jax traces (millions of short-lived
# objects). Entry points (`run`) and the test suite (tests/conftest.py) raise the young
# generation's threshold: cycles are still collected, full collections ~140x less often.
# Measured in docs/performance.md ("Garbage collection").
GC_THRESHOLDS = (100_000, 20, 10)


def dotted_keys(config: Any, prefix: str = '') -> dict[str, Any]:
  """{'train.steps': 120, ...}: every leaf of a (nested) ConfigDict by its dotted path."""
  out = {}
  for k, v in config.items():
    if isinstance(v, ml_collections.ConfigDict):
      out.update(dotted_keys(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def unknown_key(key: str, keys: Any) -> str:
  """The one-line message for a key not in `keys`, naming the nearest valid one."""
  near = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.0)
  return f"unknown config key '{key}'" + (f"; did you mean '{near[0]}'?" if near else '')


def _config_of(flag: Any, argv: list[str]) -> Any:
  """The ConfigDict a config flag would load from `argv` (or its default)."""
  spec = flag.default
  for i, arg in enumerate(argv):
    if re.fullmatch(rf'--?{flag.name}', arg) and i + 1 < len(argv):
      spec = argv[i + 1]
    elif arg.startswith((f'--{flag.name}=', f'-{flag.name}=')):
      spec = arg.split('=', 1)[1]
  return spec if isinstance(spec, ml_collections.ConfigDict) else flag.parser.parse(spec)


def _type_name(value: Any) -> str:
  return {int: 'an int', float: 'a float', bool: 'a bool (true / false)', str: 'a string',
          tuple: 'a tuple'}.get(type(value), type(value).__name__)


def _one_line(error: Exception) -> str:
  lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or ['?']
  return lines[0] if len(lines) == 1 else f'{lines[0]} {lines[-1]}'


def _describe(error: Exception, argv: list[str], configs: dict[str, Callable[[], Any]]) -> str:
  """One line for a failed parse: the unknown config key and its nearest valid key, the key
  and type of a value that does not parse, or the error's own first line."""
  first = _one_line(error)
  for name, load in configs.items():
    try:
      keys = dotted_keys(load())
    except Exception as e:  # noqa: BLE001 - a config file that does not load
      return f'--{name}: {_one_line(e)}'
    groups = {k.rsplit('.', i)[0] for k in keys for i in range(1, k.count('.') + 1)}
    for arg in argv:
      m = re.match(rf'--?(?:no)?{name}\.([^=\s]+)', arg)
      if m and m.group(1) not in keys and m.group(1) not in groups:
        return f'--{name}.{m.group(1)}: {unknown_key(m.group(1), keys)}'
    m = re.match(rf'flag --{name}\.([^=\s]+)=(.*?): ', first)
    if m and m.group(1) in keys:
      key, value = m.group(1), m.group(2)
      return (f"--{name}.{key}={value}: config key '{key}' takes "
              f"{_type_name(keys[key])}, got {value!r}")
  return first


def _fail(message: str) -> NoReturn:
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(2)


_PARSE_ERRORS = (flags.Error, KeyError, AttributeError, TypeError, ValueError, OSError)


def define_config_file(name: str, default: str | None, help_string: str,
                       flag_values: flags.FlagValues = flags.FLAGS,
                       sys_argv: list[str] | None = None) -> flags.FlagHolder:
  """config_flags.DEFINE_config_file (locked); a default whose overrides fail exits 2 in one line.

  config_flags parses the default config, with the --name.a.b=v overrides of argv, already
  here when argv does not name a config file.
  """
  try:
    return config_flags.DEFINE_config_file(name, default, help_string, flag_values=flag_values,
                                           lock_config=True, sys_argv=sys_argv)
  except _PARSE_ERRORS as e:
    parser = config_flags_lib.ConfigFileFlagParser(name)
    _fail(_describe(e, sys_argv or sys.argv, {name: lambda: parser.parse(default)}))


def define_config_dict(name: str, config: ml_collections.ConfigDict, help_string: str,
                       flag_values: flags.FlagValues = flags.FLAGS,
                       sys_argv: list[str] | None = None) -> flags.FlagHolder:
  """config_flags.DEFINE_config_dict (locked) with define_config_file's one-line errors."""
  try:
    return config_flags.DEFINE_config_dict(name, config, help_string, flag_values=flag_values,
                                           lock_config=True, sys_argv=sys_argv)
  except _PARSE_ERRORS as e:
    _fail(_describe(e, sys_argv or sys.argv, {name: lambda: config}))


def parse_flags(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """app.run's flags_parser: parses `argv`; a bad flag, config override or config file exits 2
  with one line."""
  names = [n for n in list(flag_values) if config_flags_lib.is_config_flag(flag_values[n])]
  try:
    rest = flag_values(argv)
    for n in names:
      if flag_values[n].value is None:
        raise flags.Error(f'--{n} FILE is required')
      dotted_keys(flag_values[n].value)   # a config file that failed to load raises here
    return rest
  except _PARSE_ERRORS as e:
    _fail(_describe(e, argv, {n: (lambda f=flag_values[n]: _config_of(f, argv)) for n in names}))


def run(main: Callable[[list[str]], Any]) -> None:
  """app.run(main) for an entry point: flag mistakes, ConfigError and NonFiniteLoss are one line
  `error: ...` on stderr with exit status 2, not a traceback or a usage dump. The cyclic
  collector runs at GC_THRESHOLDS.

  A command is its own job: it starts its own W&B service instead of joining the one an
  inherited WANDB_SERVICE names (a launcher or notebook that uses wandb itself). In a shared
  service a killed run's stream stays open, and its rerun could not resume the W&B run."""

  def checked(argv: list[str]) -> Any:
    try:
      return main(argv)
    except (ConfigError, NonFiniteLoss) as e:
      _fail(str(e))

  gc.set_threshold(*GC_THRESHOLDS)
  os.environ.pop('WANDB_SERVICE', None)
  app.run(checked, flags_parser=parse_flags)
