"""Residual add + normalization, fused: one Pallas kernel family, forward and backward.

    s = x + residual          (the residual stream after a branch; residual may be None: s = x)
    y = norm(s) * gain + bias

for the three row norms of sharenet/models/norms.py (papers in docs/references.md):

  layernorm  (s - mean) / sqrt(var + eps)                                (Ba et al.)
  rmsnorm    s / sqrt(mean(s^2) + eps)                                   (Zhang & Sennrich)
  crmsnorm   s / sqrt((sum s^2 + (sum s)^2) / (d + 1) + eps)             (Jiang et al.)

Both s and y come back, so a pre-norm block carries s as its stream and feeds y to the next
branch: one pass over HBM instead of an add kernel plus a norm kernel. Statistics are float32
(the promoted input dtype for float64); s and y are in the input dtype, exactly as
`sharenet.models.norms.Norm` computes them, so `reference_add_norm` is bit-identical to
`x + residual` followed by `Norm`.

`add_norm` is a jax.custom_vjp whose forward and backward are `pl.pallas_call`s over row
blocks of the input flattened to (N, D); any leading shape works. The forward saves s and the
per-row 1/rms (and mean, for layernorm); the backward kernel recomputes the normalized row
and writes ds = ds_out + dy-path (the cotangent of x, and of the residual: they are equal) and
one partial dgain / dbias row per block, summed over blocks in jnp. Memory traffic per call,
with b bytes per element: forward reads x and residual and writes s and y (4 N D b; 2 N D b
without a residual, which writes no s), plus 4-8 bytes per row of statistics; backward reads
s, dy, ds_out and writes dx (4 N D b). `forward_bytes` gives the exact count.

Lowering constraints (a shape outside them falls back to `reference_add_norm` with a note
from sharenet.kernels.note_fallback):
  * a block holds whole rows (the reduction is over D inside one program) and `block_rows`
    rows; N is padded with zero rows to a multiple of block_rows (zero rows normalize to zero).
  * GPU (Triton): every block dimension must be a power of two, so D must be one and
    block_rows is one; a block keeps at most GPU_BLOCK_ELEMENTS elements (registers).
  * TPU (Mosaic): the last two block dims must be divisible by (8, 128) or equal the array's:
    D is the whole row, block_rows is a multiple of 8, the statistics are (N, 1) columns and
    the partial gains (blocks, 1, D); a block keeps at most TPU_BLOCK_BYTES of float32 (VMEM).
  * CPU: interpret mode only (sharenet.kernels.interpret), ~500x slower than jnp: tests.
The tests (tests/kernels/test_kernel_norms.py) run interpret mode; tests/kernels/test_lowering.py
lowers the
kernels with Mosaic and Triton at pod widths and lengths (no compile: no accelerator yet). Under
a mesh each device runs them on its own rows (sharenet/kernels/partition.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from sharenet import kernels as K
from sharenet.kernels import partition

KINDS = ('layernorm', 'rmsnorm', 'crmsnorm')
GPU_BLOCK_ELEMENTS = 8192      # rows * D per Triton program (fp32 working set in registers)
TPU_BLOCK_BYTES = 1 << 20      # rows * D * 4 per Mosaic block (several live copies in VMEM)
MAX_BLOCK_ROWS = 256


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f'add_norm: norm {kind!r} has no fused kernel; valid: {", ".join(KINDS)}')


def _compute_dtype(dtype) -> jnp.dtype:
  return jnp.promote_types(dtype, jnp.float32)


def _inv_rms(s, kind: str, eps: float):
  """Per-row (rstd, mean) of s (compute dtype, last axis); mean is None except for layernorm.

  The op order is Norm's (sharenet/models/norms.py), so the reference is bit-identical to it.
  """
  d = s.shape[-1]
  mean = None
  if kind == 'layernorm':
    mean = jnp.mean(s, axis=-1, keepdims=True)
    s = s - mean
  sq = jnp.sum(jnp.square(s), axis=-1, keepdims=True)
  if kind == 'crmsnorm':
    total = jnp.sum(s, axis=-1, keepdims=True)
    ms = (sq + jnp.square(total)) / (d + 1)
  else:
    ms = sq / d
  return jax.lax.rsqrt(ms + eps), mean


def reference_add_norm(x, residual, gain, bias, *, kind: str, eps: float):
  """(s, y): s = x + residual (or x), y = norm(s) * gain + bias, in plain jnp (the XLA path).

  x, residual: (..., D), one dtype; gain, bias: (D,) or None. Statistics in float32 (or the
  promoted input dtype); s and y in x's dtype. Same numbers as `sharenet.models.norms.Norm`.
  """
  _check_kind(kind)
  s = x if residual is None else x + residual
  sf = s.astype(_compute_dtype(s.dtype))
  rstd, mean = _inv_rms(sf, kind, eps)
  bshape = (1,) * (s.ndim - 1) + (s.shape[-1],)
  if mean is not None:
    sf = sf - mean
  y = sf * rstd
  if gain is not None:
    y = y * gain.reshape(bshape)
  if bias is not None:
    y = y + bias.reshape(bshape)
  return s, y.astype(s.dtype)


# ---- shapes the kernels take --------------------------------------------------------------

def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def block_rows_for(n_rows: int, d: int, platform: str | None = None) -> int:
  """Rows per block: as many as the platform's block budget allows, at most MAX_BLOCK_ROWS and
  max(8, N), rounded down to a power of two (Triton); >= 8 except on GPU (Mosaic's sublane
  tile). Interpret mode on CPU takes the TPU budget: few grid steps, which is what costs there.
  """
  platform = platform or K.backend()
  if platform == 'gpu':
    rows = max(1, GPU_BLOCK_ELEMENTS // d)
  else:
    rows = max(8, TPU_BLOCK_BYTES // (4 * d))
  rows = min(rows, MAX_BLOCK_ROWS, max(8, n_rows))
  return 1 << (rows.bit_length() - 1)    # round down to a power of two


def unsupported(shape: tuple[int, ...], platform: str | None = None) -> str | None:
  """Why the kernel cannot take input of this shape on the platform (None: it can)."""
  platform = platform or K.backend()
  d = shape[-1] if shape else 0
  if not shape or d < 1:
    return f'input shape {tuple(shape)} (needs a last axis D >= 1)'
  if platform == 'gpu':
    if not _pow2(d):
      return f'D={d} on GPU (Triton blocks need a power-of-two row length)'
    if d > GPU_BLOCK_ELEMENTS:
      return f'D={d} on GPU (a row exceeds the {GPU_BLOCK_ELEMENTS}-element block budget)'
  if platform == 'tpu' and 8 * 4 * d > 4 * TPU_BLOCK_BYTES:
    return f'D={d} on TPU (8 rows exceed the VMEM block budget)'
  return None


def forward_bytes(shape: tuple[int, ...], dtype, *, has_residual: bool = True,
                  kind: str = 'rmsnorm', has_bias: bool = False) -> int:
  """HBM bytes one forward call moves: x (+ residual) in, (s +) y out, stats out, gain (+ bias)
  in. The figure a benchmark divides by time for its fraction of HBM bandwidth."""
  d = shape[-1]
  n = 1
  for a in shape[:-1]:
    n *= a
  b = jnp.dtype(dtype).itemsize
  row_arrays = 4 if has_residual else 2
  stats = 2 if kind == 'layernorm' else 1
  return row_arrays * n * d * b + stats * n * 4 + (2 if has_bias else 1) * d * 4


# ---- kernels --------------------------------------------------------------------------------

def _normalized(sf, kind, rstd, mean):
  return (sf - mean if kind == 'layernorm' else sf) * rstd


def _fwd_kernel(*refs, kind, eps, has_residual, has_bias):
  refs = list(refs)
  x_ref = refs.pop(0)
  r_ref = refs.pop(0) if has_residual else None
  g_ref = refs.pop(0)
  b_ref = refs.pop(0) if has_bias else None
  s_ref = refs.pop(0) if has_residual else None
  y_ref, rstd_ref = refs.pop(0), refs.pop(0)
  mean_ref = refs.pop(0) if kind == 'layernorm' else None

  s = x_ref[...]
  if has_residual:
    s = s + r_ref[...]
    s_ref[...] = s
  sf = s.astype(rstd_ref.dtype)
  rstd, mean = _inv_rms(sf, kind, eps)
  y = _normalized(sf, kind, rstd, mean) * g_ref[...].astype(sf.dtype)
  if has_bias:
    y = y + b_ref[...].astype(sf.dtype)
  y_ref[...] = y.astype(y_ref.dtype)
  rstd_ref[...] = rstd
  if mean_ref is not None:
    mean_ref[...] = mean


def _bwd_kernel(*refs, kind, has_bias):
  """dx = ds_out + rstd * (g - xh * sum(g xh) / d - mean(g) [layernorm only]), g = dy * gain,
  xh the normalized row; crmsnorm: dx = ds_out + rstd * (g - sum(g xh) (xh + sum xh) / (d + 1)).
  Partial dgain = sum over the block's rows of dy * xh (dbias: of dy)."""
  refs = list(refs)
  s_ref, rstd_ref = refs.pop(0), refs.pop(0)
  mean_ref = refs.pop(0) if kind == 'layernorm' else None
  g_ref, dy_ref, dso_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  dx_ref, dg_ref = refs.pop(0), refs.pop(0)
  db_ref = refs.pop(0) if has_bias else None

  ct = rstd_ref.dtype
  d = s_ref.shape[-1]
  sf = s_ref[...].astype(ct)
  rstd = rstd_ref[...]
  xh = _normalized(sf, kind, rstd, None if mean_ref is None else mean_ref[...])
  dy = dy_ref[...].astype(ct)
  dxh = dy * g_ref[...].astype(ct)
  proj = jnp.sum(dxh * xh, axis=-1, keepdims=True)
  if kind == 'crmsnorm':
    ds = dxh - proj * (xh + jnp.sum(xh, axis=-1, keepdims=True)) / (d + 1)
  else:
    ds = dxh - xh * (proj / d)
    if kind == 'layernorm':
      ds = ds - jnp.mean(dxh, axis=-1, keepdims=True)
  ds = rstd * ds + dso_ref[...].astype(ct)
  dx_ref[...] = ds.astype(dx_ref.dtype)
  dg_ref[...] = jnp.sum(dy * xh, axis=0, keepdims=True)
  if has_bias:
    db_ref[...] = jnp.sum(dy, axis=0, keepdims=True)


