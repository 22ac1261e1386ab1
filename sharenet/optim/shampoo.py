"""Blocked Shampoo, grafted to Adam's step size or not, as one optax transform.

Shampoo (Gupta, Koren & Singer, "Shampoo: Preconditioned Stochastic Tensor Optimization",
arXiv:1802.09568) preconditions a matrix gradient G (fan_in x fan_out) from both sides:
L <- b2 L + G G^T, R <- b2 R + G^T G, direction (L + eps I)^-1/4 M (R + eps I)^-1/4. As in
Distributed Shampoo (Anil et al., "Scalable Second Order Optimization for Deep Learning",
arXiv:2002.09018) the matrix is cut into blocks of at most block_size x block_size, each with
its own L and R (memory and eigh cost stay bounded as width grows), the inverse roots are
recomputed every `update_every` steps, and each block's direction is grafted to Adam's: scaled
to the Frobenius norm of the Adam update of the same block, so the step size (and the LR that
suits it) is Adam's while Shampoo picks the direction.

M is Adam's bias-corrected first moment (the preconditioner acts on the momentum, so one set
of moments serves both the direction and the graft). Leaves are taken in their matrix view
(stack..., fan_in, fan_out) from the role table (sharenet/models/params.py): leading stack axes
('layers', 'repeats', 'atoms') are separate matrices, never one big one. A tied set is one
stored tensor, so its statistics are built from its summed gradient.

Ragged edges are zero-padded to whole blocks: padded rows and columns of G are zero, so L and
R are block-diagonal [L_real + eps I, eps I] and the cropped result equals the unpadded block's.

graft='none' is vanilla Shampoo: the direction L^-1/4 M R^-1/4 is the step (times the LR), the
setting of Ishikawa & Karakida's second-order muP ("On the Parameterization of Second-Order
Optimization Effective Towards the Infinite Width", arXiv:2312.12226), whose damping scales with
the matrix's shape: `damping(path)` multiplies eps per leaf
(sharenet/parametrization/optimizer_rules.py).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sharenet.kernels import linalg

# (stack_shape, fan_in, fan_out) of a leaf's matrix view, or None for a leaf this never sees.
MatrixDims = tuple[tuple[int, ...], int, int]


GRAFTS = ('adam', 'none')   # train.shampoo.graft: the step size of each block


class ShampooLeaf(NamedTuple):
  """One leaf's blocked statistics and inverse roots, (blocks, b_in, b_in) and (blocks, b_out,
  b_out)."""
  stat_l: jax.Array
  stat_r: jax.Array
  root_l: jax.Array
  root_r: jax.Array


class ShampooState(NamedTuple):
  count: jax.Array
  mu: Any
  nu: Any
  blocks: Any   # ShampooLeaf per leaf


def _block_dims(dims: MatrixDims, block_size: int) -> tuple[int, int, int, int]:
  """(b_in, b_out, blocks along fan_in, blocks along fan_out)."""
  _, fi, fo = dims
  bi, bo = min(block_size, fi), min(block_size, fo)
  return bi, bo, -(-fi // bi), -(-fo // bo)


def to_blocks(x: jax.Array, dims: MatrixDims, block_size: int) -> jax.Array:
  """A leaf -> (blocks, b_in, b_out), zero-padded to whole blocks."""
  stack, fi, fo = dims
  bi, bo, ni, no = _block_dims(dims, block_size)
  x_SIO = x.reshape((-1, fi, fo))
  x_SIO = jnp.pad(x_SIO, ((0, 0), (0, ni * bi - fi), (0, no * bo - fo)))
  x_SiIoO = x_SIO.reshape((-1, ni, bi, no, bo))
  return x_SiIoO.transpose(0, 1, 3, 2, 4).reshape((-1, bi, bo))


def from_blocks(x_NIO: jax.Array, dims: MatrixDims, block_size: int, shape: tuple) -> jax.Array:
  """Inverse of `to_blocks` (crops the padding)."""
  _, fi, fo = dims
  bi, bo, ni, no = _block_dims(dims, block_size)
  x_SioIO = x_NIO.reshape((-1, ni, no, bi, bo))
  x_SIO = x_SioIO.transpose(0, 1, 3, 2, 4).reshape((-1, ni * bi, no * bo))
  return x_SIO[:, :fi, :fo].reshape(shape)


def inverse_root(stat_NDD: jax.Array, eps: float, p: int = 4) -> jax.Array:
  """(S + eps I)^(-1/p) of symmetric PSD blocks, by eigendecomposition in float32."""
  stat_NDD = stat_NDD.astype(jnp.float32)
  eye = jnp.eye(stat_NDD.shape[-1], dtype=jnp.float32)
  w_ND, v_NDD = linalg.per_matrix(jnp.linalg.eigh, stat_NDD + eps * eye[None])
  w_ND = jnp.maximum(w_ND, eps) ** (-1.0 / p)
  return jnp.einsum('nij,nj,nkj->nik', v_NDD, w_ND, v_NDD)


def moments(updates: Any, mu: Any, nu: Any, count: jax.Array, b1: float, b2: float,
            graft: str) -> tuple[Any, Any, jax.Array, Any, Any]:
  """(mu, nu, count, mu_hat, nu_hat) after this step: Adam's moments, which a preconditioner
  reads (its first moment is the preconditioned direction) and a graft sizes its step by (the
  second; with graft='none' it keeps its zeros). Shared with K-FAC (sharenet/optim/kfac.py)."""
  mu = optax.tree.update_moment(updates, mu, b1, 1)
  nu = nu if graft == 'none' else optax.tree.update_moment_per_elem_norm(updates, nu, b2, 2)
  count = optax.safe_increment(count)
  return (mu, nu, count, optax.tree.bias_correction(mu, b1, count),
          optax.tree.bias_correction(nu, b2, count))


def graft_to_adam(dir_NIO: jax.Array, adam_NIO: jax.Array) -> jax.Array:
  """Each matrix (block or stored set) of a direction scaled to the Frobenius norm of Adam's
  update of the same matrix."""
  norm = lambda x: jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True))
  return dir_NIO * norm(adam_NIO) / jnp.maximum(norm(dir_NIO), 1e-30)


def scale_by_shampoo(dims: Callable[[Any], Any], block_size: int, update_every: int,
                     eps: float, b1: float, b2: float,
                     adam_eps: Callable[[tuple], float], graft: str = 'adam',
                     damping: Callable[[tuple], float] = lambda path: 1.0
                     ) -> optax.GradientTransformation:
  """Blocked Shampoo, grafted to Adam per block or not (module docstring).

  `dims(params)` maps the params tree to each leaf's MatrixDims; `adam_eps(path)` is the
  graft's per-leaf Adam eps (the parametrization's eps multipliers apply to it); `damping(path)`
  multiplies `eps`, the damping of each statistic, per leaf.
  """
  if graft not in GRAFTS:
    raise ValueError(f'graft={graft!r}; valid: {", ".join(GRAFTS)}')

  def init_leaf(p, d):
    del p
    bi, bo, ni, no = _block_dims(d, block_size)
    n = math.prod(d[0]) * ni * no
    zl, zr = jnp.zeros((n, bi, bi), jnp.float32), jnp.zeros((n, bo, bo), jnp.float32)
    return ShampooLeaf(zl, zr, zl, zr)

  def init_fn(params):
    blocks = jax.tree.map(init_leaf, params, dims(params))
    return ShampooState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params),
                        optax.tree.zeros_like(params), blocks)

  def update_fn(updates, state, params=None):
    del params
    mu, nu, count, mu_hat, nu_hat = moments(updates, state.mu, state.nu, state.count, b1, b2,
                                            graft)
    refresh = (state.count % update_every) == 0

    def leaf(path, g, m, v, d, blk):
      keys = tuple(getattr(k, 'key', getattr(k, 'name', str(k))) for k in path)
      damp = eps * damping(keys)
      g_NIO = to_blocks(g.astype(jnp.float32), d, block_size)
      stat_l = b2 * blk.stat_l + jnp.einsum('nio,njo->nij', g_NIO, g_NIO)
      stat_r = b2 * blk.stat_r + jnp.einsum('nio,nip->nop', g_NIO, g_NIO)
      root_l, root_r = jax.lax.cond(
          refresh, lambda: (inverse_root(stat_l, damp), inverse_root(stat_r, damp)),
          lambda: (blk.root_l, blk.root_r))
      m_NIO = to_blocks(m.astype(jnp.float32), d, block_size)
      dir_NIO = jnp.einsum('nij,njo,nop->nip', root_l, m_NIO, root_r)
      if graft == 'adam':
        adam = m / (jnp.sqrt(v) + adam_eps(keys))
        dir_NIO = graft_to_adam(dir_NIO, to_blocks(adam.astype(jnp.float32), d, block_size))
      out = from_blocks(dir_NIO, d, block_size, g.shape).astype(g.dtype)
      return out, ShampooLeaf(stat_l, stat_r, root_l, root_r)

    # `updates` is a prefix of every other tree: each leaf gets its dims and ShampooLeaf whole.
    pairs = jax.tree_util.tree_map_with_path(leaf, updates, mu_hat, nu_hat, dims(updates),
                                             state.blocks)
    new_updates = jax.tree.map(lambda _, o: o[0], updates, pairs)
    new_blocks = jax.tree.map(lambda _, o: o[1], updates, pairs)
    return new_updates, ShampooState(count, mu, nu, new_blocks)

  return optax.GradientTransformation(init_fn, update_fn)
