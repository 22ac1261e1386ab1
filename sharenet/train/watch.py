"""train.watch: per-role, per-stored-set and per-applied-layer statistics in the log rows.

At each log step (and only there: the loop dispatches a second compiled step, the watched
one, at those steps; every other step runs the plain program) the row gains, with stable names:

  watch/param_rms/ROLE/setU      RMS of stored set U's ROLE parameters after the step's update
  watch/grad_rms/ROLE/setU       RMS of their gradient (the sum over the set's uses)
  watch/update_rms/ROLE/setU     RMS of the update applied (new - old parameters)
  watch/update_ratio/ROLE/setU   update_rms / the parameters' RMS before the update
  .../ROLE/layerL                the same for per-layer parts (depth-wise LoRA, untied norms)
  .../ROLE                       the same for parameters outside the blocks (embedding, readout,
                                 final norm); transform parameters under their collection's name
  watch/residual_rms/layerL      the RMS of the residual stream after applied layer L (of the
                                 step's forward pass, before the update)
  watch/use_grad_rms/ROLE/layerL   for a stored set applied more than once: the RMS of the
                                 loss's gradient with respect to the weights applied layer L
                                 uses (that use's part of the set's gradient)
  watch/use_grad_share/ROLE/layerL <g_L, G> / |G|^2, G the sum of the set's uses' g: the part
                                 of the set's gradient this use contributes along it (a set's
                                 shares sum to 1; one use near 1 and the others near 0 is a set
                                 whose updates one use dominates, negative shares are uses that
                                 pull against the rest)

ROLE is the parameter role of the role table (reader, writer, norm_in, lora, ...), so the rows
follow the model's structure whatever the module names. A looped segment's layers are its
applied layers in order (config.json's plan_index maps each to its stored set and loop).

The per-use rows come from one more backward pass of the watched step, through the model's
untied view (sharenet/models/streams.py: each applied layer's weights gathered from its set, the
effective weights after transforms and forward multipliers), whose gradient with respect to
layer L's copy is that use's gradient; the step's update is the plain step's. They read the
step's whole batch (its first micro-batch under train.grad_accum) and its loss without the
terms that need the plan's own loops (train.exit_loss: then no per-use rows). A model without an
untied view (Mixture-of-Recursions, recurrent depth, statistics norms) has no per-use rows, and a
routed model (Mixture-of-Recursions) no residual rows (its recursions see token subsets).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

from sharenet.models import layout, param_table, streams
from sharenet.models.config import ModelConfig
from sharenet.models.layers import INTERMEDIATES, WATCH_SUFFIX
from sharenet.models.lm import DecoderLM
from sharenet.models.params import ParamInfo

PREFIX = 'watch/'


def _groups(path: tuple, leaf: Any, info: ParamInfo | None) -> list[tuple[str, jax.Array,
                                                                         jax.Array]]:
  """[(group name, sum of squares, count)] of one leaf: per stored set or applied layer for
  block leaves, one group otherwise."""
  x = jnp.asarray(leaf, jnp.float32)
  if info is None:   # a transform's own parameters (reparam gains): by collection
    return [(path[0], jnp.sum(x * x), jnp.float32(x.size))]
  if not info.in_block:
    return [(info.role, jnp.sum(x * x), jnp.float32(x.size))]
  entries = x.reshape((-1,) + x.shape[info.num_layer_axes:]) if info.num_layer_axes else x[None]
  per = jnp.sum(entries * entries, axis=tuple(range(1, entries.ndim)))
  size = jnp.float32(np.prod(entries.shape[1:]))
  index, kind = (info.sets, 'set') if path[0] == 'params' else (info.layers, 'layer')
  return [(f'{info.role}/{kind}{i}', per[k], size) for k, i in enumerate(index)]


def sums(tree: Any, table: dict[tuple, ParamInfo]) -> dict[str, tuple[jax.Array, jax.Array]]:
  """{group: (sum of squares, count)} of a tree shaped as the trainable variables."""
  out: dict[str, list] = {}
  for path, leaf in flatten_dict(tree).items():
    for name, ss, n in _groups(path, leaf, table.get(path)):
      acc = out.setdefault(name, [jnp.float32(0.0), jnp.float32(0.0)])
      acc[0], acc[1] = acc[0] + ss, acc[1] + n
  return {k: (v[0], v[1]) for k, v in out.items()}


def stats(table: dict[tuple, ParamInfo], old: Any, new: Any, grads: Any) -> dict[str, jax.Array]:
  """The parameter rows of the module docstring (inside the jitted step)."""
  rms = lambda t: {k: jnp.sqrt(ss / n) for k, (ss, n) in sums(t, table).items()}
  before, after = rms(old), rms(new)
  update = rms(jax.tree.map(lambda a, b: jnp.asarray(a, jnp.float32) - b, new, old))
  out = {}
  for k in after:
    out[f'{PREFIX}param_rms/{k}'] = after[k]
    out[f'{PREFIX}update_rms/{k}'] = update[k]
    out[f"{PREFIX}update_ratio/{k}"] = update[k] / jnp.maximum(before[k], 1e-30)
  out.update({f'{PREFIX}grad_rms/{k}': v for k, v in rms(grads).items()})
  return out


def residual(intermediates: Any, num_layers: int) -> dict[str, jax.Array]:
  """watch/residual_rms/layerL from the sown 'residual#rms' scalars: each block's are stacked
  over its uses, and the stack's paths in order are the applied layers in order."""
  values = []
  for path, value in sorted(flatten_dict(intermediates).items()):
    if path[-1] == 'residual' + WATCH_SUFFIX:
      for entry in value if isinstance(value, tuple) else (value,):
        values.append(jnp.ravel(entry))
  layers = jnp.concatenate(values) if values else jnp.zeros((0,))
  if layers.shape[0] != num_layers:
    raise ValueError(f'watch: {layers.shape[0]} residual statistics for {num_layers} layers')
  return {f'{PREFIX}residual_rms/layer{l}': layers[l] for l in range(num_layers)}


