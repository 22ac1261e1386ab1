"""What is generated from the compatibility table (sharenet/config/compat.py, the declarations):
the pairwise covering rows tests/compatibility/test_compatibility.py trains and serves, and
docs/compatibility.md (`python -m sharenet.config.compat_coverage > docs/compatibility.md`)."""
from __future__ import annotations

import collections
import itertools
import random

from sharenet.config.compat import BY_NAME, FEATURES, is_pair, pairs


def covering_rows(seed: int = 0, tries: int = 24) -> list[tuple[str, ...]]:
  """Feature sets, at most one per axis and no refused pair among them, that together hold
  every working pair (a greedy pairwise covering, deterministic for a seed).

  Every row is a traced train step in the tests and a row holding an action (generation,
  loop-by-loop inference, test-time depth) also compiles and runs it, ~4x a trace: so the
  pairs of the actions are covered first, by rows holding a feature only for a pair of an
  action (their number is bounded below by the largest axis an action pairs with, the
  sharing schemes; a costly feature such as pallas or bfloat16 is then served once, not in
  every serving row), and the rows after them hold no action. Each row starts from an
  uncovered pair of the feature with the most uncovered pairs left, fills the other axes in a
  random order with the feature covering the most uncovered pairs (pairs of an action first),
  and is the best of `tries` such candidates. Rows whose pairs then fit into the others are
  dropped (`_drop_rows`: 109 greedy rows become 100 at seed 0).
  """
  rng = random.Random(seed)
  axes: dict[str, list[str]] = {}
  for f in FEATURES:
    axes.setdefault(f.axis, []).append(f.name)
  refused = {frozenset((a, b)) for a, b, why in pairs() if why}
  # a conversion and another action are not a pair (compat.is_pair): never in one row
  refused |= {frozenset((a.name, b.name)) for a, b in itertools.combinations(FEATURES, 2)
              if a.axis != b.axis and not is_pair(a, b)}
  todo = {frozenset((a, b)) for a, b, why in pairs() if why is None}
  # the serving actions compile what a row holds; a conversion runs on the row's initialised
  # model at the cost of a few eager forwards, so its pairs fill the training rows like any
  # feature's (a conversion and a serving action are never in one row: `refused`)
  actions = {f.name for f in FEATURES if f.action and f.axis != 'conversion'}

  def gain(pair: frozenset, serving: bool) -> int:
    """An uncovered pair of an action weighs more than all other pairs of a row together; a
    serving row takes a feature only for a pair of an action (it compiles what it holds)."""
    return 0 if pair not in todo else 1000 if pair & actions else int(not serving)

  def candidate(a: str, b: str, serving: bool) -> list[str]:
    row = [a, b]
    order = [x for x in axes if x not in (BY_NAME[a].axis, BY_NAME[b].axis)]
    rng.shuffle(order)
    for axis in order:
      best, best_gain = None, 0
      for name in axes[axis]:
        if (not serving and name in actions
            or any(frozenset((name, r)) in refused for r in row)):
          continue
        g = sum(gain(frozenset((name, r)), serving) for r in row)
        if g > best_gain:
          best, best_gain = name, g
      if best is not None:
        row.append(best)
    return row

  rows = []
  while todo:
    serving = any(p & actions for p in todo)
    pool = [p for p in todo if p & actions] if serving else todo
    left = collections.Counter(n for p in pool for n in p)
    top = min(left, key=lambda n: (-left[n], n))
    starts = sorted(tuple(sorted(p)) for p in pool if top in p)
    row = max((candidate(*rng.choice(starts), serving) for _ in range(tries)),
              key=lambda r: sum(gain(frozenset(p), serving) for p in itertools.combinations(r, 2)))
    todo -= {frozenset(p) for p in itertools.combinations(row, 2)}
    rows.append(tuple(sorted(row)))
  return _drop_rows(rows, refused, actions)


