"""DirectShare head-wise sharing of an untied model (Cao, Yang, Zhao, "Head-wise Shareable
Attention for Large Language Models", arXiv:2402.11819; reference code zouyingcao/DirectShare).

The heads whose W_q, W_k slices best match a head of an earlier layer (cosine of the
concatenated slices) take that head's Q, K, V, O slices; the top `share_rate` fraction of all
heads is selected (a selected head that another selected head matches keeps its own weights,
as in the reference: `head_sources`). Not function-preserving: same architecture, and the
sharing map (and the unique parameter count) goes to DST/config.json 'head_sharing'. CLI:
`python convert.py --workdir SRC --out DST --config.to=head_shared --config.share_rate=R`
(sharenet/main/convert_workdir.py).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from sharenet.config import compat
from sharenet.errors import require
from sharenet.models import ModelConfig, layout
from sharenet.models.accounting import params_unique


def head_similarity(cfg: ModelConfig, variables: Any) -> np.ndarray:
  """(L, H, L, H) cosine similarity of every head's concatenated W_q, W_k slices to every
  other head's (DirectShare's 'qk' matching function, arXiv:2402.11819)."""
  params = layout.applied_params(variables['params'], cfg)
  q = np.asarray(params[('attn', 'q', 'kernel')], np.float64)   # (L, D, H, Dh)
  k = np.asarray(params[('attn', 'k', 'kernel')], np.float64)
  L, D, H, Dh = q.shape
  heads = np.concatenate([q.transpose(0, 2, 1, 3).reshape(L, H, D * Dh),
                          k.transpose(0, 2, 1, 3).reshape(L, H, D * Dh)], axis=-1)
  unit = heads / np.linalg.norm(heads, axis=-1, keepdims=True)
  return np.einsum('lhx,mjx->lhmj', unit, unit)


def head_matches(cfg: ModelConfig, variables: Any) -> tuple[np.ndarray, np.ndarray]:
  """(match (L, H, 2) = (layer, head) of each head's best match, its similarity (L, H)).

  As DirectShare's find_match.py: a head of layer l is matched against every head of the
  layers before it (so layer 0 has no match: similarity -inf), the first maximum in (layer,
  head) order.
  """
  sim = head_similarity(cfg, variables)
  L, H = sim.shape[:2]
  match = np.zeros((L, H, 2), np.int64)
  best = np.full((L, H), -np.inf)
  for l in range(1, L):
    flat = sim[l, :, :l].reshape(H, l * H)
    i = np.argmax(flat, axis=-1)
    match[l, :, 0], match[l, :, 1] = i // H, i % H
    best[l] = flat[np.arange(H), i]
  return match, best


def replaced_heads(cfg: ModelConfig, best: np.ndarray, share_rate: float) -> list[tuple[int, int]]:
  """The int(share_rate * L * H) heads of highest best-match similarity (layer 0 excluded),
  ties broken as DirectShare's getHeadIndex (a stable ascending sort of heads listed from the
  last layer down, head 0 first; the last n are taken)."""
  L, H = best.shape
  n = int(share_rate * L * H)
  require(0 <= share_rate and n <= (L - 1) * H,
          f'config.share_rate={share_rate} replaces {n} heads, but only the {(L - 1) * H} heads '
          f'after layer 0 have a match; valid: 0 <= share_rate <= {(L - 1) / L:.4g}')
  order = [(l, h) for l in range(L - 1, 0, -1) for h in range(H)]
  ranked = sorted(order, key=lambda lh: best[lh])
  return sorted(ranked[len(ranked) - n:]) if n else []


def head_sources(match: np.ndarray, heads: list[tuple[int, int]]
                 ) -> tuple[dict[tuple[int, int], tuple[int, int]], list[tuple[int, int]]]:
  """({replaced head: the head whose original weights it takes}, selected heads that keep
  their own weights), as DirectShare's direct_share.py resolves chains.

  The reference walks the selected heads layer by layer; each appends one copy of its match's
  original Q, K, V, O slices (copied from the unmodified model) and points `share_hash` of both
  the head and its match at that copy. A match lies in an earlier layer, so a selected head
  that is itself the match of a later selected head (the chain A -> B -> C) is pointed last at
  a copy of its own weights: B keeps B, A takes B's original weights, C keeps C.
  """
  lenders = {(int(match[l, h][0]), int(match[l, h][1])) for l, h in heads}
  sources = {(l, h): (int(match[l, h][0]), int(match[l, h][1]))
             for l, h in heads if (l, h) not in lenders}
  return sources, [lh for lh in heads if lh in lenders]


def to_head_shared(cfg: ModelConfig, variables: Any, share_rate: float
                   ) -> tuple[ModelConfig, Any, dict[str, Any]]:
  """DirectShare (Cao, Yang, Zhao, "Head-wise Shareable Attention for Large Language Models",
  arXiv:2402.11819; reference code zouyingcao/DirectShare): each replaced head takes its match's
  Q, K, V slices (and biases) and O slice, copied from the source model; a selected head that
  is itself a match keeps its own weights, as in the reference (`head_sources`).

  Returns (the same architecture, the variables with the copied slices, the sharing record:
  replaced heads with their source and similarity, the selected heads kept as sources, the
  number of distinct heads and the stored parameters once every duplicated head is counted
  once, `params_unique`).
  """
  compat.check_action('convert_head_shared', cfg.table_config(), 'config.to=head_shared')
  match, best = head_matches(cfg, variables)
  heads = replaced_heads(cfg, best, share_rate)
  src = layout.applied_params(variables['params'], cfg)
  names = [('attn', p, 'kernel') for p in ('q', 'k', 'v')] + [('attn', 'o', 'kernel')]
  names += [('attn', p, 'bias') for p in ('q', 'k', 'v') if ('attn', p, 'bias') in src]
  sources, kept = head_sources(match, heads)
  new = {p: np.array(src[p]) for p in names}
  for (l, h), (m, j) in sources.items():
    for p in names:
      if p[1] == 'o':                           # (L, H, Dh, D)
        new[p][l, h] = np.asarray(src[p])[m, j]
      elif p[2] == 'kernel':                    # (L, D, H, Dh)
        new[p][l, :, h] = np.asarray(src[p])[m, :, j]
      else:                                     # bias (L, H, Dh)
        new[p][l, h] = np.asarray(src[p])[m, j]
  sets = {p: (jnp.asarray(new[p], src[p].dtype) if p in new else v)
          for p, v in layout.unique_sets(variables['params'], cfg).items()}
  out = dict(variables)
  out['params'] = layout.from_unique_sets(variables['params'], sets, cfg)
  L, H = best.shape
  origin = {(l, h): (l, h) for l in range(L) for h in range(H)}
  origin.update(sources)
  distinct = len(set(origin.values()))
  D, Dh = cfg.d_model, cfg.d_head
  per_head = 4 * D * Dh + (3 * Dh if ('attn', 'q', 'bias') in src else 0)

  def entry(l: int, h: int) -> dict[str, Any]:
    return {'layer': l, 'head': h, 'source_layer': int(match[l, h][0]),
            'source_head': int(match[l, h][1]), 'similarity': float(best[l, h])}

  record = {
      'method': 'DirectShare (arXiv:2402.11819)', 'share_rate': share_rate,
      'replaced': [entry(l, h) for l, h in sorted(sources)],
      'kept': [entry(l, h) for l, h in kept],   # selected, but the match of a replaced head
      'heads': L * H, 'distinct_heads': distinct,
      'params_unique': params_unique(variables) - (L * H - distinct) * per_head,
  }
  return cfg, out, record
