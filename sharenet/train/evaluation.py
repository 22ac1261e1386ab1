"""Evaluation on the validation split (all of it, or its first data.eval_tokens predicted
tokens): mean next-token loss and bits per byte, per mixture source, and at other depths of a
looped model (`evaluate_depths`)."""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from sharenet import data
from sharenet.models import DecoderLM, unit_scale
from sharenet.inference import test_time_depth
from sharenet.models.loops import Schedule
from sharenet.train import perf


def split_batch(batch: Any) -> tuple[jax.Array, jax.Array | None]:
  """(tokens (B, T+1), segment ids (B, T+1) or None) of a batch: one token array, or a dict of
  'tokens' with data.segment_mask's 'segment_ids' and / or loss-masked shards' 'loss_mask'
  (sharenet/data/arrayrecord.py)."""
  if isinstance(batch, dict):
    return batch['tokens'], batch.get('segment_ids')
  return batch, None


def target_weights(batch: Any) -> jax.Array | None:
  """float32 (B, T): 1 where a target counts in the loss, of a loss-masked batch (else None)."""
  if isinstance(batch, dict) and 'loss_mask' in batch:
    return batch['loss_mask'][:, 1:].astype(jnp.float32)
  return None


def mean_nll(nll_BT: jax.Array, batch: Any) -> jax.Array:
  """The batch's loss: the mean NLL over its targets, or over those its loss mask counts."""
  w_BT = target_weights(batch)
  if w_BT is None:
    return jnp.mean(nll_BT)
  return jnp.sum(nll_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0)


def token_nll(model: DecoderLM, params: Any, batch_BT1: Any,
              mutable: Sequence[str] = (), logits_grad_scale: float = 1.0,
              schedule: Schedule = Schedule(), rngs: Any = None) -> tuple[jax.Array, Any]:
  """Per-position next-token negative log-likelihood (B, T), and the sown `mutable` collections
  ({} if none): the one loss that training (trainer.loss_fn) and evaluation share.

  `batch_BT1` is a token array (B, T+1) or, with data.segment_mask, {'tokens', 'segment_ids'}
  (`split_batch`): the model then attends only within each packed document.

  `logits_grad_scale` multiplies only the gradient reaching the logits (u-muP's unit-scaled
  cross entropy, vocab / sqrt(vocab - 1)); the values are unchanged. `schedule` runs the looped
  segment's loops another way (models/loops.py: a sampled depth in training, another depth in
  evaluation, sharenet/inference/test_time_depth.py), `rngs` are the apply's (a recurrent model's
  `normal` initial
  state, models/recurrence.py).
  """
  logits_BTV, aux = token_logits(model, params, batch_BT1, mutable, schedule, rngs)
  if logits_grad_scale != 1.0:
    logits_BTV = unit_scale.scale_bwd(logits_BTV, logits_grad_scale)
  nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets(batch_BT1))
  return nll_BT, aux


def targets(batch_BT1: Any) -> jax.Array:
  """The next tokens (B, T) a batch's inputs predict."""
  return split_batch(batch_BT1)[0][:, 1:]


def token_logits(model: DecoderLM, params: Any, batch_BT1: Any, mutable: Sequence[str] = (),
                 schedule: Schedule = Schedule(), rngs: Any = None) -> tuple[jax.Array, Any]:
  """The logits (B, T, V) of a batch's inputs and the sown `mutable` collections (`token_nll`'s
  forward; distillation compares a student's and a teacher's, sharenet/train/teacher.py)."""
  tokens_BT1, segment_ids_BT1 = split_batch(batch_BT1)
  inputs = (tokens_BT1[:, :-1],) if segment_ids_BT1 is None else (tokens_BT1[:, :-1],
                                                                  segment_ids_BT1[:, :-1])
  extra = {} if schedule.is_default else {'schedule': schedule}   # the plain call otherwise
  if rngs is not None:
    extra['rngs'] = rngs
  return model.apply(params, *inputs, mutable=list(mutable), **extra)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _eval_step(model: DecoderLM, params: Any, batch_BT1: Any, mask_BT: jax.Array,
               schedule: Schedule):
  nll_BT, _ = token_nll(model, params, batch_BT1, schedule=schedule)
  return jnp.sum(nll_BT * mask_BT), jnp.sum(mask_BT)


def evaluate(model: DecoderLM, params: Any, data_cfg: Any, seq_len: int,
             batch_size: int, schedule: Schedule = Schedule()) -> dict[str, float]:
  """eval_loss (nats/token) and eval_bits_per_byte over the evaluated validation tokens (all,
  or the first data.eval_tokens); `schedule`: at another depth (one compiled program per
  schedule: the loop count is a scan length).

  Bytes per token: 1 for byte sources, meta.json's validation bytes / tokens for arrayrecord;
  `bin` has none, so its 'bits per byte' is bits per token. With data.mixture, each source's
  `eval_loss/NAME` and `eval_bits_per_byte/NAME` beside their data.mixture-weighted averages
  (sharenet/data/mixture.py).
  """
  out = {'eval_loss': 0.0, 'eval_bits_per_byte': 0.0}
  for name, weight, source_cfg in data.eval_sources(data_cfg):
    total, count = 0.0, 0.0
    for batch, mask in data.eval_batches(source_cfg, seq_len, batch_size):
      s, n = _eval_step(model, params, batch, mask, schedule)
      total += float(s)   # host-side float64 accumulation: identical in train.py and eval.py
      count += float(n)
    loss = total / count
    bpb = loss / math.log(2) / (data.bytes_per_token(source_cfg) or 1.0)   # bin: bits per token
    out['eval_loss'] += weight * loss
    out['eval_bits_per_byte'] += weight * bpb
    if name is not None:
      out.update({f'eval_loss/{name}': loss, f'eval_bits_per_byte/{name}': bpb})
  return out


def evaluate_depths(model: Any, params: Any, data_cfg: Any, seq_len: int, batch_size: int,
                    depths: Sequence[int]) -> list[dict[str, Any]]:
  """One row per depth: depth, eval_loss, eval_bits_per_byte, flops_per_token (forward FLOPs
  of a token at that depth, perf.flops_per_token_at_depth)."""
  cfg = model.cfg
  for n in depths:   # every depth checked before the first compilation
    test_time_depth.check_depth(cfg, n, '--depths')
  rows = []
  for n in depths:
    out = evaluate(model, params, data_cfg, seq_len, batch_size, Schedule(loops=n))
    rows.append({'depth': int(n), **out,
                 'flops_per_token': perf.flops_per_token_at_depth(cfg, seq_len, n)})
  return rows