def _drop_rows(rows: list[tuple[str, ...]], refused: set[frozenset],
               actions: set[str]) -> list[tuple[str, ...]]:
  """The greedy's rows less those whose pairs fit into the others: a pair that only row R
  holds moves into another row without an action holding one of its features, taking the
  other's axis there if that axis is free, or replacing its feature if every pair of that
  feature in that row is held twice; nothing moves next to a feature it refuses. R is dropped
  when all its own pairs move (rows holding the fewest own pairs are tried first)."""
  rows = [list(r) for r in rows]
  held = collections.Counter(frozenset(p) for r in rows for p in itertools.combinations(r, 2))

  def count(row: list[str], name: str, d: int) -> None:
    for other in row:
      if other != name:
        held[frozenset((name, other))] += d

  def move(i: int, a: str, b: str) -> tuple[int, str, str | None] | None:
    """Puts b next to a in a row other than i; -> (row, b, the feature b replaced)."""
    for j, row in enumerate(rows):
      if j == i or row is None or a not in row or actions & set(row):
        continue
      axis = BY_NAME[b].axis
      old = next((x for x in row if BY_NAME[x].axis == axis), None)
      rest = [x for x in row if x != old]
      if (any(frozenset((b, x)) in refused for x in rest)
          or old is not None and any(held[frozenset((old, x))] < 2 for x in rest)):
        continue
      if old is not None:
        count(row, old, -1)
        row.remove(old)
      row.append(b)
      count(row, b, +1)
      return j, b, old
    return None

  def undo(j: int, b: str, old: str | None) -> None:
    count(rows[j], b, -1)
    rows[j].remove(b)
    if old is not None:
      rows[j].append(old)
      count(rows[j], old, +1)

  dropped = True
  while dropped:
    dropped = False
    own = lambda r: [p for p in itertools.combinations(r, 2) if held[frozenset(p)] == 1]
    for i in sorted((i for i, r in enumerate(rows) if r is not None and not actions & set(r)),
                    key=lambda i: len(own(rows[i]))):
      pairs_i, row = own(rows[i]), rows[i]
      count_row = [frozenset(p) for p in itertools.combinations(row, 2)]
      held.subtract(count_row)
      moves = []
      for a, b in pairs_i:
        m = None if held[frozenset((a, b))] else move(i, a, b) or move(i, b, a)
        if held[frozenset((a, b))] == 0 and m is None:
          break
        if m is not None:
          moves.append(m)
      else:
        rows[i], dropped = None, True
        continue
      for m in reversed(moves):
        undo(*m)
      held.update(count_row)
  return [tuple(sorted(r)) for r in rows if r is not None]


def markdown() -> str:
  """docs/compatibility.md: the features and every refused pair with its reason."""
  lines = ['# Compatibility', '',
           'Generated from `sharenet/config/compat.py` by '
           '`python -m sharenet.config.compat_coverage` (do not edit).',
           'Every pair of features below works, and `tests/compatibility/test_compatibility.py` '
           'trains a config holding it for one step (or runs the action on one), except the pairs '
           'in the second table, which are one `ConfigError` line.', '',
           '| feature | axis | setting |', '|---|---|---|']
  lines += [f'| {f.name} | {f.axis} | `{f.label}` |' if not f.action else
            f'| {f.name} | {f.axis} | (an operation on a trained model) |' for f in FEATURES]
  lines += ['', '`model.moe.dispatch=auto` (the default) runs `moe_ragged_dot` '
            '(`jax.lax.ragged_dot`) on GPU / TPU and `moe_reference` (sorted rows in blocks) on '
            'CPU, where ragged_dot expands to every expert (docs/experts.md).']
  refused = [(a, b, why) for a, b, why in pairs() if why]
  works = len(pairs()) - len(refused)
  lines += ['', f'{works} pairs work; {len(refused)} are refused:', '',
            '| feature | with | why |', '|---|---|---|']
  lines += [f'| {a} | {b} | {why} |' for a, b, why in refused]
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  print(markdown(), end='')