def pop_intermediates(metrics: dict[str, Any], num_layers: int, routed: bool = False
                      ) -> dict[str, Any]:
  """The step's metrics with the sown collection replaced by its residual rows (none for a
  routed model: its recursions see token subsets, so no stream is every layer's)."""
  metrics = dict(metrics)
  sown = metrics.pop(INTERMEDIATES)
  return metrics if routed else {**metrics, **residual(sown, num_layers)}


def shared_layers(cfg: ModelConfig) -> list[int]:
  """The applied layers whose stored set is applied more than once (the per-use rows' layers)."""
  index = list(cfg.plan.index)
  return [l for l, u in enumerate(index) if index.count(u) > 1]


def reads_uses(cfg: ModelConfig, exits: bool = False) -> bool:
  """Whether the watched step computes per-use rows: a set applied more than once, an untied
  view (streams.check) and no exit losses (`exits`)."""
  return not exits and bool(shared_layers(cfg)) and streams.missing(cfg, 'train.watch') is None


def uses(cfg: ModelConfig, variables: Any,
         loss_of: Callable[[DecoderLM, Any], jax.Array]) -> dict[str, jax.Array]:
  """The per-use rows: `loss_of(model, variables)` is the step's loss of a model and its
  variables; it is differentiated at the untied view of the effective `variables`."""
  ucfg, untied = layout.to_untied(variables, cfg)
  grads = jax.grad(lambda u: loss_of(DecoderLM(ucfg), u))(untied)
  return use_rows(cfg, ucfg, grads)


def use_rows(cfg: ModelConfig, ucfg: ModelConfig, grads: Any) -> dict[str, jax.Array]:
  """use_grad_rms / use_grad_share of the untied view's gradient `grads` (its set i is applied
  layer i), per role, for the layers of sets applied more than once."""
  table = param_table(ucfg)
  by_role: dict[str, list] = {}
  for path, leaf in flatten_dict(grads['params']).items():
    info = table[('params',) + path]
    if info.in_block:
      x = jnp.asarray(leaf, jnp.float32).reshape((-1,) + leaf.shape[info.num_layer_axes:])
      order = np.argsort(np.asarray(info.sets))   # entry k is applied layer sets[k]
      by_role.setdefault(info.role, []).append(x[order].reshape(x.shape[0], -1))
  index = np.asarray(cfg.plan.index)
  out = {}
  for role, parts in by_role.items():
    g_LN = jnp.concatenate(parts, axis=1)
    if g_LN.shape[0] != len(index):
      raise ValueError(f'watch: {g_LN.shape[0]} uses of {role} for {len(index)} layers')
    for l in shared_layers(cfg):
      total = jnp.sum(g_LN[np.flatnonzero(index == index[l])], axis=0)
      out[f'{PREFIX}use_grad_rms/{role}/layer{l}'] = jnp.sqrt(jnp.mean(g_LN[l] ** 2))
      out[f'{PREFIX}use_grad_share/{role}/layer{l}'] = (
          jnp.vdot(g_LN[l], total) / jnp.maximum(jnp.vdot(total, total), 1e-30))
  return out
