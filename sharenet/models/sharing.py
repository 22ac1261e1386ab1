"""SharingPlan: which unique parameter set each applied layer uses.

Index formulas follow Relaxed Recursive Transformers (arXiv:2410.20672) as the
Mixture-of-Recursions code implements them (`sharing_strategy`): with L applied layers, K sets
in the shared block and R repeats, cycle uses set `l mod K`, sequence `l // R`; middle variants
keep the first and last layer unique and share the middle L-2 layers the same way.

A plan is a tuple of `Segment`s. Each segment is one nested scan: `order='cycle'` is an outer
scan over repeats (params broadcast = tied) around an inner scan over the K stacked sets;
`order='sequence'` is the reverse nesting. `order='gather'` handles arbitrary explicit lists by
gathering from a pool (memory-heavier: each applied layer gets its own gathered copy).
"""
from __future__ import annotations

import dataclasses

from sharenet.errors import ConfigError

SCHEMES = ('untied', 'universal', 'cycle', 'sequence', 'middle_cycle', 'middle_sequence',
           'sandwich', 'groups', 'explicit')


@dataclasses.dataclass(frozen=True)
class Segment:
  """A run of applied layers executed as one nested scan over `num_sets` stored sets."""
  first_set: int       # global index of this segment's first unique set
  num_sets: int        # K: sets stored (stacked) by this segment
  repeats: int         # R: how often each set is applied
  order: str           # 'cycle' | 'sequence' | 'gather'
  pattern: tuple[int, ...] = ()  # local set index per applied layer, only for 'gather'

  @property
  def num_applied(self) -> int:
    return len(self.pattern) if self.order == 'gather' else self.num_sets * self.repeats

  @property
  def shared(self) -> bool:
    """True if some stored set of this segment is applied more than once."""
    if self.order == 'gather':
      return len(set(self.pattern)) < len(self.pattern)
    return self.repeats > 1

  def local_indices(self) -> tuple[int, ...]:
    if self.order == 'gather':
      return self.pattern
    if self.order == 'cycle':
      return tuple(l % self.num_sets for l in range(self.num_applied))
    return tuple(l // self.repeats for l in range(self.num_applied))


@dataclasses.dataclass(frozen=True)
class SharingPlan:
  """Maps applied layer l to unique set index(l); built from segments."""
  scheme: str
  segments: tuple[Segment, ...]

  @property
  def num_layers(self) -> int:
    return sum(s.num_applied for s in self.segments)

  @property
  def num_unique(self) -> int:
    return sum(s.num_sets for s in self.segments)

  @property
  def index(self) -> tuple[int, ...]:
    return tuple(s.first_set + i for s in self.segments for i in s.local_indices())

  def uses(self, unique_set: int) -> tuple[int, ...]:
    """Applied layers that use `unique_set`."""
    return tuple(l for l, u in enumerate(self.index) if u == unique_set)


def _split(scheme: str, num_layers: int, num_unique: int, repeats: int, field: str) -> tuple[int, int]:
  """Resolves (K, R) with K * R == num_layers from whichever of num_unique / repeats is set."""
  if num_layers < 1:
    raise ConfigError(f'model.num_layers={num_layers}: {scheme} sharing needs more applied layers')
  if num_unique <= 0 and repeats <= 0:
    raise ConfigError(f'model.sharing: scheme {scheme!r} needs num_unique or repeats > 0')
  k = num_unique if num_unique > 0 else num_layers // max(repeats, 1)
  r = repeats if repeats > 0 else num_layers // max(k, 1)
  if k < 1 or r < 1 or k * r != num_layers:
    raise ConfigError(
        f'{field}: scheme {scheme!r} needs (num_unique x repeats) == {num_layers} applied layers, '
        f'got num_unique={num_unique}, repeats={repeats}; valid num_unique are divisors of '
        f'{num_layers}: {[d for d in range(1, num_layers + 1) if num_layers % d == 0]}')
  return k, r


def make_plan(scheme: str, num_layers: int, num_unique: int = 0, repeats: int = 0,
              pattern: tuple[int, ...] | str = ()) -> SharingPlan:
  """Builds the plan for `scheme`; `num_unique` counts all stored sets (middle/sandwich: +2)."""
  L = num_layers
  seg = Segment
  if scheme not in SCHEMES:
    raise ConfigError(f'model.sharing.scheme={scheme!r} is unknown; valid: {", ".join(SCHEMES)}')
  if L < 1:
    raise ConfigError(f'model.num_layers={L} must be >= 1')
  if scheme == 'untied':
    if num_unique not in (0, L) or repeats not in (0, 1):
      raise ConfigError(f'model.sharing: untied stores one set per layer; num_unique must be 0 or '
                        f'{L} and repeats 0 or 1, got {num_unique}, {repeats}')
    return SharingPlan(scheme, (seg(0, L, 1, 'cycle'),))
  if scheme == 'universal':
    if num_unique not in (0, 1) or repeats not in (0, L):
      raise ConfigError(f'model.sharing: universal stores one set; num_unique must be 0 or 1 and '
                        f'repeats 0 or {L}, got {num_unique}, {repeats}')
    return SharingPlan(scheme, (seg(0, 1, L, 'cycle'),))
  if scheme in ('cycle', 'sequence', 'groups'):
    k, r = _split(scheme, L, num_unique, repeats, 'model.sharing.num_unique')
    return SharingPlan(scheme, (seg(0, k, r, 'sequence' if scheme == 'sequence' else 'cycle'),))
  if scheme in ('middle_cycle', 'middle_sequence', 'sandwich'):
    if L < 3:
      raise ConfigError(f'model.num_layers={L}: scheme {scheme!r} needs >= 3 applied layers')
    if scheme == 'sandwich':
      if num_unique not in (0, 3):
        raise ConfigError(f'model.sharing.num_unique={num_unique}: sandwich stores exactly 3 sets '
                          f'(first, shared middle, last); use 0 or 3')
      k, r = 1, L - 2
    else:
      k, r = _split(scheme, L - 2, num_unique - 2 if num_unique > 0 else 0, repeats,
                    'model.sharing.num_unique (counts the unique first and last layers)')
    order = 'sequence' if scheme == 'middle_sequence' else 'cycle'
    return SharingPlan(scheme, (seg(0, 1, 1, 'cycle'), seg(1, k, r, order), seg(1 + k, 1, 1, 'cycle')))
  # explicit
  if isinstance(pattern, str):
    try:
      pattern = tuple(int(p) for p in pattern.replace(' ', '').split(',') if p)
    except ValueError:
      raise ConfigError(f'model.sharing.pattern={pattern!r}: expected comma-separated set indices, '
                        f'e.g. "0,1,1,0"') from None
  pattern = tuple(pattern)
  if len(pattern) != L:
    raise ConfigError(f'model.sharing.pattern has {len(pattern)} entries; needs one per applied '
                      f'layer ({L})')
  used = sorted(set(pattern))
  if used != list(range(len(used))):
    raise ConfigError(f'model.sharing.pattern={pattern}: set indices must be 0..U-1 with every '
                      f'index used; got {used}')
  return SharingPlan(scheme, (seg(0, len(used), 1, 'gather', pattern),))
