"""Exceptions shared across sharenet."""


class ConfigError(ValueError):
  """A config field has an invalid value; the message names the field."""
