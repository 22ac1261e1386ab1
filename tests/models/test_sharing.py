"""SharingPlan index maps against the published schedules (RRT, arXiv:2410.20672; docs/sharing)."""
import pytest

from sharenet.errors import ConfigError
from sharenet.models.sharing import SCHEMES, make_plan


def reference_index(scheme, L, R):
  """The RRT/MoR index formulas, written out independently."""
  if scheme == 'untied':
    return list(range(L))
  if scheme == 'universal':
    return [0] * L
  if scheme in ('cycle', 'groups'):
    K = L // R
    return [l % K for l in range(L)]
  if scheme == 'sequence':
    return [l // R for l in range(L)]
  K = (L - 2) // R
  if scheme == 'middle_cycle':
    mid = [1 + (l - 1) % K for l in range(1, L - 1)]
  elif scheme == 'middle_sequence':
    mid = [1 + (l - 1) // R for l in range(1, L - 1)]
  else:  # sandwich
    mid = [1] * (L - 2)
  return [0] + mid + [max(mid) + 1]


# Literal rows of the reference's worked example (L=6, 2 loops) plus the other schemes.
L6_TABLE = {
    'cycle': [0, 1, 2, 0, 1, 2],            # A B C A B C
    'sequence': [0, 0, 1, 1, 2, 2],         # A A B B C C
    'middle_cycle': [0, 1, 2, 1, 2, 3],     # U0 A B A B U5
    'middle_sequence': [0, 1, 1, 2, 2, 3],  # U0 A A B B U5
    'sandwich': [0, 1, 1, 1, 1, 2],         # U0 A A A A U5
    'universal': [0] * 6,
    'untied': list(range(6)),
    'groups': [0, 1, 2, 0, 1, 2],           # l mod G, G=3
}


def _kwargs(scheme, L, R):
  if scheme in ('untied', 'universal', 'sandwich'):
    return {}
  if scheme == 'groups':
    return {'num_unique': L // R}
  return {'repeats': R}


@pytest.mark.parametrize('scheme', sorted(L6_TABLE))
def test_l6_two_repeats_matches_reference_table(scheme):
  plan = make_plan(scheme, 6, **_kwargs(scheme, 6, 2))
  assert list(plan.index) == L6_TABLE[scheme] == reference_index(scheme, 6, 2)
  assert plan.num_unique == max(plan.index) + 1
  assert plan.num_layers == 6


@pytest.mark.parametrize('scheme', sorted(L6_TABLE))
def test_l8_four_repeats_matches_reference_formula(scheme):
  if scheme in ('middle_cycle', 'middle_sequence'):
    # 8 - 2 middle layers do not split into 4 repeats: the plan must refuse, naming the field.
    with pytest.raises(ConfigError, match='num_unique'):
      make_plan(scheme, 8, repeats=4)
    R = 3
  else:
    R = 4
  plan = make_plan(scheme, 8, **_kwargs(scheme, 8, R))
  assert list(plan.index) == reference_index(scheme, 8, R)
  if scheme == 'cycle':
    assert list(plan.index) == [0, 1, 0, 1, 0, 1, 0, 1]
  if scheme == 'sequence':
    assert list(plan.index) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_num_unique_counts_all_stored_sets_for_middle_schemes():
  assert make_plan('middle_cycle', 6, num_unique=4).index == (0, 1, 2, 1, 2, 3)
  assert make_plan('cycle', 8, num_unique=4).index == (0, 1, 2, 3, 0, 1, 2, 3)


def test_explicit_pattern_and_uses():
  plan = make_plan('explicit', 5, pattern='0,1,1,0,2')
  assert plan.index == (0, 1, 1, 0, 2)
  assert plan.uses(0) == (0, 3) and plan.uses(2) == (4,)


@pytest.mark.parametrize('kwargs, match', [
    (dict(scheme='spiral', num_layers=6), 'valid: untied'),
    (dict(scheme='cycle', num_layers=6, num_unique=4), 'divisors of 6'),
    (dict(scheme='explicit', num_layers=3, pattern='0,2,2'), 'set indices'),
    (dict(scheme='explicit', num_layers=3, pattern='0,1'), 'one per applied layer'),
    (dict(scheme='sandwich', num_layers=2), '>= 3'),
    (dict(scheme='universal', num_layers=4, num_unique=2), 'universal stores one set'),
])
def test_bad_plans_raise_one_line(kwargs, match):
  with pytest.raises(ConfigError, match=match) as e:
    make_plan(**kwargs)
  assert '\n' not in str(e.value)


def test_every_scheme_listed():
  assert set(L6_TABLE) | {'explicit'} == set(SCHEMES)


@pytest.mark.parametrize('scheme', sorted(L6_TABLE))
def test_segment_is_shared_iff_one_of_its_sets_repeats(scheme):
  """Segment.shared (where lora_layers='shared' puts depth-wise LoRA, RRT arXiv:2410.20672):
  true exactly when a set index repeats among the segment's applied layers of the literal
  table. Embedding tying plays no part in plans, so these tests have no tied variant."""
  plan = make_plan(scheme, 6, **_kwargs(scheme, 6, 2))
  start = 0
  for seg in plan.segments:
    rows = L6_TABLE[scheme][start:start + seg.num_applied]
    assert seg.shared == (len(set(rows)) < len(rows)), (scheme, rows)
    start += seg.num_applied
  middle = scheme in ('middle_cycle', 'middle_sequence', 'sandwich')
  assert [s.shared for s in plan.segments] == ([False, True, False] if middle else
                                               [scheme not in ('untied',)])