def _compiler_params():
  """Triton: 4 warps (a block holds <= GPU_BLOCK_ELEMENTS). Mosaic: row blocks are independent
  (each backward block writes its own partial gain row), so the grid may split across cores."""
  if K.interpret():
    return None
  if K.backend() == 'gpu':
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=4)
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.CompilerParams(dimension_semantics=('parallel',))


def _rows(a, n_pad):
  """(..., D) -> (N + pad, D)."""
  a = a.reshape(-1, a.shape[-1])
  return jnp.pad(a, ((0, n_pad - a.shape[0]), (0, 0))) if n_pad != a.shape[0] else a


def _row_spec(rows, d):
  return pl.BlockSpec((rows, d), lambda i: (i, 0))


def _col_spec(rows):
  return pl.BlockSpec((rows, 1), lambda i: (i, 0))


def _vec_spec(d):
  return pl.BlockSpec((1, d), lambda i: (0, 0))


def _partial_spec(d):
  """Block i's partial gain row of a (blocks, 1, D) array; the leading dim is squeezed, so the
  kernel sees (1, D), whose dims equal the array's last two (Mosaic's rule)."""
  return pl.BlockSpec((None, 1, d), lambda i: (i, 0, 0))


def _forward(x, residual, gain, bias, kind, eps, block_rows):
  shape, dtype, d = x.shape, x.dtype, x.shape[-1]
  n = x.size // d
  rows = block_rows or block_rows_for(n, d)
  n_pad = -(-n // rows) * rows
  ct = _compute_dtype(dtype)
  has_residual, has_bias = residual is not None, bias is not None
  inputs = [_rows(x, n_pad)] + ([_rows(residual, n_pad)] if has_residual else [])
  inputs += [gain.reshape(1, d)] + ([bias.reshape(1, d)] if has_bias else [])
  in_specs = [_row_spec(rows, d)] * (1 + has_residual) + [_vec_spec(d)] * (1 + has_bias)
  row = jax.ShapeDtypeStruct((n_pad, d), dtype)
  col = jax.ShapeDtypeStruct((n_pad, 1), ct)
  n_stats = 2 if kind == 'layernorm' else 1
  out_shape = [row] * (1 + has_residual) + [col] * n_stats
  out_specs = [_row_spec(rows, d)] * (1 + has_residual) + [_col_spec(rows)] * n_stats
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, kind=kind, eps=eps, has_residual=has_residual,
                        has_bias=has_bias),
      out_shape=out_shape, grid=(n_pad // rows,), in_specs=in_specs, out_specs=out_specs,
      interpret=K.interpret(), compiler_params=_compiler_params(), name=f'add_{kind}_fwd',
      cost_estimate=pl.CostEstimate(
          flops=8 * n_pad * d, transcendentals=n_pad,
          bytes_accessed=forward_bytes((n_pad, d), dtype, has_residual=has_residual,
                                       kind=kind, has_bias=has_bias)),
  )(*inputs)
  if has_residual:
    s_pad, y_pad, *stats = outs
  else:
    (y_pad, *stats), s_pad = outs, inputs[0]
  unpad = lambda a: a[:n].reshape(shape)
  s = unpad(s_pad) if has_residual else x
  return (s, unpad(y_pad)), (s_pad, tuple(stats))


