"""What a model's looped segment resolves to: Mixture-of-Recursions' routing (docs/routing.md),
recurrent depth (docs/loops.md) and recursive KV sharing (models/kv_sharing.py).

Each reads the config's sections and the sharing plan, checks what it needs of the rest of the
model (one ConfigError line naming the valid choices), and returns the resolved fields the
ModelConfig (models/config.py) stores.
"""
from __future__ import annotations

from typing import Any

from sharenet.models import sharing
from sharenet.errors import ConfigError



def resolve_routing(c: Any, plan: sharing.SharingPlan) -> dict[str, Any]:
  """Mixture-of-Recursions' resolved values (docs/routing.md), checking what the routing
  section needs of the plan (what routing refuses is the table's, config/compat.py)."""
  rt = c.routing
  expert = rt.kind == 'expert_choice'
  loss_free = rt.kind == 'token_choice' and rt.balancing == 'bias'
  out = dict(
      router_alpha=rt.alpha or (0.1 if expert else 1.0),
      # -1 -> 0.001 BCE, 0.1 balancing loss, 0 under loss-free balancing (the reference drops it)
      aux_loss_coeff=rt.aux_loss if rt.aux_loss >= 0 else
      0.001 if expert else 0.0 if loss_free else 0.1,
      z_loss_coeff=rt.z_loss if rt.z_loss >= 0 else 0.0 if expert else 1e-5,
      loss_free=loss_free, routed_segment=None, recursions=0, capacities=(), expert_buckets=())
  if rt.kind == 'none':
    return out
  s = c.sharing   # routed plans and what routing refuses: the table (config/compat.py)
  seg = 1 if s.scheme == 'middle_cycle' else 0
  R = plan.segments[seg].repeats
  caps = _capacities(rt.capacity, R)
  if len(caps) != R or not all(0 < x <= 1 for x in caps) or \
      any(b > a for a, b in zip(caps, caps[1:])):
    raise ConfigError(f'model.routing.capacity={rt.capacity!r}: needs {R} fractions '
                      f'(one per recursion) in (0, 1], non-increasing; got {caps}')
  if not 0 <= rt.buckets <= R:
    raise ConfigError(f'model.routing.buckets={rt.buckets}: valid: 0 (one scan per '
                      f'recursion) or 1..{R} (R = {R} recursions)')
  out.update(routed_segment=seg, recursions=R, capacities=caps,
             expert_buckets=_buckets(R, rt.buckets))
  return out


def _capacities(capacity: str, R: int) -> tuple[float, ...]:
  """Expert choice: fraction of the sequence kept at each recursion ('' -> (R - r) / R)."""
  if not capacity.strip():
    return tuple((R - r) / R for r in range(R))
  try:
    return tuple(float(x) for x in capacity.replace(' ', '').split(',') if x)
  except ValueError:
    raise ConfigError(f'model.routing.capacity={capacity!r}: expected a comma '
                      f'list of {R} fractions, e.g. "1,0.5"') from None


