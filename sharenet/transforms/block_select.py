"""Which blocks a conversion to a recursive model keeps, removes, replaces or repeats.

Three papers choose blocks before they share weights (convert.py --config.to=recursive,
transforms/recursive.py applies the choice):

- FoldGPT (Liu et al., arXiv:2407.00928, section 3.1): learnable gates rank the blocks'
  importance while modelling their coupling, and the least important are removed at a given
  removal rate (config.remove_rate) before the rest are grouped and tied. Here the gate g_l of
  applied layer l multiplies what the block writes into the residual stream (x + g_l f_l(x) for
  each branch: its writer kernels and their biases scaled by g_l, so no model code changes); all
  gates start at 1 and are trained jointly, everything else frozen, for config.gate_steps Adam
  steps at config.gate_lr on the calibration batch's next-token loss plus config.gate_l1 *
  sum_l |g_l|. A block the others can do without is driven towards 0, and the importance of a
  block is its |g_l|. The paper's exact gate objective is not in its abstract; this is the
  reading documented in docs/sharing.md.
- FlexiGPT (Smith et al., "Pruning and Extending Large Language Models with Low-Rank Weight
  Sharing", arXiv:2501.14713, NAACL 2025): the blocks of least Block Influence (ShortGPT, Men et
  al., arXiv:2403.03853: BI_l = 1 - the mean cosine similarity of the stream before and after
  block l on calibration tokens; config.importance=influence also ranks removal by it) are
  pruned at config.replace_rate, and each is replaced by the weights of an unpruned block plus
  its own low-rank adapter from the truncated SVD of the difference; the donor is the unpruned
  block whose difference the rank-r adapter reconstructs best (the least energy left outside
  its top r singular values, summed over the adapted kernels, each relative to its mean energy
  over layers: the paper's "low-rank SVD metric", read this way).
- The same paper extends a smaller model by repeating blocks with their own adapters and norms
  (config.insert_after: a copy of layer i, tied to it, after each listed i).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, layout, param_table, streams
from sharenet.models.params import KERNEL_ROLES

IMPORTANCE = ('gates', 'influence')


def _writers(cfg: ModelConfig) -> set[tuple]:
  """Block-local paths of what a block writes into the stream: writer kernels and their biases."""
  table = param_table(cfg)
  kernels = {i.local for i in table.values() if i.in_block and i.role == 'writer'}
  modules = {i.module for i in table.values() if i.in_block and i.role == 'writer'}
  return kernels | {i.local for i in table.values()
                    if i.in_block and i.role == 'bias' and i.module in modules}


def gated(cfg: ModelConfig, params: Any, gates_L: jax.Array) -> Any:
  """`params` of untied `cfg` with each applied layer's writers scaled by its gate: the model
  computing x + g_l f_l(x) for every branch of layer l (pre, post and moeut placements; the peri
  placement's output norm would undo the scale, so `check_gated` refuses it)."""
  layers = layout.applied_params(params, cfg)
  writers = _writers(cfg)
  scaled = {p: v * gates_L.reshape((-1,) + (1,) * (v.ndim - 1)).astype(v.dtype)
            if p in writers else v for p, v in layers.items()}
  return layout.from_unique_sets(params, scaled, cfg)


def check_gated(cfg: ModelConfig) -> None:
  if cfg.norm.placement == 'peri':
    raise ConfigError('config.importance=gates scales what each block writes, which '
                      'model.norm.placement=peri\'s output norms undo; valid: '
                      'config.importance=influence, or a pre / post / moeut model')


def calibration_nll(model: DecoderLM, variables: Any, tokens_NT: jax.Array) -> jax.Array:
  """Mean next-token loss of `model` on the calibration windows `tokens_NT` (the objective
  of the conversions that train on them: gates here, PostShare in transforms/head_share.py)."""
  logits = model.apply(variables, tokens_NT[:, :-1])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens_NT[:, 1:]))


def gate_importance(cfg: ModelConfig, variables: Any, tokens_NT: np.ndarray, steps: int,
                    lr: float, l1: float) -> np.ndarray:
  """(L,) |g_l| after training the gates of the module docstring on `tokens_NT`."""
  check_gated(cfg)
  if steps < 1 or lr <= 0 or l1 < 0:
    raise ConfigError(f'config.gate_steps={steps}, gate_lr={lr}, gate_l1={l1}; valid: '
                      f'gate_steps >= 1, gate_lr > 0, gate_l1 >= 0')
  model = DecoderLM(cfg)
  tokens = jnp.asarray(tokens_NT, jnp.int32)
  frozen = jax.lax.stop_gradient(variables)

  def loss(g):
    v = dict(frozen)
    v['params'] = gated(cfg, frozen['params'], g)
    return calibration_nll(model, v, tokens) + l1 * jnp.sum(jnp.abs(g))

  gates = adam_steps(loss, jnp.ones((cfg.num_layers,), jnp.float32), steps, lr)
  return np.abs(np.asarray(gates, np.float64))


def adam_steps(loss: Any, x: Any, steps: int, lr: float) -> Any:
  """`x` after `steps` Adam steps at `lr` on `loss(x)`, one compiled scan (the calibration
  training of the gates here and of PostShare, transforms/head_share.py)."""
  opt = optax.adam(lr)

  @jax.jit
  def run(x):
    def body(carry, _):
      x, s = carry
      upd, s = opt.update(jax.grad(loss)(x), s, x)
      return (optax.apply_updates(x, upd), s), None
    (x, _), _ = jax.lax.scan(body, (x, opt.init(x)), None, length=steps)
    return x

  return run(x)


