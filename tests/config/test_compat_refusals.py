"""The compatibility table is the only place a feature pair is refused: no ConfigError raised in
sharenet/ names the config keys of two of the table's features, except the few listed here,
which are not pair refusals."""
import ast
import os
import re

from sharenet.config import compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = re.compile(r'\b(?:model|train|parametrization|transforms|mesh|data)\.[a-z_]+(?:\.[a-z_]+)?')

# (module, the feature keys its error names) -> why it is not a refusal of a feature pair.
NOT_PAIRS = {
    ('sharenet/interop/export_hf.py', ('model.norm.kind', 'model.position')):
        'which Hugging Face architecture a model is: a property of the export, not a pair',
    ('sharenet/parametrization/optimizer_rules.py', ('parametrization.kind', 'train.optimizer')):
        'muP under Muon takes the table; the error is about train.matrix_roles beyond the '
        'hidden kernels, which no feature names',
    ('sharenet/train/sampled_depth.py', ('model.sharing.scheme', 'train.exit_loss')):
        'a plan of a looping scheme that loops once (cycle with R = 1): the plan, not a feature',
}


def feature_keys() -> dict[str, set[str]]:
  """Config key -> the features whose overrides set it."""
  out = {}
  for f in compat.FEATURES:
    for key, _ in f.overrides:
      out.setdefault(key, set()).add(f.name)
  return out


def pair_raises(source: str, keys: dict[str, set[str]]) -> list[tuple[int, tuple[str, ...]]]:
  """(line, feature keys) of each `raise ConfigError(...)` or `require(...)` in `source` whose
  message names the keys of two features that no single feature sets together."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Raise) and node.exc is not None:
      text = ast.get_source_segment(source, node) or ''
      if 'ConfigError' not in text:
        continue
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id == 'require'):   # sharenet.errors.require raises a ConfigError
      text = ast.get_source_segment(source, node) or ''
    else:
      continue
    named = tuple(sorted({k for k in KEY.findall(text) if k in keys}))
    if len(named) < 2:
      continue
    one_feature = set.intersection(*(keys[k] for k in named))
    if not one_feature:
      found.append((node.lineno, named))
  return found


def test_no_feature_pair_is_refused_outside_the_table():
  keys = feature_keys()
  found = {}
  for dirpath, _, files in os.walk(os.path.join(ROOT, 'sharenet')):
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(dirpath, f)
        with open(path) as fh:
          for line, named in pair_raises(fh.read(), keys):
            found[(os.path.relpath(path, ROOT), named)] = line
  outside = sorted(f'{p}:{line}: {", ".join(k)}' for (p, k), line in found.items()
                   if (p, k) not in NOT_PAIRS)
  assert outside == [], 'declare these refusals in sharenet/config/compat.py instead'
  assert set(NOT_PAIRS) <= set(found), 'a NOT_PAIRS entry no longer exists: drop it'


def test_the_search_finds_a_restated_refusal():
  keys = feature_keys()
  restated = ("if a:\n  raise ConfigError('transforms.updates=adamp replaces Adam beside '\n"
              "                    'train.optimizer=muon')\n")
  assert pair_raises(restated, keys) == [(2, ('train.optimizer', 'transforms.updates'))]
  one_feature = "raise ConfigError('transforms.project=nap needs model.norm.pre_activation')\n"
  assert pair_raises(one_feature, keys) == []
  required = "require(ok, 'model.norm.placement=post with model.sharing.untie_norms=True')\n"
  assert pair_raises(required, keys) == [(1, ('model.norm.placement', 'model.sharing.untie_norms'))]