def _backward(s_pad, stats, gain, has_bias, dy, ds_out, kind, block_rows):
  n_pad, d = s_pad.shape
  n = dy.size // d
  rows = block_rows or block_rows_for(n, d)
  blocks = n_pad // rows
  ct = stats[0].dtype
  inputs = [s_pad, *stats, gain.reshape(1, d), _rows(dy, n_pad), _rows(ds_out, n_pad)]
  in_specs = ([_row_spec(rows, d)] + [_col_spec(rows)] * len(stats) +
              [_vec_spec(d), _row_spec(rows, d), _row_spec(rows, d)])
  partial = jax.ShapeDtypeStruct((blocks, 1, d), ct)
  out_shape = [jax.ShapeDtypeStruct((n_pad, d), s_pad.dtype)] + [partial] * (1 + has_bias)
  out_specs = [_row_spec(rows, d)] + [_partial_spec(d)] * (1 + has_bias)
  b = s_pad.dtype.itemsize
  outs = pl.pallas_call(
      functools.partial(_bwd_kernel, kind=kind, has_bias=has_bias),
      out_shape=out_shape, grid=(blocks,), in_specs=in_specs, out_specs=out_specs,
      interpret=K.interpret(), compiler_params=_compiler_params(), name=f'add_{kind}_bwd',
      cost_estimate=pl.CostEstimate(
          flops=14 * n_pad * d, transcendentals=0,
          bytes_accessed=4 * n_pad * d * b + len(stats) * n_pad * 4 + 3 * blocks * d * 4),
  )(*inputs)
  ds = outs[0][:n].reshape(dy.shape)
  return (ds, *(p.sum(axis=(0, 1)) for p in outs[1:]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _add_norm(x, residual, gain, bias, kind, eps, block_rows, has_residual):
  del has_residual   # residual is None exactly when it is False
  return _forward(x, residual, gain, bias, kind, eps, block_rows)[0]


def _add_norm_fwd(x, residual, gain, bias, kind, eps, block_rows, has_residual):
  del has_residual
  out, (s_pad, stats) = _forward(x, residual, gain, bias, kind, eps, block_rows)
  # Saved: s (padded rows), per-row statistics, and the (D,) gain and bias (or None); not x
  # nor the residual, which under nn.scan would be stacked per layer.
  return out, (s_pad, stats, gain, bias)


def _add_norm_bwd(kind, eps, block_rows, has_residual, saved, cotangents):
  del eps
  s_pad, stats, gain, bias = saved
  ds_out, dy = cotangents
  ds, dgain, *dbias = _backward(s_pad, stats, gain, bias is not None, dy, ds_out, kind,
                                block_rows)
  dbias = dbias[0].astype(bias.dtype) if bias is not None else None
  return ds, (ds if has_residual else None), dgain.astype(gain.dtype), dbias


_add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)


def add_norm(x, residual, gain, bias, *, kind: str, eps: float, block_rows: int | None = None):
  """(s, y) of `reference_add_norm`, by the Pallas kernels (custom_vjp: Pallas backward too).

  x, residual: (..., D), one dtype (residual may be None); gain: (D,) (None: ones);
  bias: (D,) or None. block_rows: rows per block (None: `block_rows_for`; a power of two, a
  multiple of 8 on TPU). Raises ValueError for a shape `unsupported` rejects: use
  `add_norm_auto` to fall back instead.
  """
  _check_kind(kind)
  reason = unsupported(x.shape)
  if reason:
    raise ValueError(f'add_norm: the kernel cannot take {reason}')
  if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
    raise ValueError(f'add_norm: residual {residual.shape} {residual.dtype} must match x '
                     f'{x.shape} {x.dtype}')
  if block_rows is not None and (not _pow2(block_rows) or
                                 (K.backend() == 'tpu' and block_rows % 8)):
    raise ValueError(f'add_norm: block_rows={block_rows} must be a power of two (a multiple of '
                     f'8 on TPU)')
  d = x.shape[-1]
  if gain is None:
    gain = jnp.ones((d,), _compute_dtype(x.dtype))
  # Under a mesh each device normalizes its own rows (kernels/partition.py); D stays whole.
  lead = ('activation_batch', 'activation_length') + (None,) * max(0, x.ndim - 3)
  rows = partition.spec(lead[:x.ndim - 1] + (None,), x.shape)
  args = (x, residual, gain, bias)
  present = tuple(a is not None for a in args)

  def call(*arrays):
    it = iter(arrays)
    x, residual, gain, bias = (next(it) if p else None for p in present)
    return _add_norm(x, residual, gain, bias, kind, float(eps), block_rows, residual is not None)

  specs = tuple(s for s, p in zip((rows, rows, P(), P()), present) if p)
  return partition.per_shard(call, specs, (rows, rows))(*(a for a in args if a is not None))


def add_norm_auto(x, residual, gain, bias, *, kind: str, eps: float, kernels: str,
                  block_rows: int | None = None):
  """`add_norm` where `use_pallas(kernels)` (model.kernels) and the shape fits, else
  `reference_add_norm` (with a one-line note when the kernel was asked for but cannot take
  the shape)."""
  _check_kind(kind)
  if K.use_pallas(kernels):
    reason = unsupported(x.shape)
    if reason is None and residual is not None and residual.dtype != x.dtype:
      reason = f'a residual of dtype {residual.dtype} beside x of {x.dtype}'
    if reason is None:
      return add_norm(x, residual, gain, bias, kind=kind, eps=eps, block_rows=block_rows)
    K.note_fallback(f'add_norm ({kind})', reason)
  return reference_add_norm(x, residual, gain, bias, kind=kind, eps=eps)
