"""Generated tables spliced into a docs page between a benchmark's begin / end markers
(benchmarks/roofline.py and benchmarks/presets.py write docs/scaling.md this way)."""
from __future__ import annotations


def splice(path: str, begin: str, end: str, table: str) -> None:
  """Replaces what lies between `begin` and `end` in `path` by `table`."""
  with open(path) as f:
    text = f.read()
  if begin not in text or end not in text:
    raise RuntimeError(f'{path} has no markers {begin} ... {end}')
  head, rest = text.split(begin, 1)
  with open(path, 'w') as f:
    f.write(f'{head}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}')
