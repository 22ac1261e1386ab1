"""docs/architecture.md's module map names every module of the package, and only those."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mapped_modules(text: str) -> list[str]:
  """The paths the first fenced block after '## Module map' lists, one per line."""
  section = text.split('## Module map', 1)[1]
  block = re.search(r'```\n(.*?)```', section, re.S).group(1)
  return [line.split()[0] for line in block.splitlines() if line.startswith('sharenet/')]


def tree_modules() -> set[str]:
  """Every module under sharenet/; a package's __init__.py only where it holds code."""
  out = set()
  for dirpath, _, files in os.walk(os.path.join(ROOT, 'sharenet')):
    for f in files:
      path = os.path.relpath(os.path.join(dirpath, f), ROOT)
      if f.endswith('.py') and (f != '__init__.py' or _has_code(path)):
        out.add(path)
  return out


def _has_code(path: str) -> bool:
  """More than a docstring."""
  with open(os.path.join(ROOT, path)) as f:
    body = ast.parse(f.read()).body
  return len(body) > (1 if body and isinstance(body[0], ast.Expr) else 0)


def test_the_module_map_is_the_tree():
  with open(os.path.join(ROOT, 'docs', 'architecture.md')) as f:
    mapped = mapped_modules(f.read())
  assert len(mapped) == len(set(mapped)), 'a module is listed twice'
  tree = tree_modules()
  assert sorted(tree - set(mapped)) == [], 'modules missing from docs/architecture.md'
  assert sorted(set(mapped) - tree) == [], 'docs/architecture.md names modules that do not exist'


def test_the_map_parser_reads_the_block():
  text = 'intro\n## Module map\n\n```\nsharenet/a.py   holds a\nsharenet/b/c.py  c\n```\n'
  assert mapped_modules(text) == ['sharenet/a.py', 'sharenet/b/c.py']
