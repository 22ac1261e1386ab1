"""Matrix product operators with a central tensor shared across layers (MPOBERT: Liu, Gao,
Zhao, Wen et al., "Enhancing Scalability of Pre-trained Language Models via Efficient Parameter
Sharing", Findings of EMNLP 2023; the MPO decomposition of Gao et al., "Compressing deep
neural networks by matrix product operators", Phys. Rev. Research 2020).

A kernel W (I x J; I the fan-in, J the fan-out) with I = i_1 ... i_n and J = j_1 ... j_n is the
chain of n local tensors T_k (d_{k-1}, i_k, j_k, d_k), d_0 = d_n = 1:
  W[(i_1..i_n), (j_1..j_n)] = T_1[:, i_1, j_1, :] T_2[:, i_2, j_2, :] ... T_n[:, i_n, j_n, :]
The full bond dimensions d_k = min(prod_{m<=k} i_m j_m, prod_{m>k} i_m j_m) represent any W
exactly (`decompose`: sequential SVDs, as the reference code's Matrix2MPO); model.mpo.bond caps
them (a truncated MPO). The central tensor is T_c, c = n // 2 (the reference's index), the
largest; the others are the auxiliary tensors.

Sharing (model.mpo.cores = n, model.mpo.targets): the central tensor of each target kernel
type is a parameter of DecoderLM outside the stack ('params/mpo/<kernel>'), stored once and
handed to every applied layer through the MASA atoms' channel (block.Shared); the auxiliary
tensors ('<kernel>/mpo_<k>') live in the blocks and follow the sharing plan (untied: one set
per layer). MPOBERT's reference code (lpyhdzx/MPOBERT-code, albert.py `replace`) shares the
central tensor of every layer with layer 0's and keeps per-layer auxiliary tensors, with
LayerNorms and biases shared too (the plan decides those here); the paper's adapters beside the
auxiliary tensors are not in the released code and not built here.

Factor shapes: I and J are each split into n factors as evenly as their prime factors allow
(largest primes first into the smallest factor; 1s where a width has fewer primes than n).

Init (ours; the paper's "stable initialization" is, in the released code, a decomposition of a
pretrained ALBERT, which `convert.py --config.to=mpo` is): T_1 ~ N(0, 1/I), T_k ~ N(0, 1/d_{k-1})
for k > 1, so an entry of W has variance (1/I) prod_k d_k / prod_k d_{k-1} = 1/I, the kernel's
default init.
"""
from __future__ import annotations

import dataclasses
import math

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sharenet.models.params import param

BOND_IN, FACTOR_IN, FACTOR_OUT, BOND_OUT = 'mpo_bond_in', 'mpo_in', 'mpo_out', 'mpo_bond_out'
AXES = (BOND_IN, FACTOR_IN, FACTOR_OUT, BOND_OUT)
ROLE = 'mpo'


def factors(n: int, parts: int) -> tuple[int, ...]:
  """n as `parts` integer factors, as even as its prime factors allow (ascending)."""
  primes, m, p = [], n, 2
  while m > 1:
    while m % p == 0:
      primes.append(p)
      m //= p
    p += 1
  out = [1] * parts
  for q in sorted(primes, reverse=True):
    out[out.index(min(out))] *= q
  return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class MpoShape:
  """The local tensors of one kernel type: factors of I and J and the bond dimensions."""
  ins: tuple[int, ...]
  outs: tuple[int, ...]
  bonds: tuple[int, ...]   # d_0 .. d_n

  @property
  def central(self) -> int:
    return len(self.ins) // 2

  def tensor(self, k: int) -> tuple[int, int, int, int]:
    return (self.bonds[k], self.ins[k], self.outs[k], self.bonds[k + 1])


def full_bonds(ins: tuple[int, ...], outs: tuple[int, ...]) -> tuple[int, ...]:
  """d_0 .. d_n at full rank: d_k = min(prod_{m<=k} i_m j_m, prod_{m>k} i_m j_m)."""
  sizes = [i * j for i, j in zip(ins, outs)]
  return tuple([1] + [min(math.prod(sizes[:k]), math.prod(sizes[k:]))
                      for k in range(1, len(sizes))] + [1])


def mpo_shape(fan_in: int, fan_out: int, cores: int, bond: int) -> MpoShape:
  """The MPO of an I x J kernel with `cores` tensors, bonds capped at `bond` (0: full)."""
  ins, outs = factors(fan_in, cores), factors(fan_out, cores)
  bonds = full_bonds(ins, outs)
  if bond:
    bonds = tuple(min(d, bond) for d in bonds)
  return MpoShape(ins, outs, bonds)


