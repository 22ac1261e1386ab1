"""Dense (with optional depth-wise LoRA), embedding and rotary positions."""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet import kernels as kernel_lib
# einsum_f32 lives with the kernels (a leaf: kernels import nothing from models); re-exported.
from sharenet.kernels.einsum import einsum_f32
from sharenet.models import curvature, lora_experts, mpo
from sharenet.models.params import PER_LAYER, param


INTERMEDIATES = 'intermediates'
ACTIVATION_SUFFIX = '#x'   # sow_l1's name for the activation itself, inside sow_activations()
_SOW_ACTIVATIONS: list[bool] = []


@contextlib.contextmanager
def sow_activations() -> Iterator[None]:
  """A function traced inside this context has sow_l1 sow each activation itself too, as
  '<name>#x' (float32, entries outside the mask NaN), beside its mean|x|: what the coordinate
  check's change-from-init statistic reads (study.statistic=delta). It is read when a function
  is traced, so a function traced outside it sows the scalars only."""
  _SOW_ACTIVATIONS.append(True)
  try:
    yield
  finally:
    _SOW_ACTIVATIONS.pop()


WATCH_SUFFIX = '#rms'      # the residual stream's RMS, inside watching()
_WATCHING: list[bool] = []


@contextlib.contextmanager
def watching() -> Iterator[None]:
  """A function traced inside this context has each block sow its output stream's RMS as
  'residual#rms' beside the scalars (train.watch's log-step rows, sharenet/train/watch.py);
  read when a function is traced, as sow_activations."""
  _WATCHING.append(True)
  try:
    yield
  finally:
    _WATCHING.pop()


def sow_rms(module: nn.Module, name: str, x: jax.Array) -> None:
  """Sows sqrt(mean x^2) as '<name>#rms' inside watching() when 'intermediates' is mutable."""
  if _WATCHING and module.is_mutable_collection(INTERMEDIATES):
    x = x.astype(jnp.float32)
    module.sow(INTERMEDIATES, name + WATCH_SUFFIX, jnp.sqrt(jnp.mean(x * x)))


def sow_l1(module: nn.Module, name: str, x: jax.Array, mask: jax.Array | None = None) -> None:
  """Sows mean|x| (over `mask` if given) for coordinate checks; free unless requested.

  The statistic is microsoft/mup's coord-check 'l1'. Nothing is
  computed unless the caller made 'intermediates' mutable; inside nn.scan the value is stacked
  per iteration, so every use of a shared block is recorded. Inside sow_activations() the
  activation itself is sown too.
  """
  if not module.is_mutable_collection(INTERMEDIATES):
    return
  a = jnp.abs(x.astype(jnp.float32))
  if mask is None:
    stat = jnp.mean(a)
  else:
    m = jnp.broadcast_to(mask, a.shape)
    stat = jnp.sum(jnp.where(m, a, 0.0)) / jnp.sum(m)
  module.sow(INTERMEDIATES, name, stat)
  if _SOW_ACTIVATIONS:
    full = x.astype(jnp.float32)
    module.sow(INTERMEDIATES, name + ACTIVATION_SUFFIX,
               full if mask is None else jnp.where(m, full, jnp.nan))


def low_precision(dtype: jnp.dtype) -> bool:
  """A compute dtype narrower than float32 (bfloat16): the mixed-precision path."""
  return jnp.finfo(dtype).bits < 32


@jax.custom_vjp
def matmul_rows(x: jax.Array, w: jax.Array) -> jax.Array:
  """x (..., i) @ w (i, o), whose weight gradient is one 2-D matmul over the flattened rows:
  dw = x_(N, i)^T g_(N, o), dx = g w^T.

  The same product and the same gradients as `x @ w` (up to the order of float additions); only
  the program differs. jax's own transpose rule leaves XLA:CPU a dot whose cotangent operand it
  lays out transposed, in a loop fusion with the elementwise backward that runs several times
  slower than the matmul itself (a train step spent ~40 % of its time there: docs/performance.md,
  benchmarks/peer_compare.py). model.dense_grad selects it (auto: on CPU).
  """
  return x @ w


def _matmul_rows_fwd(x, w):
  return x @ w, (x, w)


def _matmul_rows_bwd(res, g):
  x, w = res
  dw = x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])
  return g @ w.T, dw


matmul_rows.defvjp(_matmul_rows_fwd, _matmul_rows_bwd)


