"""Typed, frozen config sections (train, data, mesh, transforms), generated from the defaults.

Each key is written once, in sharenet/config/defaults.py, with its default and its comment;
the section classes here are made from that tree (a field per key, typed by its default's type,
a nested section per nested group), so a key added there is a field here. The experiment config
is read into them once, at the top (sharenet/train/experiment.py `resolve`); the modules below
receive the sections and read fields (`t.lr`), never the ConfigDict. The model's section and the
parametrization group are ModelConfig (models/config.py) and Settings (models/scaling.py), which
add their own checks and resolved values.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from sharenet.config import defaults
from sharenet.errors import ConfigError

_DEFAULTS = defaults.default_config()


class Section:
  """Read-only mapping access beside the fields, for code written against a ConfigDict group:
  `s.get(key, default)`, `key in s`, `s[key]`, `s.to_dict()`."""

  def get(self, key: str, default: Any = None) -> Any:
    return getattr(self, key, default)

  def __contains__(self, key: str) -> bool:
    return key in self.__dataclass_fields__

  def __getitem__(self, key: str) -> Any:
    if key not in self:
      raise KeyError(key)
    return getattr(self, key)

  def keys(self) -> list[str]:
    return list(self.__dataclass_fields__)

  def to_dict(self) -> dict[str, Any]:
    """The section as the config stores it (nested dicts, tuples as lists in JSON)."""
    return {k: v.to_dict() if isinstance(v, Section) else v
            for k, v in ((k, getattr(self, k)) for k in self.keys())}


def _freeze(value: Any) -> Any:
  return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


def _section_class(name: str, node: Any) -> type:
  """A frozen dataclass with one field per key of the defaults' group `node`."""
  fields = []
  for key, default in node.items():
    if hasattr(default, 'items'):
      sub = _section_class(f'{name}_{key}', default)
      fields.append((key, sub, dataclasses.field(default_factory=sub)))
    else:
      fields.append((key, type(default), dataclasses.field(default=_freeze(default))))
  return dataclasses.make_dataclass(name, fields, bases=(Section,), frozen=True)


TrainConfig = _section_class('TrainConfig', _DEFAULTS.train)
DataConfig = _section_class('DataConfig', _DEFAULTS.data)
MeshConfig = _section_class('MeshConfig', _DEFAULTS.mesh)
TransformsConfig = _section_class('TransformsConfig', _DEFAULTS.transforms)
SECTIONS = {'train': TrainConfig, 'data': DataConfig, 'mesh': MeshConfig,
            'transforms': TransformsConfig}


def read(cls: type, node: Any, prefix: str) -> Any:
  """The section `cls` from the config group `node` (a ConfigDict or dict; keys it lacks take
  the defaults, as an old workdir's config.json); a key the section lacks is one error line."""
  node = node.to_dict() if hasattr(node, 'to_dict') else dict(node or {})
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(node) - set(fields))
  if unknown:
    raise ConfigError(f'{prefix}.{unknown[0]} is not a config key; valid: '
                      f'{", ".join(sorted(fields))}')
  kw = {}
  for key, value in node.items():
    sub = fields[key].type
    kw[key] = read(sub, value, f'{prefix}.{key}') if isinstance(sub, type) and \
        issubclass(sub, Section) else _freeze(value)
  return cls(**kw)