def block_influence(cfg: ModelConfig, variables: Any, tokens_NT: np.ndarray) -> np.ndarray:
  """(L,) BI_l = 1 - mean over tokens of cos(stream before layer l, stream after it)."""
  model = DecoderLM(cfg)
  tokens = jnp.asarray(tokens_NT, jnp.int32)

  @jax.jit
  def run(v):
    x0 = model.apply(v, tokens, method=DecoderLM.embed)
    _, h, _ = streams.apply(model, v, tokens)
    h = jnp.concatenate([x0[None].astype(h.dtype), h]).astype(jnp.float32)
    unit = h / jnp.maximum(jnp.linalg.norm(h, axis=-1, keepdims=True), 1e-30)
    return 1.0 - jnp.mean(jnp.sum(unit[:-1] * unit[1:], axis=-1), axis=(1, 2))

  return np.asarray(run(variables), np.float64)


def importance(cfg: ModelConfig, variables: Any, tokens_NT: np.ndarray, opts: Any) -> np.ndarray:
  """(L,) the importance config.importance names (higher: more important)."""
  kind = opts.importance
  if kind == 'gates':
    return gate_importance(cfg, variables, tokens_NT, int(opts.gate_steps),
                           float(opts.gate_lr), float(opts.gate_l1))
  if kind == 'influence':
    return block_influence(cfg, variables, tokens_NT)
  raise ConfigError(f'config.importance={kind!r} is unknown; valid: {", ".join(IMPORTANCE)}')


def count(rate: float, num_layers: int, name: str) -> int:
  """round(rate * L) blocks, at least 1 and leaving at least 1 (one ConfigError line if not)."""
  n = int(round(rate * num_layers))
  if not 0 < rate < 1 or not 1 <= n < num_layers:
    raise ConfigError(f'config.{name}={rate} of {num_layers} layers selects {n} blocks; valid: '
                      f'0 < {name} < 1 selecting 1..{num_layers - 1} blocks')
  return n


def least(score_L: np.ndarray, n: int) -> list[int]:
  """The `n` layers of lowest score (ties: the earlier layer first), in layer order."""
  return sorted(int(i) for i in np.argsort(score_L, kind='stable')[:n])


def _adapted_kernels(cfg: ModelConfig, targets: tuple[str, ...]) -> dict[tuple, int]:
  """{block-local kernel path: its number of input axes} of the kernels LoRA `targets` adapt."""
  table = param_table(cfg.derive(sharing={'scheme': 'cycle', 'num_unique': 1, 'repeats': 0,
                                          'pattern': '', 'lora_rank': 1,
                                          'lora_targets': targets, 'lora_layers': 'all'}))
  kernels = {i.local[:-1]: i for i in table.values() if i.role in KERNEL_ROLES and i.in_block}
  return {kernels[i.local[:-1]].local: kernels[i.local[:-1]].num_in
          for i in table.values() if i.role == 'lora'}


def donor_residual(src: dict[tuple, Any], kernels: dict[tuple, int], pruned: int, donor: int,
                   rank: int) -> float:
  """The energy of W_pruned - W_donor outside its top `rank` singular values, relative to the
  kernel's mean energy over layers, summed over `kernels`: what a rank-r adapter cannot
  reconstruct."""
  total = 0.0
  for path, n_in in kernels.items():
    w = np.asarray(src[path], np.float64)
    diff = (w[pruned] - w[donor]).reshape(int(np.prod(w.shape[1:1 + n_in])), -1)
    s = np.linalg.svd(diff, compute_uv=False)
    total += float(np.sum(s[rank:] ** 2)) / max(float(np.mean(np.sum(w * w, axis=tuple(
        range(1, w.ndim))))), 1e-30)
  return total


def replacement_pattern(cfg: ModelConfig, variables: Any, tokens_NT: np.ndarray, rate: float,
                        rank: int, targets: tuple[str, ...]
                        ) -> tuple[list[int], list[int], dict[str, Any]]:
  """FlexiGPT's replacement: (set of each applied layer, the source layer of each set, summary).
  The round(rate L) blocks of least Block Influence are pruned; each takes the set of the kept
  block of least `donor_residual` at `rank` (ties: the nearer, then the earlier block)."""
  L = cfg.num_layers
  pruned = least(block_influence(cfg, variables, tokens_NT), count(rate, L, 'replace_rate'))
  kept = [l for l in range(L) if l not in pruned]
  src = layout.applied_params(variables['params'], cfg)
  kernels = _adapted_kernels(cfg, targets)
  donors = {}
  for p in pruned:
    scores = [(donor_residual(src, kernels, p, d, rank), abs(p - d), d) for d in kept]
    donors[p] = min(scores)[2]
  set_of = {l: i for i, l in enumerate(kept)}
  pattern = [set_of[donors.get(l, l)] for l in range(L)]
  return pattern, kept, {'pruned': pruned, 'donors': {str(p): d for p, d in donors.items()}}


def parse_layers(spec: str, num_layers: int, name: str) -> list[int]:
  """'i,j' -> sorted distinct layer indices in 0..L-1 (one ConfigError line if not)."""
  try:
    out = sorted({int(x) for x in spec.replace(' ', '').split(',') if x})
  except ValueError:
    out = []
  if not out or out[0] < 0 or out[-1] >= num_layers:
    raise ConfigError(f'config.{name}={spec!r}; valid: comma-separated layer indices in '
                      f'0..{num_layers - 1}, e.g. 0,{num_layers - 1}')
  return out


def extended_pattern(num_layers: int, insert_after: list[int]) -> list[int]:
  """The set (= source layer) of each applied layer when a tied copy of layer i follows each i
  of `insert_after`."""
  out = []
  for l in range(num_layers):
    out += [l, l] if l in insert_after else [l]
  return out

