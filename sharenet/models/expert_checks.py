"""What SwitchHead attention and Mixture-of-LoRAs experts need of the rest of the model
(model.moe.attention, model.moe.lora_experts; docs/experts.md): one ConfigError line each.

Read by models/config.py when a ModelConfig is resolved; takes the config duck-typed so it
imports nothing of the model.
"""
from __future__ import annotations

from typing import Any

from sharenet.errors import ConfigError

SWITCH_REPLACES = ('v', 'o')   # the projections SwitchHead makes experts
LORA_EXPERT_TARGETS = ('mlp_in', 'mlp_out')


def kernel_targets(c: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """(key, kernels) of each kernel-target list that is on: depth-wise LoRA's
  (model.sharing.lora_targets with lora_rank > 0), MASA's (model.masa.targets with atoms) and
  the parameter bank's (model.bank.targets with a size)."""
  return tuple((field, tuple(targets)) for field, targets, on in (
      ('sharing.lora_targets', c.sharing.lora_targets, c.sharing.lora_rank),
      ('masa.targets', c.masa.targets, c.masa.atoms),
      ('bank.targets', c.bank.targets, c.bank.size)) if on)


def check(c: Any) -> None:
  """ConfigError for a SwitchHead or Mixture-of-LoRAs setting that does not compose."""
  if c.moe.attention == 'switchhead':
    _check_switchhead(c)
  if c.moe.lora_experts:
    _check_lora_experts(c)


def _check_switchhead(c: Any) -> None:
  what = 'model.moe.attention=switchhead'
  if c.attention_sharing != 'none':
    raise ConfigError(f'{what} with model.attention_sharing={c.attention_sharing!r}: the '
                      f'value experts replace the stored v projection that the sharing modes '
                      f'tie; valid: attention_sharing=none, or moe.attention=none')
  for field, targets in kernel_targets(c):
    hit = [t for t in targets if t in SWITCH_REPLACES]
    if hit:
      raise ConfigError(f'{what} replaces the v / o projections that model.{field} names '
                        f'({",".join(hit)}); valid: targets among q,k,mlp_in,mlp_out')
  if c.proj_bias != 'none':
    raise ConfigError(f'{what} with model.proj_bias={c.proj_bias!r}: the value / output experts '
                      f'carry no biases; valid: proj_bias=none, or moe.attention=none')
  if c.parametrization.kind == 'umup':
    raise ConfigError(f'{what}: u-muP\'s unit-scaled attention has no rule for the experts\' '
                      f'sigmoid gates; valid: parametrization.kind sp, mup, mup_table3 or '
                      f'completep')


def _check_lora_experts(c: Any) -> None:
  n, s = c.moe.lora_experts, c.sharing
  what = f'model.moe.lora_experts={n}'
  if not s.lora_rank:
    raise ConfigError(f'{what} needs the experts\' rank model.sharing.lora_rank >= 1; valid: '
                      f'lora_rank >= 1, or lora_experts=0')
  if not any(t in LORA_EXPERT_TARGETS for t in s.lora_targets):
    raise ConfigError(f'{what}: model.sharing.lora_targets={",".join(s.lora_targets)} names no '
                      f'feed-forward kernel for the experts; valid: targets including mlp_in '
                      f'and / or mlp_out')
  if c.moe.kind != 'none':
    raise ConfigError(f'{what} puts LoRA experts on the dense feed-forward, which '
                      f'model.moe.kind={c.moe.kind!r} replaces; valid: moe.kind=none, or '
                      f'lora_experts=0')
  if c.norm.pre_activation != 'none':
    raise ConfigError(f'{what}: model.norm.pre_activation={c.norm.pre_activation!r} is not '
                      f'built with routed LoRA experts; valid: none')
