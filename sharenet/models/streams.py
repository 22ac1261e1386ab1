"""The residual stream after every applied layer, read through a model's untied view.

A plan's applied layer l computes what layer l of its untied model computes (layout.to_untied:
each applied layer's tied weights, LoRA and per-layer parts gathered into one stacked layer, a
differentiable gather, so the tied sets receive the sum of their uses' gradients). Running that
untied model with the blocks' outputs captured gives the stream after each applied layer in
applied order, whatever the plan's segments and loops, and the same logits as the plan's own
forward. Hidden-state distillation (sharenet/train/distill.py) and the similarity fold
(sharenet/transforms/similarity.py) read layers this way.

Without an untied view: routed recursions (a layer sees a token subset), a model of recurrent
depth (its depth is sampled) and the statistics norms (their running statistics are a
collection the view does not carry); `check` says so in one line.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from sharenet.errors import ConfigError
from sharenet.models import layout
from sharenet.models.block import Block, Stream
from sharenet.models.config import ModelConfig
from sharenet.models.layers import INTERMEDIATES
from sharenet.models.lm import DecoderLM
from sharenet.models.sections import STATS_NORMS


def missing(cfg: ModelConfig, what: str) -> str | None:
  """Why `cfg` has no untied view of its applied layers (one line naming `what` needs it), or
  None when it has one."""
  if cfg.routing.kind != 'none':
    return (f'{what} reads the stream after each applied layer, which a routed model '
            f'(model.routing.kind={cfg.routing.kind}) does not have for every token; valid: a '
            f'model without routing')
  if cfg.recurrent_segment is not None:
    return (f'{what} reads the stream after each applied layer, which a model of sampled '
            f'recurrent depth (model.recurrence) does not fix; valid: a model without '
            f'model.recurrence')
  if cfg.norm.kind in STATS_NORMS:
    return (f'{what} reads the stream after each applied layer through the untied view, which '
            f'does not carry model.norm.kind={cfg.norm.kind}\'s running statistics; valid: a '
            f'norm without statistics (rmsnorm, layernorm, ...)')
  return None


def check(cfg: ModelConfig, what: str) -> None:
  """One ConfigError line if `cfg` has no untied view of its applied layers."""
  reason = missing(cfg, what)
  if reason is not None:
    raise ConfigError(reason)


def _is_block_call(module: Any, method: str) -> bool:
  return isinstance(module, Block) and method == '__call__'


def apply(model: DecoderLM, variables: Any, tokens_BT: jax.Array,
          segment_ids_BT: jax.Array | None = None, mutable: Sequence[str] = ()
          ) -> tuple[jax.Array, jax.Array, Any]:
  """(logits (B, T, V), streams (L, B, T, D), the sown `mutable` collections) of `model` with
  `variables` on `tokens_BT`: the stream after each of the cfg.num_layers applied layers. With
  'intermediates' in `mutable` its collection also holds the blocks' captured outputs (under
  '__call__'), beside what they sowed."""
  cfg = model.cfg
  ucfg, uvars = layout.to_untied(variables, cfg)
  inputs = (tokens_BT,) if segment_ids_BT is None else (tokens_BT, segment_ids_BT)
  logits_BTV, state = DecoderLM(ucfg).apply(
      uvars, *inputs, capture_intermediates=_is_block_call,
      mutable=[INTERMEDIATES] + [m for m in mutable if m != INTERMEDIATES])
  state = dict(state)
  captured = state[INTERMEDIATES] if INTERMEDIATES in mutable else state.pop(INTERMEDIATES)
  streams = [s.x_BTD for s in jax.tree.leaves(captured, is_leaf=lambda x: isinstance(x, Stream))
             if isinstance(s, Stream)]
  if len(streams) != 1:
    raise ValueError(f'expected one captured stack of layer outputs, got {len(streams)}')
  x = streams[0]
  return logits_BTV, jnp.reshape(x, (cfg.num_layers,) + x.shape[-3:]), state
