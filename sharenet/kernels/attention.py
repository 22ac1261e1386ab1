"""Causal attention: the XLA reference and the fused (FlashAttention-style) back-ends.

FlashAttention (Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness", arXiv:2205.14135) computes softmax(q k^T) v block by block with an online softmax,
so the (T, S) logits never reach memory; the backward pass recomputes them from q, k and the
saved log-sum-exp. Every back-end here computes the same function as `reference`:

  xla     `reference`: the einsum attention (float32 logits).
  chunked `reference` in query chunks of CPU_CHUNK: chunk i computes its logits against keys
          0..end of chunk i only, so the causal upper triangle beyond each chunk is never
          computed (at T = 256 a quarter of the logits, at T = 2048 about half) and no (T, T)
          array is formed. The same function (each query row's softmax sees all of its keys);
          the CPU default (model.attention=auto; docs/performance.md).
  pallas  GPU, and CPU in Pallas interpret mode: the FlashAttention kernel jax ships in
          `jax.experimental.pallas.ops.gpu.attention.mha` (Pallas forward, Pallas backward
          through its custom VJP). TPU: `jax.experimental.pallas.ops.tpu.flash_attention`.
  cudnn   `jax.nn.dot_product_attention(implementation='cudnn')`, cuDNN's fused flash attention
          (NVIDIA GPUs; bf16 / fp16 only).
Under a mesh the Pallas kernels run per device on its batch rows and heads
(sharenet/kernels/partition.py: XLA cannot partition a Pallas call).

Layout everywhere: q [B, T, H, Dh], k and v [B, S, K, Dh] with K kv heads dividing H
(grouped-query attention: query head h reads kv head h // (H // K)); the output is [B, T, H, Dh]
in q's dtype. Training: S = T, queries and keys share positions 0..T-1 (self-attention).

Cached decoding (sharenet/models/attention.py) calls the same entry, `attention`, with the
positions: `q_positions_BT` of the new queries and `k_positions_BS` of every cache slot (-1: empty
or padding); query t attends key s only if 0 <= k_positions[s] <= q_positions[t]. `reference`
(xla, chunked) takes that case; the fused kernels take only a causal T x T mask over slots, so
under pallas and cudnn it runs the reference, with the one-line `kernels.note_fallback` note.

Segment ids (optional, [B, T] int; packed documents, sharenet/data/arrayrecord.py): query t
attends key s only if s <= t and segment_ids[t] == segment_ids[s]. The Pallas kernels take them
natively (GPU `mha(segment_ids=...)`, TPU `SegmentIds(q, kv)`); cudnn runs the reference (noted).

`scale` multiplies the logits. It may be a traced array (the l2 QK-norm's learned `qk_scale`,
Henry et al., arXiv:2010.04245): the kernels take only a static `sm_scale`, so q is multiplied by
`scale` before the call and the kernel runs with sm_scale=1.0; the gradient of `scale` flows
through that product.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from sharenet import kernels
from sharenet.kernels import partition
from sharenet.kernels.einsum import einsum_f32
from sharenet.errors import ConfigError

IMPLS = ('xla', 'chunked', 'cudnn', 'pallas')
# Query rows per chunk of the chunked back-end: 64 and 128 were equally fast at T = 256 on the
# 2-core CPU, 128 fastest at T = 512 (fwd + bwd, 1.6x the unchunked reference at both).
CPU_CHUNK = 128

# The reference's masked logit; exp underflows to exactly 0.
MASK_VALUE = -1e30

_notes: set[str] = set()


def _note(message: str) -> None:
  """One line on stderr, once per message: a kernel runs, but not exactly as asked."""
  if message not in _notes:
    _notes.add(message)
    print(f'sharenet: {message}', file=sys.stderr, flush=True)


def reference(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *, scale,
              causal: bool = True, segment_ids_BT: jax.Array | None = None, chunk: int = 0,
              observe: Callable[[jax.Array, jax.Array], None] | None = None,
              q_positions_BT: jax.Array | None = None,
              k_positions_BS: jax.Array | None = None, softcap: float = 0.0,
              slice_len: jax.Array | None = None) -> jax.Array:
  """softmax(scale * q k^T, masked) v with float32 logits and softmax; output in q's dtype.

  The arithmetic of the `xla` back-end: q * scale in q's dtype, the grouped einsum with a
  float32 result (never rounded to q's dtype), masked positions set to -1e30 (an additive bias),
  softmax in float32 and cast back to q's dtype before the value einsum. The logits and
  probabilities carry the checkpoint names 'attn_logits' / 'attn_probs' (remat policy
  except_attn).

  `q_positions_BT` and `k_positions_BS` (cached decoding, both or neither): the mask is by
  position, 0 <= key position <= query position, instead of by slot index (`causal`).
  `chunk` > 0 (causal by slot only): query rows in chunks of `chunk`, each against the keys up
  to its last row (the `chunked` back-end). `observe(logits, mask)` sees the whole (B, K, G, T,
  S) logits before masking and their mask (None: no mask) for coordinate checks; it needs
  chunk = 0. `softcap` > 0 (Gemma 2's attn_logit_softcapping): the scaled logits become
  softcap * tanh(logits / softcap) before the mask.
  """
  B, T, H, Dh = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  dt = q_BTHD.dtype
  by_position = q_positions_BT is not None
  if chunk and (not causal or observe is not None or by_position):
    raise ValueError('attention: chunk > 0 needs causal=True, no observe and no positions')
  chunk = chunk or T
  q_BTKGD = q_BTHD.reshape(B, T, K, H // K, Dh) * scale
  outs = []
  for start in range(0, T, chunk):
    stop = min(T, start + chunk)
    keys = stop if chunk < T else S           # keys past the chunk's last query are masked
    logits_BKGCS = einsum_f32('btkgd,bskd->bkgts', q_BTKGD[:, start:stop], k_BSKD[:, :keys])
    mask_BKGCS = _mask(start, stop, keys, causal, segment_ids_BT, q_positions_BT, k_positions_BS,
                       slice_len)
    if observe is not None:
      observe(logits_BKGCS, mask_BKGCS)
    if softcap:
      logits_BKGCS = softcap * jnp.tanh(logits_BKGCS / softcap)
    if mask_BKGCS is not None:
      # An additive 0 / MASK_VALUE bias: the same logits bit for bit (|logits| << 1e30 is
      # absorbed), the same gradients (masked probabilities are exactly 0), and XLA:CPU fuses the
      # add into the softmax where it runs a select as its own pass (3 % of the d=256 train
      # step in a one-core A/B, docs/performance.md).
      bias = jnp.where(mask_BKGCS, 0.0, MASK_VALUE).astype(logits_BKGCS.dtype)
      logits_BKGCS = logits_BKGCS + bias
    logits_BKGCS = checkpoint_name(logits_BKGCS, 'attn_logits')
    probs_BKGCS = checkpoint_name(jax.nn.softmax(logits_BKGCS, axis=-1).astype(dt),
                                  'attn_probs')
    outs.append(jnp.einsum('bkgts,bskd->btkgd', probs_BKGCS, v_BSKD[:, :keys]))
  out_BTKGD = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
  return out_BTKGD.reshape(B, T, H, Dh)


def _mask(start: int, stop: int, keys: int, causal: bool, segment_ids_BT, q_positions_BT,
          k_positions_BS, slice_len=None) -> jax.Array | None:
  """Which keys 0..keys-1 query rows start..stop-1 see, broadcastable to (B, K, G, C, S)."""
  mask = None
  if q_positions_BT is not None:
    key_pos_B1S = k_positions_BS[:, None, :keys]
    q_pos_BC1 = q_positions_BT[:, start:stop, None]
    visible_BCS = (key_pos_B1S >= 0) & (key_pos_B1S <= q_pos_BC1)
    if slice_len is not None:   # sliced loops (models/attention.py): 0 = the whole cache
      n = jnp.where(slice_len > 0, slice_len, jnp.iinfo(jnp.int32).max)
      visible_BCS = visible_BCS & (key_pos_B1S // n == q_pos_BC1 // n)
    mask = visible_BCS[:, None, None]
  elif causal:
    rows, cols = jnp.arange(start, stop), jnp.arange(keys)
    mask = (rows[:, None] >= cols[None, :])[None, None, None]
  if segment_ids_BT is not None:
    same = (segment_ids_BT[:, start:stop, None] == segment_ids_BT[:, None, :keys])
    same = same[:, None, None]
    mask = same if mask is None else mask & same
  return mask


def attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *, scale,
              impl: str, segment_ids_BT: jax.Array | None = None,
              q_positions_BT: jax.Array | None = None, k_positions_BS: jax.Array | None = None,
              observe: Callable[[jax.Array, jax.Array], None] | None = None,
              softcap: float = 0.0, slice_len: jax.Array | None = None) -> jax.Array:
  """Causal attention by back-end `impl` (xla | chunked | cudnn | pallas): the one entry of
  training and cached decoding; see the module docstring.

  `impl` is what `sharenet.kernels.attention_backend(cfg.attention, cfg.kernels)` resolves to.
  With `q_positions_BT` / `k_positions_BS` (decoding) the mask is by position, see `reference`;
  there `slice_len` (a traced int, 0 = off; sliced loops, models/attention.py) also hides keys
  outside the query's slice of that many positions.
  `observe` (coordinate checks) sees the logits on the reference back-ends, unchunked; the fused
  kernels never form them, so there it is not called. A case a back-end cannot take runs
  `reference` instead, with a one-line note on stderr: cached decoding, and `softcap` > 0 (the
  fused kernels have no logit soft-capping).
  """
  _check_shapes(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, q_positions_BT, k_positions_BS)
  ref = functools.partial(reference, q_BTHD, k_BSKD, v_BSKD, scale=scale,
                          segment_ids_BT=segment_ids_BT, q_positions_BT=q_positions_BT,
                          k_positions_BS=k_positions_BS, softcap=softcap, slice_len=slice_len)
  decoding = q_positions_BT is not None
  if slice_len is not None and not decoding:
    raise ValueError('attention: slice_len is a decoding mask (training slices fold the batch)')
  if impl in ('xla', 'chunked'):
    chunked = impl == 'chunked' and observe is None and not decoding
    return ref(chunk=CPU_CHUNK if chunked else 0, observe=observe)
  if impl not in IMPLS:
    raise ConfigError(f'attention implementation {impl!r} is unknown; valid: {", ".join(IMPLS)}')
  if decoding:
    kernels.note_fallback(f'{impl} attention', 'query / key positions (cached decoding)')
    return ref()
  if softcap:
    kernels.note_fallback(f'{impl} attention', 'logit soft-capping (model.attn_softcap)')
    return ref()
  if impl == 'cudnn':
    if segment_ids_BT is not None:
      kernels.note_fallback('cudnn attention', 'segment_ids (data.segment_mask)')
      return ref()
    return cudnn_attention(q_BTHD, k_BSKD, v_BSKD, scale=scale)
  return _pallas_per_shard(q_BTHD, k_BSKD, v_BSKD, scale=scale, segment_ids_BT=segment_ids_BT)


def _pallas_per_shard(q_BTHD, k_BTKD, v_BTKD, *, scale, segment_ids_BT) -> jax.Array:
  """The platform's Pallas kernel; under a mesh, on each device's batch rows and heads
  (kernels/partition.py). Query and kv heads split alike or not at all, so that GQA's group
  of a local query head is local too. `scale` multiplies q first (it may be a traced array)."""
  q_BTHD = (q_BTHD * scale).astype(q_BTHD.dtype)
  heads = partition.mesh_axes('activation_heads', (q_BTHD.shape[2], k_BTKD.shape[2]))
  rows = partition.mesh_axes('activation_batch', (q_BTHD.shape[0],))
  if kernels.backend() == 'tpu':
    kernel = functools.partial(pallas_tpu_attention, scale=1.0)
  else:
    kernel = functools.partial(pallas_gpu_attention, scale=1.0, interpret=kernels.interpret())
  qkv = P(rows, None, heads, None)
  if segment_ids_BT is None:
    return partition.per_shard(kernel, (qkv,) * 3, qkv)(q_BTHD, k_BTKD, v_BTKD)
  call = lambda q, k, v, seg: kernel(q, k, v, segment_ids_BT=seg)
  return partition.per_shard(call, (qkv,) * 3 + (P(rows, None),), qkv)(
      q_BTHD, k_BTKD, v_BTKD, segment_ids_BT)


def _check_shapes(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, q_positions_BT,
                 k_positions_BS) -> None:
  if q_BTHD.ndim != 4 or k_BSKD.shape != v_BSKD.shape or k_BSKD.ndim != 4:
    raise ValueError(f'attention wants q [B,T,H,Dh] and k, v [B,S,K,Dh]; got q {q_BTHD.shape}, '
                     f'k {k_BSKD.shape}, v {v_BSKD.shape}')
  (B, T, H, Dh), (Bk, S, K, Dhk) = q_BTHD.shape, k_BSKD.shape
  decoding = q_positions_BT is not None
  if (q_positions_BT is None) != (k_positions_BS is None):
    raise ValueError('attention: q_positions_BT and k_positions_BS go together')
  if decoding and segment_ids_BT is not None:
    raise ValueError('attention: segment ids with query / key positions are not supported')
  if (B, Dh) != (Bk, Dhk) or H % K or (not decoding and S != T):
    raise ValueError(f'attention wants matching B, Dh (and T = S without positions) and K '
                     f'dividing H; got q {q_BTHD.shape}, k {k_BSKD.shape}')
  if decoding and (q_positions_BT.shape != (B, T) or k_positions_BS.shape != (B, S)):
    raise ValueError(f'attention wants q positions [B,T] {(B, T)} and k positions [B,S] '
                     f'{(B, S)}; got {q_positions_BT.shape}, {k_positions_BS.shape}')


def _repeat_kv(x_BTKD: jax.Array, num_heads: int) -> jax.Array:
  """[B,T,K,Dh] -> [B,T,H,Dh], kv head h // (H // K) for query head h (GQA for MHA kernels).

  The copy costs H/K times the kv memory; its gradient sums over each group, as GQA's does.
  """
  K = x_BTKD.shape[2]
  return x_BTKD if K == num_heads else jnp.repeat(x_BTKD, num_heads // K, axis=2)


def _pad_time(x_BTND: jax.Array, T_pad: int) -> jax.Array:
  T = x_BTND.shape[1]
  return x_BTND if T == T_pad else jnp.pad(x_BTND, ((0, 0), (0, T_pad - T), (0, 0), (0, 0)))


def gpu_block(T: int) -> tuple[int, int]:
  """(padded T, block size) for the GPU kernel: a power of two >= 16 up to 128, then 128-multiples.

  The kernel needs T divisible by its blocks; Triton's dot wants tiles of at least 16.
  """
  if T <= 128:
    block = max(16, 1 << (T - 1).bit_length())
    return block, block
  return -(-T // 128) * 128, 128


def pallas_gpu_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *, scale,
                         interpret: bool = False,
                         segment_ids_BT: jax.Array | None = None) -> jax.Array:
  """Causal attention by jax's Pallas FlashAttention GPU kernel (`ops.gpu.attention.mha`).

  That kernel is multi-head only, so kv heads are repeated to H for GQA (see `_repeat_kv`). T is
  padded with zeros up to a block multiple (`gpu_block`): padded keys sit after every real query,
  so the causal mask hides them, and the padded query rows are sliced off (their cotangent is
  zero). `interpret=True` runs the same kernel in Pallas interpret mode (CPU).
  """
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention
  B, T, H, Dh = q_BTHD.shape
  if not interpret and not 16 <= Dh <= 256:
    kernels.note_fallback('pallas attention', f'head_dim={Dh} (valid: 16..256)')
    return reference(q_BTHD, k_BTKD, v_BTKD, scale=scale, segment_ids_BT=segment_ids_BT)
  T_pad, block = gpu_block(T)
  bwd_block = min(32, block)
  sizes = gpu_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=bwd_block,
                                   block_kv_dkv=bwd_block, block_q_dq=bwd_block,
                                   block_kv_dq=bwd_block)
  q = _pad_time((q_BTHD * scale).astype(q_BTHD.dtype), T_pad)
  k = _pad_time(_repeat_kv(k_BTKD, H), T_pad)
  v = _pad_time(_repeat_kv(v_BTKD, H), T_pad)
  seg_BT = None if segment_ids_BT is None else _pad_segments(segment_ids_BT, T_pad)
  out_BTHD = gpu_attention.mha(q, k, v, seg_BT, sm_scale=1.0, causal=True, block_sizes=sizes,
                               interpret=interpret)
  return out_BTHD[:, :T]


def _pad_segments(segment_ids_BT: jax.Array, T_pad: int) -> jax.Array:
  """int32 segment ids padded with -1 to T_pad: padded keys, after every real query, stay
  hidden by the causal mask; padded query rows are sliced off."""
  T = segment_ids_BT.shape[1]
  return jnp.pad(segment_ids_BT.astype(jnp.int32), ((0, 0), (0, T_pad - T)), constant_values=-1)


def tpu_block(T: int) -> tuple[int, int]:
  """(padded T, block size) for the TPU kernel: 128-multiples (the lane width), block <= 512."""
  T_pad = -(-T // 128) * 128
  block = next(b for b in (512, 256, 128) if T_pad % b == 0)
  return T_pad, block


def pallas_tpu_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *,
                         scale, segment_ids_BT: jax.Array | None = None) -> jax.Array:
  """Causal attention by jax's Pallas FlashAttention TPU kernel (`ops.tpu.flash_attention`).

  Layout [B, H, T, Dh] inside; kv heads repeated to H (the kernel is multi-head only); T padded
  to a multiple of 128 (`tpu_block`), hidden by the causal mask and sliced off as on GPU. On a
  CPU it runs only under `jax.experimental.pallas.tpu.force_tpu_interpret_mode` (tests).
  """
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
  B, T, H, Dh = q_BTHD.shape
  T_pad, block = tpu_block(T)
  sizes = tpu_flash.BlockSizes(
      block_q=block, block_k_major=block, block_k=block, block_b=1,
      block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block,
      block_k_major_dq=block, block_k_dq=block, block_q_dq=block)
  q = _pad_time((q_BTHD * scale).astype(q_BTHD.dtype), T_pad)
  k = _pad_time(_repeat_kv(k_BTKD, H), T_pad)
  v = _pad_time(_repeat_kv(v_BTKD, H), T_pad)
  to_BHTD = lambda x: jnp.swapaxes(x, 1, 2)
  seg = None
  if segment_ids_BT is not None:
    seg_BT = _pad_segments(segment_ids_BT, T_pad)
    seg = tpu_flash.SegmentIds(q=seg_BT, kv=seg_BT)
  out_BHTD = tpu_flash.flash_attention(to_BHTD(q), to_BHTD(k), to_BHTD(v), segment_ids=seg,
                                       causal=True, sm_scale=1.0, block_sizes=sizes)
  return to_BHTD(out_BHTD)[:, :T]


def cudnn_head_dim_limit() -> int:
  """cuDNN flash attention's largest bf16/fp16 head_dim: 256 from Hopper (sm_90) on, else 128."""
  cc = getattr(jax.devices()[0], 'compute_capability', '0')
  return 256 if float(cc) >= 9.0 else 128


def cudnn_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *,
                    scale) -> jax.Array:
  """Causal attention by cuDNN's fused flash attention via `jax.nn.dot_product_attention`.

  GQA is native there (k, v keep K heads). cuDNN takes bf16 / fp16 only: float32 inputs are cast
  to bfloat16 (noted once on stderr) and the output cast back, so float32 models lose precision
  inside attention on this back-end. head_dim must be a multiple of 8 and at most
  `cudnn_head_dim_limit()`; otherwise the reference runs (noted).
  """
  Dh = q_BTHD.shape[-1]
  limit = cudnn_head_dim_limit()
  if Dh % 8 or Dh > limit:
    kernels.note_fallback('cudnn attention', f'head_dim={Dh} (valid: multiples of 8 up to {limit})')
    return reference(q_BTHD, k_BTKD, v_BTKD, scale=scale)
  dt = q_BTHD.dtype
  q_BTHD = (q_BTHD * scale).astype(dt)
  if dt not in (jnp.bfloat16, jnp.float16):
    _note(f'cudnn attention takes bf16/fp16 only; casting {dt} q, k, v to bfloat16 '
          f'(output cast back to {dt})')
    q_BTHD, k_BTKD, v_BTKD = (x.astype(jnp.bfloat16) for x in (q_BTHD, k_BTKD, v_BTKD))
  out_BTHD = jax.nn.dot_product_attention(q_BTHD, k_BTKD, v_BTKD, scale=1.0, is_causal=True,
                                          implementation='cudnn')
  return out_BTHD.astype(dt)
