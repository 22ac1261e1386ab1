"""Kronecker-factor taps: K-FAC's statistics of each dense kernel, read back from cotangents.

K-FAC (Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
Curvature", arXiv:1503.05671) approximates a dense layer's Fisher block by A (x) G, with
A = E[a a^T] over the layer's input rows a and G = E[g g^T] over the loss gradients g at its
output rows. train.optimizer=kfac (sharenet/optim/kfac.py) needs both per stored set of every
hidden kernel. JAX functions cannot write state, so, as the statistics norms do
(models/norm_stats.py), the statistics leave the differentiated forward as cotangents: the
train step puts two zero-valued taps beside each tapped kernel in the 'params' tree it applies
(`insert`), `TAP_IN` (fan_in, fan_in) and `TAP_OUT` (fan_out, fan_out), and the Dense layer
(models/layers.py) passes its rows through `tap_in` and its product through `tap_out`. Their
values are identities; their cotangents are

    d TAP_IN  = x^T x / N            the mean outer product of the N input rows
    d TAP_OUT = N dy^T dy            the mean outer product of the per-row gradients N dy

(dy is the gradient of the token-mean loss, so N dy is a row's own loss gradient when every
position is a target). The taps are stored as their kernel is: stacked over its stored sets,
broadcast over the repeats that share it, gathered by an explicit pattern, passed to each
routed recursion. So the cotangent a tap receives is the sum over the applied layers using the
set, computed by the same autodiff that sums a tied kernel's gradient: K-FAC's "expand"
treatment of weight sharing (Eschenhagen et al., "Kronecker-Factored Approximate Curvature for
Modern Neural Network Architectures", arXiv:2311.00636), each use's rows further examples.

Only kernels a Dense layer creates as 'kernel' with a hidden role (reader, writer) are tapped
(`tapped`); model.moe's expert stacks, MASA atoms and MPO cores are not, and the compatibility
table refuses them beside kfac.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

TAP_IN = 'kfac_in'
TAP_OUT = 'kfac_out'
TAPPED_ROLES = ('reader', 'writer')


def _outer(rows_NC: jax.Array, scale: float) -> jax.Array:
  """scale * rows^T rows in float32 (C, C)."""
  return jnp.einsum('ni,nj->ij', rows_NC, rows_NC, preferred_element_type=jnp.float32) * scale


@jax.custom_vjp
def tap_in(x_NI: jax.Array, tap_II: jax.Array) -> jax.Array:
  """x itself; the cotangent of `tap_II` is x^T x / N (float32)."""
  del tap_II
  return x_NI


def _tap_in_fwd(x_NI, tap_II):
  del tap_II
  return x_NI, x_NI


def _tap_in_bwd(x_NI, dx_NI):
  return dx_NI, _outer(x_NI, 1.0 / x_NI.shape[0])


tap_in.defvjp(_tap_in_fwd, _tap_in_bwd)


@jax.custom_vjp
def tap_out(y_NO: jax.Array, tap_OO: jax.Array) -> jax.Array:
  """y itself; the cotangent of `tap_OO` is N dy^T dy (float32), dy the cotangent of y."""
  del tap_OO
  return y_NO


def _tap_out_fwd(y_NO, tap_OO):
  del tap_OO
  return y_NO, None


def _tap_out_bwd(res, dy_NO):
  del res
  return dy_NO, _outer(dy_NO, float(dy_NO.shape[0]))


tap_out.defvjp(_tap_out_fwd, _tap_out_bwd)


def tapped(table: dict) -> dict[tuple, Any]:
  """{kernel path: ParamInfo} of the kernels that carry taps (module docstring), from the role
  table (models.param_table)."""
  return {k: i for k, i in table.items()
          if k[0] == 'params' and k[-1] == 'kernel' and i.role in TAPPED_ROLES
          and not {'experts', 'atoms'} & set(i.axes)}


def zeros(table: dict) -> dict:
  """The taps of every tapped kernel, zero-valued: {'params': nested dict of {TAP_IN, TAP_OUT}
  beside each kernel's module}, stacked as the kernel is (its stack axes first)."""
  flat = {}
  for k, i in tapped(table).items():
    stack = i.stack_shape
    flat[k[:-1] + (TAP_IN,)] = jnp.zeros(stack + (i.fan_in, i.fan_in), jnp.float32)
    flat[k[:-1] + (TAP_OUT,)] = jnp.zeros(stack + (i.fan_out, i.fan_out), jnp.float32)
  return unflatten_dict(flat)


def insert(variables: dict, taps: dict) -> dict:
  """`variables` with the `taps` tree (as `zeros` builds it) merged into its 'params'."""
  flat = flatten_dict(dict(variables))
  flat.update(flatten_dict(taps))
  return unflatten_dict(flat)


def statistics(cotangents: dict, table: dict) -> dict[tuple, tuple[jax.Array, jax.Array]]:
  """{kernel path: (A, G)} from the taps' cotangents, each (stack..., fan, fan): G summed over
  the set's applied layers, A their mean (so a set used once per layer or R times has A on the
  scale of its input rows, and A (x) G sums the uses' Fisher blocks when the uses' statistics
  agree; module docstring)."""
  flat = flatten_dict(cotangents)
  out = {}
  for k, i in tapped(table).items():
    uses = jnp.asarray(i.uses if i.uses else (1,), jnp.float32)
    uses = uses.reshape(i.stack_shape + (1, 1)) if i.stack_shape else uses[0]
    a = flat[k[:-1] + (TAP_IN,)] / uses
    out[k] = (a, flat[k[:-1] + (TAP_OUT,)])
  return out
