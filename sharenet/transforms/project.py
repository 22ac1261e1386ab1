"""Post-step projections, placed last in the optax chain: updates = P(params + updates) - params.

  ngpt          every vector living in the embedding space has unit norm (nGPT's
                normalize_matrices, arXiv:2410.01131): embedding / readout rows and every Dense
                kernel normalised along its 'embed' axis (reader kernels' input units, writer
                kernels' output units).
  nap           Normalize-and-Project (Lyle et al., "Normalization and effective learning rates
                in reinforcement learning", NeurIPS 2024, arXiv:2407.01800), part 2: after every
                optimizer step each hidden weight matrix is rescaled to its Frobenius norm at
                initialisation, W <- W ||W_0|| / ||W||, so the parameter norm cannot grow and
                silently decay the effective learning rate (for a weight the loss is
                scale-invariant in, the angular step is ~ lr / ||W||). Part 1 (a norm before each
                nonlinearity) is model.norm.pre_activation, which `nap` requires. Choices:
                  projected   reader and writer kernels (q, k, v, MLP inputs, attention out, MLP
                              out); the untied embedding table and learned positions (the input
                              layer); each stacked set separately;
                  jointly     the gain and offset of each norm inside a block (pre-norms,
                              QK-norm, the pre-activation norms, peri output norms): one joint
                              norm per norm module, kept at its initial value (the paper treats
                              scale/offset apart from the weights, by joint normalization or by
                              regularization; this is the first);
                  left free   the readout, and the embedding table when it is tied to the
                              readout (the final layer, which is not followed by a norm and
                              whose scale sets the logits' temperature); the final norm's gain,
                              which feeds only that layer; biases (the paper drops those a norm
                              makes redundant: model.reader_bias=False); scalars (DyT alpha,
                              ScaleNorm g, the l2 QK-norm logit scale); LoRA factors (B starts at
                              zero, so it has no initial norm to keep).
                The paper's projection may also run every k steps (it reports every step and
                every 1,000 steps alike); here it runs every step. Attention: the paper's
                part 1 targets elementwise nonlinearities; the softmax normalises over keys
                itself, so `nap` does not require QK-norm. Without it W_q and W_k are not
                scale-invariant and their projection bounds the attention logits' scale (a
                constraint, as for the writers, which feed the residual stream rather than a
                norm); model.norm.qk_norm=rms makes them scale-invariant as well. Decoupled
                weight decay only shrinks a matrix radially, which the projection undoes: on
                projected leaves it has no effect (it still acts on the readout). The paper
                states the recipe for MLPs, CNNs, ResNets and transformers in general terms; its
                mapping onto this pre-norm decoder (the embedding as the input layer, the final
                norm free with the readout, writers projected although only jointly
                scale-invariant through the residual stream) is ours.
  norm_project  the projection alone, as `nap` was before it had part 1: every matrix with an
                'embed' axis (readout and embedding included, LoRA excluded) rescaled to its
                initial Frobenius norm; no norm gains. Runs whose config.json says `nap` without a
                model.norm.pre_activation key load as this (sharenet/config/defaults.py).

Under Adam a projection is not equivalent to the matching reparameterization: Adam normalises
the raw gradient, not the projected one.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from sharenet.models.params import NORM_ROLES
from sharenet.transforms.roles import MATRIX_ROLES, Leaf, unit_norm

PROJECTIONS = ('none', 'ngpt', 'nap', 'norm_project')
NORM_TO_INIT = ('nap', 'norm_project')   # projections that keep initial norms in their state


def _ngpt_targets(infos: dict[tuple, Leaf]) -> dict[tuple, Leaf]:
  return {p: l for p, l in infos.items() if l.role in MATRIX_ROLES and l.role != 'lora'
          and l.embed_axis() is not None}


def nap_matrices(infos: dict[tuple, Leaf]) -> dict[tuple, Leaf]:
  """Hidden weight matrices NaP projects one by one (see the module docstring)."""
  tied = not any(l.role == 'readout' for l in infos.values())   # the table is the readout
  inputs = () if tied else ('embedding', 'pos_embed')
  return {p: l for p, l in infos.items() if l.role in ('reader', 'writer') + inputs}


def nap_norm_groups(infos: dict[tuple, Leaf]) -> dict[tuple, list[tuple]]:
  """{norm module: [its gain / offset paths]} for the norms inside blocks (branch set)."""
  groups: dict[tuple, list[tuple]] = {}
  for p, l in infos.items():
    if l.role in NORM_ROLES and l.use in ('gain', 'shift') and l.branch is not None:
      groups.setdefault(p[:-1], []).append(p)
  return groups


def _sq(w: jax.Array, leaf: Leaf) -> jax.Array:
  """Sum of squares over everything but the stack axes (one value per stacked set)."""
  axes = tuple(range(leaf.num_stack, w.ndim))
  return jnp.sum(jnp.square(w), axis=axes, keepdims=True)


def initial_norms(name: str, params: Any, infos: dict[tuple, Leaf]) -> dict[tuple, jax.Array]:
  """{path: norm to keep} for projection `name`; a norm group's members share its joint norm."""
  flat = flatten_dict(params)
  mats = nap_matrices(infos) if name == 'nap' else _ngpt_targets(infos)
  out = {p: jnp.sqrt(_sq(flat[p], l)) for p, l in mats.items()}
  if name == 'nap':
    for members in nap_norm_groups(infos).values():
      joint = jnp.sqrt(sum(_sq(flat[p], infos[p]) for p in members))
      out.update({p: joint for p in members})
  return out


def project(name: str, params: Any, infos: dict[tuple, Leaf], init_norms: Any = None) -> Any:
  """Applies projection `name` to a params tree (leaves without a role are unchanged)."""
  flat = dict(flatten_dict(params))
  if name == 'ngpt':
    for path, leaf in _ngpt_targets(infos).items():
      flat[path] = unit_norm(flat[path], leaf.embed_axis()).astype(flat[path].dtype)
    return unflatten_dict(flat)
  norms = flatten_dict(init_norms)
  mats = nap_matrices(infos) if name == 'nap' else _ngpt_targets(infos)
  groups = [[p] for p in mats]
  if name == 'nap':
    groups += list(nap_norm_groups(infos).values())
  for members in groups:
    cur = jnp.sqrt(sum(_sq(flat[p], infos[p]) for p in members))
    scale = norms[members[0]] / jnp.maximum(cur, 1e-12)
    for p in members:
      flat[p] = (flat[p] * scale).astype(flat[p].dtype)
  return unflatten_dict(flat)


class NapState(NamedTuple):
  init_norms: Any


def projection(name: str, infos: dict[tuple, Leaf]) -> optax.GradientTransformation:
  """The optax transform for `name`; place it last in the chain."""

  def init_fn(params):
    if name not in NORM_TO_INIT:
      return optax.EmptyState()
    return NapState(unflatten_dict(initial_norms(name, params, infos)))

  def update_fn(updates, state, params):
    new = optax.apply_updates(params, updates)
    norms = state.init_norms if name in NORM_TO_INIT else None
    projected = project(name, new, infos, norms)
    return jax.tree.map(lambda a, b: (a - b).astype(b.dtype), projected, params), state

  return optax.GradientTransformation(init_fn, update_fn)
