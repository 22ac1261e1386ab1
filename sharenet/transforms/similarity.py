"""FoldGPT-style grouping for convert.py's init=similar (transforms/recursive.py to_recursive).

After FoldGPT (Liu et al., arXiv:2407.00928), which finds most layers' outputs similar and
shares weights within groups of adjacent blocks: the residual stream after each applied layer
is captured on a calibration batch, every pair of layers is compared by the mean cosine
similarity of their outputs, and the layers are split into K contiguous groups, each tied to
its most representative member, by an exact dynamic program.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharenet.errors import require
from sharenet.models import DecoderLM, ModelConfig, streams


def layer_outputs(cfg: ModelConfig, variables: Any, tokens_NT: np.ndarray) -> np.ndarray:
  """(L, N, T, D) float64: the residual stream after each applied layer of `cfg` on
  `tokens_NT` (models/streams.py: read from the blocks' captured outputs, not module names)."""
  _, h, _ = jax.jit(lambda v, t: streams.apply(DecoderLM(cfg), v, t))(
      variables, jnp.asarray(tokens_NT, jnp.int32))
  return np.asarray(h, np.float64)


def output_similarity(h_LNTD: np.ndarray) -> np.ndarray:
  """(L, L): mean over tokens of the cosine similarity of two layers' outputs."""
  h = h_LNTD.reshape(h_LNTD.shape[0], -1, h_LNTD.shape[-1])
  h = h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-30)
  return np.einsum('itd,jtd->ij', h, h) / h.shape[1]


def similarity_groups(sim_LL: np.ndarray, num_groups: int) -> tuple[list[int], list[int]]:
  """The split of layers 0..L-1 into `num_groups` contiguous groups, each with a
  representative r (its kept block), maximising the sum over layers of sim[l, r(l)]; exact by
  dynamic programming. -> (group of each layer, representative of each group)."""
  L = sim_LL.shape[0]
  require(1 <= num_groups <= L, f'config.num_unique={num_groups} must be in 1..{L} (layers)')
  best_rep = {}   # (a, b) -> (score, representative) of the group a..b-1
  for a in range(L):
    for b in range(a + 1, L + 1):
      scores = sim_LL[a:b, a:b].sum(axis=0)
      r = int(np.argmax(scores))
      best_rep[a, b] = (float(scores[r]), a + r)
  # value[k][b]: the best score of layers 0..b-1 in k groups; cut[k][b] the last group's start
  value = np.full((num_groups + 1, L + 1), -np.inf)
  cut = np.zeros((num_groups + 1, L + 1), np.int64)
  value[0, 0] = 0.0
  for k in range(1, num_groups + 1):
    for b in range(k, L + 1):
      for a in range(k - 1, b):
        v = value[k - 1, a] + best_rep[a, b][0]
        if v > value[k, b]:
          value[k, b], cut[k, b] = v, a
  groups, reps, b = [0] * L, [], L
  for k in range(num_groups, 0, -1):
    a = int(cut[k, b])
    groups[a:b] = [k - 1] * (b - a)
    reps.append(best_rep[a, b][1])
    b = a
  return groups, reps[::-1]


def fold_plan(cfg: ModelConfig, variables: Any, tokens_NT: np.ndarray,
              num_groups: int) -> tuple[list[int], list[int]]:
  """(group of each layer, representative of each group) of untied `cfg` on `tokens_NT`."""
  return similarity_groups(output_similarity(layer_outputs(cfg, variables, tokens_NT)),
                           num_groups)