def kernel_dims(specs: dict[str, tuple]) -> dict[str, tuple[int, int, Any]]:
  """{kernel name: (fan-in, fan-out, branch)} of masa.atom_specs-style kernel specs."""
  out = {}
  for name, (shape, _, _, num_in, branch, _) in specs.items():
    out[name] = (math.prod(shape[:num_in]), math.prod(shape[num_in:]), branch)
  return out


def contract(tensors: list[jax.Array], s: MpoShape) -> jax.Array:
  """The I x J matrix of the chain (module docstring)."""
  n = len(tensors)
  acc = tensors[0].reshape(s.ins[0] * s.outs[0], s.bonds[1])        # rows (i_1 j_1)
  for k in range(1, n):
    acc = acc @ tensors[k].reshape(s.bonds[k], -1)                   # rows (.. i_k j_k)
    acc = acc.reshape(-1, s.bonds[k + 1])
  full = acc.reshape(tuple(x for pair in zip(s.ins, s.outs) for x in pair))
  order = tuple(range(0, 2 * n, 2)) + tuple(range(1, 2 * n, 2))   # all i's, then all j's
  return full.transpose(order).reshape(math.prod(s.ins), math.prod(s.outs))


def interleaved(w_IJ: np.ndarray, s: MpoShape) -> np.ndarray:
  """W (I, J) as the array (i_1, j_1, i_2, j_2, ..., i_n, j_n) the chain indexes."""
  n = len(s.ins)
  w = np.asarray(w_IJ, np.float64).reshape(s.ins + s.outs)
  return w.transpose(tuple(x for k in range(n) for x in (k, n + k)))


def chain(m: np.ndarray, ins: tuple[int, ...], outs: tuple[int, ...], bonds: tuple[int, ...]
          ) -> list[np.ndarray]:
  """Sequential SVDs of m (bonds[0], (i_1 j_1) ... (i_n j_n), bonds[-1]) into tensors
  (d_{k-1}, i_k, j_k, d_k) with the given bonds: exact where each bond is the full rank of its cut,
  the leading singular vectors otherwise (the reference's truncation). The tensors left of the
  last are isometries (left-canonical)."""
  out, rest, left = [], np.asarray(m, np.float64).reshape(-1), bonds[0]
  for k in range(len(ins) - 1):
    u, sv, vt = np.linalg.svd(rest.reshape(left * ins[k] * outs[k], -1), full_matrices=False)
    d = bonds[k + 1]
    out.append(u[:, :d].reshape(left, ins[k], outs[k], d))
    rest, left = (sv[:d, None] * vt[:d]).reshape(-1), d
  out.append(rest.reshape(left, ins[-1], outs[-1], -1))
  return out


def decompose(w_IJ: np.ndarray, s: MpoShape) -> list[np.ndarray]:
  """W (numpy) as the chain of `s`: exact at full bonds (module docstring)."""
  return chain(interleaved(w_IJ, s), s.ins, s.outs, s.bonds)


def init_std(s: MpoShape, k: int) -> float:
  """T_1 ~ N(0, 1/I), T_k ~ N(0, 1/d_{k-1}): W at its default variance 1/I."""
  return (math.prod(s.ins) ** -0.5) if k == 0 else s.bonds[k] ** -0.5


def local_tensor(module: nn.Module, name: str, s: MpoShape, k: int, dtype, branch: str | None
                 ) -> jax.Array:
  """Creates local tensor k of an MPO kernel in `module`."""
  return param(module, name, s.tensor(k), AXES, ROLE, std=init_std(s, k), dtype=dtype,
               branch=branch)


class MpoCentral(nn.Module):
  """Creates the central tensor of every target kernel type: {kernel name: T_c}; `dims`:
  ((kernel name, (fan-in, fan-out, branch)), ...) (`kernel_dims`' items; hashable)."""
  dims: Any
  cores: int
  bond: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self) -> dict[str, jax.Array]:
    out = {}
    for name, (fan_in, fan_out, branch) in self.dims:
      s = mpo_shape(fan_in, fan_out, self.cores, self.bond)
      out[name] = local_tensor(self, name, s, s.central, self.param_dtype, branch)
    return out


def kernel(module: nn.Module, central: jax.Array, fan_in: int, fan_out: int, cores: int,
           bond: int, dtype, branch: str | None) -> jax.Array:
  """The I x J kernel of a Dense whose MPO auxiliary tensors `module` holds ('mpo_<k>'), with
  the shared `central` tensor."""
  s = mpo_shape(fan_in, fan_out, cores, bond)
  if central.shape != s.tensor(s.central):
    raise ValueError(f'MPO central tensor {central.shape} does not fit {s.tensor(s.central)}')
  tensors = [central if k == s.central else local_tensor(module, f'mpo_{k}', s, k, dtype, branch)
             for k in range(len(s.ins))]
  return contract(tensors, s)
