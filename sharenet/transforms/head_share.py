"""DirectShare head-wise sharing of an untied model (Cao, Yang, Zhao, "Head-wise Shareable
Attention for Large Language Models", arXiv:2402.11819; reference code zouyingcao/DirectShare).

The heads whose W_q, W_k slices best match a head of an earlier layer (cosine of the
concatenated slices) take that head's Q, K, V, O slices; the top `share_rate` fraction of all
heads is selected (a selected head that another selected head matches keeps its own weights,
as in the reference: `head_sources`). Not function-preserving: same architecture, and the
sharing map (and the unique parameter count) goes to DST/config.json 'head_sharing'. CLI:
`python convert.py --workdir SRC --out DST --config.to=head_shared --config.share_rate=R`
(sharenet/main/convert_workdir.py).

PostShare (the same paper; its reference code's LLaMA-Factory pt workflow) post-trains first:
with the heads chosen as above, the model trains on (1 - w) x next-token loss + w x the mean
over the chosen heads of ||W_q - W_q'|| + ||W_k - W_k'|| + ||W_v - W_v'|| (Frobenius norms of
each head's slice minus its match's: the reference's default 'norm' weight loss, w = 0.5), so
the heads to be shared move toward their matches; then the chosen heads are shared as
DirectShare shares them. Here the post-training runs `post_train_steps` Adam steps on the
calibration batch (`--config.post_train_steps=N`, `post_train_lr`, `similarity_weight`,
`calibration`, `calibration_windows`), the reference's on a pretraining corpus.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharenet.config import compat
from sharenet.errors import ConfigError, require
from sharenet.models import DecoderLM, ModelConfig, layout
from sharenet.models.accounting import params_unique
from sharenet.transforms import block_select


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


@dataclasses.dataclass(frozen=True)
class PostTraining:
  """PostShare's post-training (module docstring): Adam `steps` at `lr` on `tokens_NT` with the
  similarity term weighted `weight`."""
  steps: int
  lr: float
  weight: float
  tokens_NT: np.ndarray

  @classmethod
  def from_options(cls, opts: Any, tokens_NT: np.ndarray | None) -> 'PostTraining | None':
    if not opts.post_train_steps:
      return None
    return cls(int(opts.post_train_steps), float(opts.post_train_lr),
               float(opts.similarity_weight), tokens_NT)


def check_post_training(opts: Any) -> None:
  """One ConfigError line for PostShare options out of range."""
  if opts.post_train_steps < 0 or (opts.post_train_steps and (
      opts.post_train_lr <= 0 or not 0 <= opts.similarity_weight <= 1)):
    raise ConfigError(f'config.post_train_steps={opts.post_train_steps}, post_train_lr='
                      f'{opts.post_train_lr}, similarity_weight={opts.similarity_weight}; '
                      f'valid: post_train_steps >= 0 (0 = DirectShare), post_train_lr > 0, '
                      f'0 <= similarity_weight <= 1')


def head_pairs(match: np.ndarray, heads: list[tuple[int, int]]) -> np.ndarray:
  """(n, 4) rows (layer, head, match layer, match head) of the chosen heads."""
  return np.asarray([(l, h, int(match[l, h][0]), int(match[l, h][1])) for l, h in heads],
                    np.int64).reshape(-1, 4)


def similarity_loss(cfg: ModelConfig, params: Any, pairs: np.ndarray) -> jax.Array:
  """PostShare's weight loss: the mean over `pairs` of ||q - q'|| + ||k - k'|| + ||v - v'||,
  each the Frobenius norm of a head's (D, Dh) slice minus its match's (0 without pairs)."""
  if not len(pairs):
    return jnp.zeros(())
  applied = layout.applied_params(params, cfg)
  total = 0.0
  for p in ('q', 'k', 'v'):
    w = applied[('attn', p, 'kernel')]                 # (L, D, H, Dh)
    diff = w[pairs[:, 0], :, pairs[:, 1]] - w[pairs[:, 2], :, pairs[:, 3]]   # (n, D, Dh)
    total = total + jnp.sum(jnp.sqrt(jnp.sum(jnp.square(diff.astype(jnp.float32)),
                                             axis=(1, 2))))
  return total / len(pairs)


def post_train(cfg: ModelConfig, variables: Any, pairs: np.ndarray, post: PostTraining
               ) -> tuple[Any, dict[str, float]]:
  """(the variables after PostShare's post-training, its losses before and after)."""
  model = DecoderLM(cfg)
  tokens = jnp.asarray(post.tokens_NT, jnp.int32)
  rest = {k: v for k, v in variables.items() if k != 'params'}

  def parts(params):
    return (block_select.calibration_nll(model, {**rest, 'params': params}, tokens),
            similarity_loss(cfg, params, pairs))

  def loss(params):
    nll, sim = parts(params)
    return (1 - post.weight) * nll + post.weight * sim

  before = [float(x) for x in jax.jit(parts)(variables['params'])]
  params = block_select.adam_steps(loss, variables['params'], post.steps, post.lr)
  after = [float(x) for x in jax.jit(parts)(params)]
  return {**variables, 'params': params}, {
      'steps': post.steps, 'lr': post.lr, 'similarity_weight': post.weight,
      'nll_before': before[0], 'similarity_before': before[1],
      'nll_after': after[0], 'similarity_after': after[1]}


def to_head_shared(cfg: ModelConfig, variables: Any, share_rate: float,
                   post: PostTraining | None = None) -> tuple[ModelConfig, Any, dict[str, Any]]:
  """DirectShare (Cao, Yang, Zhao, "Head-wise Shareable Attention for Large Language Models",
  arXiv:2402.11819; reference code zouyingcao/DirectShare): each replaced head takes its match's
  Q, K, V slices (and biases) and O slice, copied from the source model; a selected head that
  is itself a match keeps its own weights, as in the reference (`head_sources`).

  With `post` (PostShare), the heads are chosen on the source's weights, the model is
  post-trained (`post_train`), and the chosen heads of the post-trained model are shared.

  Returns (the same architecture, the variables with the copied slices, the sharing record:
  replaced heads with their source and similarity, the selected heads kept as sources, the
  number of distinct heads and the stored parameters once every duplicated head is counted
  once, `params_unique`; PostShare's losses before and after its post-training).
  """
  compat.check_action('convert_head_shared', cfg.table_config(), 'config.to=head_shared')
  match, best = head_matches(cfg, variables)
  heads = replaced_heads(cfg, best, share_rate)
  post_record = None
  if post is not None:
    variables, post_record = post_train(cfg, variables, head_pairs(match, heads), post)
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
  if post_record is not None:
    record['method'] = 'PostShare (arXiv:2402.11819)'
    record['post_training'] = post_record
  return cfg, out, record
