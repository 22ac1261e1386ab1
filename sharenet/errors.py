"""Exceptions shared across sharenet."""


class ConfigError(ValueError):
  """A config field has an invalid value; the message names the field."""


def require(ok: bool, message: str) -> None:
  """ConfigError(message) unless `ok`."""
  if not ok:
    raise ConfigError(message)


class NonFiniteLoss(RuntimeError):
  """Training hit a non-finite loss or gradient norm; the message names the step."""