def _buckets(R: int, n: int) -> tuple[tuple[int, ...], ...]:
  """Expert choice: the recursions grouped into the scans that run them. buckets=0: one per
  recursion (each at its own k_r); n: n contiguous groups, as even as possible with the larger
  ones last (their padded length k is the smaller), each one scan at its first k."""
  if not n:
    return tuple((r,) for r in range(R))
  sizes = [R // n + (i >= n - R % n) for i in range(n)]
  starts = [sum(sizes[:i]) for i in range(n)]
  return tuple(tuple(range(a, a + m)) for a, m in zip(starts, sizes))


LOOPED_SCHEMES = 'cycle, universal, middle_cycle, groups, sandwich'


def resolve_recurrence(c: Any, plan: sharing.SharingPlan,
                        umup_residual: tuple[float, ...]) -> dict[str, Any]:
  """model.recurrence's resolved values (docs/loops.md), checking what it needs of the
  plan: one looped cycle segment, per-layer parts only at the plan's R loops, no routing."""
  rc = c.recurrence
  looped = [i for i, s in enumerate(plan.segments) if s.order == 'cycle' and s.repeats > 1]
  R = plan.segments[looped[0]].repeats if len(looped) == 1 else 0
  mean = rc.mean or R
  out = dict(recurrent_segment=None, depth_mean=float(mean), grad_loops=rc.backprop or int(mean))
  if rc.is_default:
    return out
  what = (f'model.recurrence (depth={rc.depth}, injection={rc.injection}, '
          f'ode_step={rc.ode_step})')
  if len(looped) != 1:
    raise ConfigError(f'{what} loops the plan\'s looped segment; model.sharing.scheme='
                      f'{c.sharing.scheme!r} has {len(looped)}; valid schemes: {LOOPED_SCHEMES}')
  for bad, why in (
      (c.routing.kind != 'none', 'routing picks each token\'s loops itself; valid: '
       'routing.kind=none'),
      (umup_residual, 'the u-muP residual rule counts applied layers, which the depth changes; '
       'valid: another parametrization.kind'),
      ((c.sharing.lora_rank or c.sharing.untie_norms or c.moe.router_per_layer) and
       (rc.depth != 'fixed' or mean != R), f'per-layer parts (lora_rank, untie_norms, '
       f'moe.router_per_layer) exist for the plan\'s {R} loops only; valid: depth=fixed with '
       f'mean 0 or {R}, or none of them'),
      (rc.backprop > mean, f'backprop={rc.backprop} loops with gradient exceed the mean depth '
       f'{mean:g}; valid: 0 (every loop, fixed depth) or 1..{int(mean)}')):
    if bad:
      raise ConfigError(f'{what}: {why}')
  out['recurrent_segment'] = looped[0]
  return out


def kv_segment(c: Any, plan: sharing.SharingPlan) -> int | None:
  """model.kv_sharing=first: the looped segment whose later loops read its first loop's keys
  and values (models/kv_sharing.py); one ConfigError line where the model has none to share."""
  if c.kv_sharing == 'none':
    return None
  looped = [i for i, s in enumerate(plan.segments) if s.order == 'cycle' and s.repeats > 1]
  rc, what = c.recurrence, f'model.kv_sharing={c.kv_sharing!r}'
  depth = rc.mean or (plan.segments[looped[0]].repeats if len(looped) == 1 else 0)
  for bad, why in (
      (len(looped) != 1, f' shares the first loop\'s keys and values with the later loops of the '
       f'plan\'s looped segment; model.sharing.scheme={c.sharing.scheme!r} has {len(looped)}; '
       f'valid schemes: {LOOPED_SCHEMES}, or kv_sharing=none'),
      (c.routing.kind != 'none', ': routed recursions attend among their own tokens (recursive '
       'KV sharing of a routed model is not implemented); valid: routing.kind=none'),
      (rc.depth != 'fixed' or 0 < rc.backprop < depth, ': a no-grad prefix (a sampled depth, or '
       'recurrence.backprop below the depth) would run the first loop, whose keys and values '
       'every later loop reads, without gradient; valid: recurrence.backprop=0, fixed depth')):
    if bad:
      raise ConfigError(what + why)
  return looped[0]


def resolve_slices(c: Any, plan: sharing.SharingPlan, seq_len: int) -> dict[str, Any]:
  """model.loop_slices (SReT's sliced group attention, models/attention.py): group counts G
  for the loops of the plan's looped segment, repeated over them (loop r takes G[r mod len]:
  '2,1' alternates as SReT's two passes of a block do); loop r's layers attend within slices of
  seq_len / G consecutive tokens (the training length, so a slice is the same tokens at any
  call length). Returns the distinct slice lengths and each applied layer's index into
  (full, *lengths)."""
  if not c.loop_slices:
    return dict(slice_lens=(), slice_branch=())
  what = f'model.loop_slices={c.loop_slices!r}'
  try:
    groups = [int(g) for g in str(c.loop_slices).replace(' ', '').split(',')]
  except ValueError:
    raise ConfigError(f'{what} is not a comma list of group counts; valid: e.g. 4,1') from None
  looped = [i for i, s in enumerate(plan.segments) if s.order == 'cycle' and s.repeats > 1]
  if len(looped) != 1:
    raise ConfigError(f'{what} slices the loops of the plan\'s looped segment; '
                      f'model.sharing.scheme={c.sharing.scheme!r} has {len(looped)}; valid '
                      f'schemes: {LOOPED_SCHEMES}')
  seg = plan.segments[looped[0]]
  bad = [g for g in groups if g < 1 or seq_len % g]
  if bad:
    raise ConfigError(f'{what}: group count {bad[0]} does not divide the training sequence '
                      f'length {seq_len} into slices; valid: divisors of {seq_len}')
  lens = tuple(sorted({seq_len // g for g in groups if g > 1}))
  start = sum(s.num_applied for s in plan.segments[:looped[0]])
  branch = [0] * plan.num_layers
  for r in range(seg.repeats):
    g = groups[r % len(groups)]
    for k in range(seg.num_sets):
      branch[start + r * seg.num_sets + k] = lens.index(seq_len // g) + 1 if g > 1 else 0
  return dict(slice_lens=lens, slice_branch=tuple(branch))
