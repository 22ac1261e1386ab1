"""The package's shape: one package per concept, imports that point down the layers, no cycles,
no hidden imports inside functions (docs/architecture.md, "Packages and layers")."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, 'sharenet')

# Bottom to top: a package imports only the packages before it (docs/architecture.md).
LAYERS = ('errors', 'config', 'kernels', 'models', 'transforms', 'optim', 'parametrization',
          'data', 'checkpoint', 'inference', 'tasks', 'train', 'main', 'interop', 'studies')
# The package root holds packages, __init__.py and these leaves.
ROOT_LEAVES = {'__init__.py', 'errors.py'}

# A sharenet import inside a function, each for a real start-up cost: (importer, imported) -> why.
IN_FUNCTION_ALLOWED = {
    ('sharenet.studies.results_tables', 'sharenet.studies.common'):
        'results_tables --check renders tables from JSON without importing jax',
    ('sharenet.studies.results_tables', 'sharenet.studies.depth_report'):
        'results_tables --check renders tables from JSON without importing jax',
    ('sharenet.studies.results_tables', 'sharenet.studies.lr_sweep'):
        'results_tables --check renders tables from JSON without importing jax',
    ('sharenet.studies.results_tables', 'sharenet.studies.nap_study'):
        'results_tables --check renders tables from JSON without importing jax',
    ('sharenet.studies.results_tables', 'sharenet.studies.width_split'):
        'results_tables --check renders tables from JSON without importing jax',
}


def modules() -> dict[str, str]:
  """{dotted module name: path} of every module under sharenet/ (a package by its __init__)."""
  out = {}
  for dirpath, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(dirpath, f)
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
        out[name[:-len('.__init__')] if name.endswith('.__init__') else name] = path
  return out


def imports(path: str, names: set[str]) -> list[tuple[str, bool, int]]:
  """(imported sharenet module, inside a function?, line) for every import in `path`; an import
  of a package's member names the member module where one exists, else the package."""
  found = []

  def visit(node: ast.AST, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.Import):
        found.extend((a.name, in_function, child.lineno) for a in child.names
                     if a.name.split('.')[0] == 'sharenet')
      elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module and \
          child.module.split('.')[0] == 'sharenet':
        for a in child.names:
          member = f'{child.module}.{a.name}'
          found.append((member if member in names else child.module, in_function, child.lineno))
      visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.Lambda)))

  with open(path) as f:
    visit(ast.parse(f.read()), False)
  return found


def graph(include_functions: bool = True) -> dict[str, set[str]]:
  """Module -> the sharenet modules it imports. Importing `sharenet.p.m` from outside package
  `p` also runs `sharenet.p`'s __init__, so that is an edge too."""
  mods = modules()
  out = {m: set() for m in mods}
  for m, path in mods.items():
    for target, in_function, _ in imports(path, set(mods)):
      if in_function and not include_functions:
        continue
      parts = target.split('.')
      for i in range(2, len(parts)):   # enclosing packages the importer is not inside
        package = '.'.join(parts[:i])
        if package in mods and not m.startswith(package + '.') and package != m:
          out[m].add(package)
      if target != m:
        out[m].add(target)
  return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def connect(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(g[v]):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(g):
    if v not in index:
      connect(v)
  return found


def layer(module: str) -> str:
  return module.split('.')[1] if module != 'sharenet' else 'sharenet'


def test_the_root_holds_packages_and_a_few_leaves():
  entries = [e for e in os.listdir(PACKAGE) if e != '__pycache__']
  packages = {e for e in entries if os.path.isdir(os.path.join(PACKAGE, e))}
  assert set(entries) - packages == ROOT_LEAVES
  assert packages | {e[:-3] for e in ROOT_LEAVES if e != '__init__.py'} == set(LAYERS)
  for p in packages:
    assert os.path.exists(os.path.join(PACKAGE, p, '__init__.py')), p


def test_the_import_graph_has_no_cycle():
  """Imports inside functions count: a cycle they hide is still a cycle."""
  assert cycles(graph()) == []


def test_the_cycle_check_finds_a_cycle():
  assert cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]
  assert cycles({'a': {'b'}, 'b': set()}) == []


def test_packages_import_only_the_layers_below():
  rank = {name: i for i, name in enumerate(LAYERS)}
  wrong = []
  for m, targets in graph().items():
    for t in targets:
      if layer(t) != layer(m) and layer(t) != 'sharenet' and rank[layer(t)] > rank[layer(m)]:
        wrong.append(f'{m} imports {t}: {layer(t)} is above {layer(m)}')
  assert wrong == []


def test_no_sharenet_import_inside_a_function_outside_the_allowlist():
  mods = modules()
  found = {(m, target): line for m, path in mods.items()
           for target, in_function, line in imports(path, set(mods)) if in_function}
  outside = sorted(f'{mods[m]}:{line}: {target}' for (m, target), line in found.items()
                   if (m, target) not in IN_FUNCTION_ALLOWED)
  assert outside == []
  assert set(IN_FUNCTION_ALLOWED) <= set(found), 'an allowlist entry no longer exists: drop it'


@pytest.mark.parametrize('source,inside', [
    ('def f():\n  from sharenet.models import lm\n', True),
    ('from sharenet.models import lm\n', False),
    ('class C:\n  def f(self):\n    import sharenet.models.lm\n', True),
])
def test_imports_tells_a_function_import_from_a_module_import(tmp_path, source, inside):
  path = tmp_path / 'm.py'
  path.write_text(source)
  (target, in_function, _), = imports(str(path), {'sharenet.models.lm'})
  assert target == 'sharenet.models.lm' and in_function == inside


# Modules that share a basename: the same concept at two levels (a model layer and its kernel;
# the experiment's typed config sections and the model's).
SHARED_BASENAMES = {'attention.py': {'models', 'kernels'}, 'norms.py': {'models', 'kernels'},
                    'sections.py': {'config', 'models'}}


def test_two_modules_share_a_basename_only_as_one_concept_at_two_levels():
  where = {}
  for path in modules().values():
    name = os.path.basename(path)
    if name != '__init__.py':
      where.setdefault(name, set()).add(os.path.basename(os.path.dirname(path)))
  assert {n: d for n, d in where.items() if len(d) > 1} == SHARED_BASENAMES