def unit_sphere(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
  """A normal draw scaled to unit l2 norm over the last axis (MASA coefficients)."""
  g = jax.random.normal(key, shape, dtype)
  return g / jnp.linalg.norm(g, axis=-1, keepdims=True)


def dense_apply(dense: nn.Module, x: jax.Array, atoms: jax.Array | None,
                route: jax.Array | None = None) -> jax.Array:
  """dense(x), with `atoms` when the kernel is formed from MASA atoms and `route` when it has
  Mixture-of-LoRAs experts (each only when given)."""
  kw = {k: v for k, v in (('atoms', atoms), ('route', route)) if v is not None}
  return dense(x, **kw)


class Dense(nn.Module):
  """y = x W (+ scale * x A B): contracts the last `len(in_axes)` dims of x.

  The kernel has logical axes `in_axes + out_axes` and `role` reader | writer | readout; LoRA
  factors A (in, r) and B (r, out) live in the per-layer collection so they stay untied when the
  kernel is shared (Relaxed Recursive Transformers, arXiv:2410.20672).

  With `mpo_cores` (model.mpo, models/mpo.py) `atoms` is instead the shared central tensor of
  the kernel's matrix product operator and the layer stores its auxiliary tensors.

  Called with `atoms` (S, in..., out...), shared matrix atoms (MASA, arXiv:2508.04581;
  sharenet/models/masa.py), the layer stores no kernel but S coefficients c ('masa_coef', role
  scalar, stacked per stored set like a kernel) and uses W = sum_s c_s atoms_s. The coefficients
  start as a random unit vector, so with atoms drawn at the kernel's init std W has exactly the
  default init's variance (sum_s c_s^2 = 1) and different sets start different.
  """
  features: Sequence[int]
  in_axes: Sequence[str]
  out_axes: Sequence[str]
  role: str = 'reader'
  branch: str | None = None            # residual branch of a block kernel ('attn' | 'mlp')
  use: str | None = None               # singled out by a consumer ('query': query_zero_init)
  init_std: float | None = None        # None -> 1/sqrt(fan_in)
  lora_rank: int = 0
  lora_scale: float = 1.0
  lora_zero: str = 'b'                 # factor initialised to zero: 'b' (LoRA) or 'a'
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  float32_out: bool = False            # low-precision dtype: float32 result (einsum_f32)
  dense_grad: str = 'xla'              # model.dense_grad: auto | xla | rows (matmul_rows)
  lora_experts: int = 0                # Mixture of LoRAs (models/lora_experts.py): N routed
                                       # LoRA experts of lora_rank in the block's params
  mpo_cores: int = 0                   # model.mpo (models/mpo.py): `atoms` is the shared
  mpo_bond: int = 0                    # central tensor, this layer holds the auxiliary ones

  @nn.compact
  def __call__(self, x: jax.Array, atoms: jax.Array | None = None,
               route: jax.Array | None = None) -> jax.Array:
    """`route` (batch..., N): the Mixture-of-LoRAs gates of each row (lora_experts only)."""
    n_in = len(self.in_axes)
    in_shape, out_shape = x.shape[-n_in:], tuple(self.features)
    fan_in, fan_out = math.prod(in_shape), math.prod(out_shape)
    std = self.init_std if self.init_std is not None else fan_in ** -0.5
    in_axes, out_axes = tuple(self.in_axes), tuple(self.out_axes)
    writes = self.role == 'writer'
    if atoms is None:
      kernel = param(self, 'kernel', in_shape + out_shape, in_axes + out_axes, self.role,
                     std=std, dtype=self.param_dtype, num_in=n_in, branch=self.branch,
                     writes=writes, use=self.use)
    elif self.mpo_cores:
      kernel = mpo.kernel(self, atoms, fan_in, fan_out, self.mpo_cores, self.mpo_bond,
                          self.param_dtype, self.branch)
    else:
      if atoms.shape[1:] != in_shape + out_shape:
        raise ValueError(f'MASA atoms {atoms.shape} do not fit the kernel {in_shape + out_shape}')
      coef = param(self, 'masa_coef', atoms.shape[:1], ('atoms',), 'scalar', init=unit_sphere,
                   dtype=self.param_dtype, branch=self.branch)
      kernel = jnp.tensordot(coef, atoms, axes=1)
    batch = x.shape[:-n_in]
    x2 = x.reshape(batch + (fan_in,)).astype(self.dtype)
    w = kernel.reshape(fan_in, fan_out).astype(self.dtype)
    # train.optimizer=kfac: the train step put taps beside the kernel (models/curvature.py)
    tapped = atoms is None and self.has_variable('params', curvature.TAP_IN)
    if tapped:
      x2 = curvature.tap_in(x2.reshape(-1, fan_in),
                            self.get_variable('params', curvature.TAP_IN)).reshape(x2.shape)
    if self.float32_out and low_precision(self.dtype):
      y = einsum_f32('...i,io->...o', x2, w)
    elif kernel_lib.rows_weight_grad(self.dense_grad):
      y = matmul_rows(x2, w)
    else:
      y = x2 @ w
    if tapped:
      y = curvature.tap_out(y.reshape(-1, fan_out),
                            self.get_variable('params', curvature.TAP_OUT)).reshape(y.shape)
    if self.lora_rank and self.lora_experts:   # routed experts instead of depth-wise LoRA
      y = y + lora_experts.delta(self, x2, route, in_shape, out_shape)
    elif self.lora_rank:
      r = self.lora_rank
      zeros = nn.initializers.zeros   # one factor starts at zero, so the delta does
      a_init = dict(init=zeros) if self.lora_zero == 'a' else dict(std=fan_in ** -0.5)
      b_init = dict(std=r ** -0.5) if self.lora_zero == 'a' else dict(init=zeros)
      a = param(self, 'lora_a', in_shape + (r,), in_axes + ('lora',), 'lora', **a_init,
                collection=PER_LAYER, dtype=self.param_dtype, num_in=n_in, branch=self.branch)
      b = param(self, 'lora_b', (r,) + out_shape, ('lora',) + out_axes, 'lora', **b_init,
                collection=PER_LAYER, dtype=self.param_dtype, num_in=1, branch=self.branch,
                writes=writes)
      xa = x2 @ a.reshape(fan_in, r).astype(self.dtype)
      delta = self.lora_scale * (xa @ b.reshape(r, fan_out).astype(self.dtype))
      sow_l1(self, 'lora_xa', xa)          # coordinate checks of the LoRA factors
      sow_l1(self, 'lora_out', delta)
      y = y + delta
    y = y.reshape(batch + out_shape)
    if self.use_bias:
      bias = param(self, 'bias', out_shape, out_axes, 'bias', init=nn.initializers.zeros,
                   dtype=self.param_dtype, branch=self.branch)
      y = y + bias.reshape((1,) * len(batch) + out_shape).astype(y.dtype)
    return y


class Embed(nn.Module):
  """Token embedding table (vocab, embed); `attend` gives tied-readout logits.

  FixNorm (Nguyen & Salazar, arXiv:1910.05895): rows are l2-normalised in the forward pass, scaled
  by sqrt(d) at the input; the tied readout uses the normalised table.
  """
  vocab_size: int
  features: int
  init_std: float = 1.0
  fixnorm: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  axis: str = 'embed'   # the features' logical axis ('embed_factor': models/embeddings.py)

  def setup(self):
    self.embedding = param(self, 'embedding', (self.vocab_size, self.features),
                           ('vocab', self.axis), 'embedding', std=self.init_std,
                           dtype=self.param_dtype, num_in=1,
                           writes=self.axis == 'embed')   # a factorized table's lift writes

  def _table(self) -> jax.Array:
    if not self.fixnorm:
      return self.embedding
    sq = jnp.sum(jnp.square(self.embedding), axis=-1, keepdims=True)
    return self.embedding * jax.lax.rsqrt(jnp.maximum(sq, 1e-12))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = jnp.take(self._table(), tokens, axis=0).astype(self.dtype)
    return x * math.sqrt(self.features) if self.fixnorm else x

  def attend(self, x: jax.Array) -> jax.Array:
    """Tied-readout logits x E^T; float32 under a low-precision dtype (einsum_f32)."""
    table = self._table().astype(self.dtype)
    if low_precision(self.dtype):
      return einsum_f32('...d,vd->...v', x.astype(self.dtype), table)
    return x @ table.T


def rope(x_BTHD: jax.Array, positions_T: jax.Array, base: float,
         freq: jax.Array | None = None) -> jax.Array:
  """Rotary embedding (rotate-half convention) over the last axis, at the frequencies
  base^(-2i/d), or `freq` (d/2,) when given (models/positions.py: RoPE scaling).

  Angles, sin and cos are float32; the rotation runs in float32, or in the activations' own
  dtype when that is narrower (bfloat16: sin and cos are rounded to it, as MaxText does), so no
  float32 copy of q and k is made.
  """
  d = x_BTHD.shape[-1]
  ct = x_BTHD.dtype if low_precision(x_BTHD.dtype) else jnp.float32
  if freq is None:
    freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angle_TF = positions_T[:, None].astype(jnp.float32) * freq[None, :]
  sin = jnp.sin(angle_TF).astype(ct)[None, :, None, :]
  cos = jnp.cos(angle_TF).astype(ct)[None, :, None, :]
  x1, x2 = jnp.split(x_BTHD.astype(ct), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)
