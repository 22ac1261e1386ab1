"""What changed in the config since runs were written: renamed keys and values, removed keys,
and keys whose absence means an older behaviour. `renamed` translates a stored config (a
workdir's config.json) to today's names; `sharenet.config.defaults.complete` then fills it from the
defaults, so an old workdir restores as it was built.
"""
from __future__ import annotations

import copy
from typing import Any

# Keys renamed since runs were written: (group, old) -> new.
RENAMED = {('transforms', 'update'): 'updates'}   # .update is ConfigDict's method
# Values renamed since runs were written: dotted key -> {old: (new, what it means)}. A stored
# config is translated (`renamed`); a value given today is a ConfigError naming the new one.
RENAMED_VALUES = {'model.attention_sharing': {
    'qk_v': ('kv_shared', 'values are the keys'),
    'q_kv': ('qk_shared', 'queries are the keys'),
    'qkv': ('qkv_shared', 'one projection for queries, keys and values')}}
# Keys removed since runs were written, dropped from a stored config: each only ever trained
# at its default (any other value was a ConfigError).
REMOVED = ('model.routing.capacity_warmup_steps',)


def _parent(raw: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
  """The dict in `raw` holding `dotted`'s last key (None if a group is absent), and that key."""
  *groups, key = dotted.split('.')
  node = raw
  for g in groups:
    node = node.get(g) if isinstance(node, dict) else None
  return (node if isinstance(node, dict) else None), key


def renamed(raw: Any) -> dict[str, Any]:
  """A copy of `raw` (a config or a config.json's dict) with old key names (RENAMED) and
  values (RENAMED_VALUES) updated and removed keys (REMOVED) dropped.

  A run written before model.norm.pre_activation existed with transforms.project=nap trained
  the projection alone, which is now called norm_project.
  """
  raw = copy.deepcopy(raw.to_dict() if hasattr(raw, 'to_dict') else raw)
  for (group, old), new in RENAMED.items():
    if isinstance(raw.get(group), dict) and old in raw[group]:
      raw[group].setdefault(new, raw[group].pop(old))
  for dotted, values in RENAMED_VALUES.items():
    node, key = _parent(raw, dotted)
    if node is not None and isinstance(node.get(key), str) and node[key] in values:
      node[key] = values[node[key]][0]
  for dotted in REMOVED:
    node, key = _parent(raw, dotted)
    if node is not None:
      node.pop(key, None)
  norm = raw.get('model', {}).get('norm', {}) if isinstance(raw.get('model'), dict) else {}
  if (isinstance(raw.get('transforms'), dict) and raw['transforms'].get('project') == 'nap'
      and isinstance(norm, dict) and norm and 'pre_activation' not in norm):
    raw['transforms']['project'] = 'norm_project'
  return raw


# Keys whose runs written before them behaved unlike today's default: a config whose group
# exists but lacks the key gets the old behaviour, so old workdirs restore as they were built.
BEFORE_KEY = {('model', 'sharing', 'lora_layers'): 'all'}
