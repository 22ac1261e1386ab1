"""Recurrent-depth training: each step's sampled depth, its loop schedule and executed FLOPs,
and the loss at every loop's exit (docs/loops.md).

Depth (model.recurrence.depth, Geiping et al., arXiv:2502.05171, the reference's
`poisson-lognormal-filling` sampler): tau ~ N(log(mean - 1) - sigma^2 / 2, sigma), sigma = 1/2,
depth = 1 + Poisson(e^tau), so E[depth] = mean (the paper's r-bar is our mean - 1: it draws
r ~ P(e^tau) + 1 around r-bar). Only the last k = model.recurrence.backprop loops carry
gradient; the loops before them are a traced no-grad prefix (models/loops.py Schedule), one
compiled program for every depth. A draw below k runs k loops, all with gradient (the reference
then runs the draw, all with gradient: a static k is what keeps one program), so the sampled
minimum is k by construction; backprop above the mean is refused.

The draw is a pure function of (train.seed, step), made on the host with numpy's legacy
RandomState (its streams are frozen across numpy versions) over MT19937 seeded by
SeedSequence((seed, step, tag)): every host draws the same depth with no communication, the
host knows it when it logs the step's depth and executed FLOPs (no device read in the
asynchronous loop), and a resume after kill -9 draws again exactly what the lost steps drew.
It reaches the jitted step as a replicated int32 scalar, so no depth recompiles.

Exits (train.exit_loss): `all` or explicit weights put a loss at the exit of every gradient
loop: the stream after the loop (Schedule.collect) through the segments after the looped one
(middle_cycle's unique last layer, as sharenet/inference/loop_by_loop.py exits early) and the
shared head. The step's loss is their weighted mean (weights normalised to sum 1); each exit's
mean loss is logged as exit_loss_1..exit_loss_k (k: the gradient loops, the last of which is
the model's output; with a no-grad prefix of p loops, exit j is loop p + j).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sharenet.train import evaluation
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig, accounting, loops
from sharenet.models.recurrence import RNG

SIGMA = 0.5                  # the reference's log-normal sigma
_TAG = 0x7265635F            # separates the depth stream from others derived from train.seed
EXIT_LOSSES = ('last', 'all')


class StepLoops(NamedTuple):
  """What a train step needs from the train section: the exit weights (None: the last exit
  only) and the seed of the `normal` initial state's per-step key."""
  exits: tuple[float, ...] | None = None
  seed: int = 0


def sampled(cfg: ModelConfig) -> bool:
  """The depth changes from step to step (a traced argument of the train step)."""
  return cfg.recurrent_segment is not None and cfg.recurrence.depth == 'poisson_lognormal'


def fixed_depth(cfg: ModelConfig) -> int:
  """The depth of a fixed-depth run, and a sampled run's default (the rounded mean, >= k)."""
  return max(int(round(cfg.depth_mean)), cfg.grad_loops)


def eval_schedule(cfg: ModelConfig) -> loops.Schedule:
  """The loops evaluation runs (the train loop's and eval.py's): the run's fixed depth, a
  sampled run's rounded mean; the plan's R without model.recurrence (eval.py --depths: others)."""
  if cfg.recurrent_segment is None or fixed_depth(cfg) == loops.looped(cfg).loops:
    return loops.Schedule()
  return loops.Schedule(loops=fixed_depth(cfg))


def sample_depth(cfg: ModelConfig, seed: int, step: int) -> int:
  """Loops of the looped segment at train step `step` (0-based) of a run seeded `seed`."""
  if not sampled(cfg):
    return fixed_depth(cfg)
  ss = np.random.SeedSequence([seed % 2**32, step, _TAG])
  rng = np.random.RandomState(np.random.MT19937(ss))
  mean = cfg.depth_mean
  draw = 1
  if mean > 1:
    rate = rng.lognormal(math.log(mean - 1) - SIGMA ** 2 / 2, SIGMA)
    draw = 1 + int(rng.poisson(rate))
  return max(draw, cfg.grad_loops)


def schedule(cfg: ModelConfig, depth: Any = None, collect: bool = False) -> loops.Schedule:
  """The loop schedule of a train step at `depth` (a traced int32 for a sampled depth; None:
  the fixed depth): the last grad_loops loops with gradient, the rest a no-grad prefix."""
  if cfg.recurrent_segment is None and not collect:
    return loops.Schedule()
  R, k = loops.looped(cfg).loops, cfg.grad_loops
  if depth is None or not sampled(cfg):
    p = fixed_depth(cfg) - k
    if (k, p, collect) == (R, 0, False):
      return loops.Schedule()
    return loops.Schedule(loops=k, no_grad=p, collect=collect)
  return loops.Schedule(loops=k, no_grad=jnp.asarray(depth, jnp.int32) - k, collect=collect)


def exit_weights(exit_loss: str, cfg: ModelConfig) -> tuple[float, ...] | None:
  """train.exit_loss -> one weight per gradient loop (None: `last`); one ConfigError line.
  What a per-loop loss refuses (routing, u-muP, plans without a loop) is the table's."""
  spec = str(exit_loss).replace(' ', '')
  if spec == 'last':
    return None
  k = cfg.grad_loops
  valid = f'valid: last, all, or {k or "one"} comma-separated weights >= 0 (one per gradient loop)'
  try:
    loops.looped(cfg)
  except ConfigError:
    raise ConfigError(f'train.exit_loss={exit_loss!r} puts a loss at every loop\'s exit; '
                      f'model.sharing.scheme={cfg.sharing.scheme!r} has no looped segment; '
                      f'valid: last') from None
  if spec == 'all':
    return (1.0,) * k
  try:
    weights = tuple(float(w) for w in spec.split(','))
  except ValueError:
    raise ConfigError(f'train.exit_loss={exit_loss!r} is unknown; {valid}') from None
  if len(weights) != k or min(weights) < 0 or not sum(weights) > 0:
    raise ConfigError(f'train.exit_loss={exit_loss!r}: {len(weights)} weights for {k} gradient '
                      f'loops (or a negative / all-zero weight); {valid}')
  return weights


def step_loops(train: Any, cfg: ModelConfig) -> StepLoops:
  """The StepLoops of the train section `train` (experiment.validate checked its exit_loss)."""
  return StepLoops(exit_weights(train.exit_loss, cfg), int(train.seed))


def rngs(seed: int, step: jax.Array, micro: jax.Array | None = None) -> dict[str, jax.Array]:
  """The 'recurrence' rng (the `normal` initial state) of a step's forward: a function of
  (seed, step) and, under train.grad_accum > 1, of the micro-batch `micro`, so each micro-batch
  draws fresh noise (the reference draws anew at every forward)."""
  key = jax.random.fold_in(jax.random.key(seed), step)
  return {RNG: key if micro is None else jax.random.fold_in(key, micro)}


def loss(model: DecoderLM, variables: Any, batch_BT1: Any, depth: Any, spec: StepLoops,
         step: jax.Array, mutable: tuple[str, ...] = (),
         micro: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
  """Mean next-token NLL of a recurrent-depth step (the last exit, or the weighted mean of
  every gradient loop's exit with exit_loss_j entries in the returned collections)."""
  keys = rngs(spec.seed, step, micro)
  weights = spec.exits
  sched = schedule(model.cfg, depth, collect=weights is not None)
  if weights is None:
    nll_BT, aux = evaluation.token_nll(model, variables, batch_BT1, mutable, schedule=sched,
                                     rngs=keys)
    return evaluation.mean_nll(nll_BT, batch_BT1), aux
  tokens_BT1, seg_BT1 = evaluation.split_batch(batch_BT1)
  inputs = (tokens_BT1[:, :-1],) if seg_BT1 is None else (tokens_BT1[:, :-1], seg_BT1[:, :-1])
  _, state = model.apply(variables, *inputs, schedule=sched, rngs=keys,
                         mutable=list(mutable) + [loops.PER_LOOP])
  aux = {k: v for k, v in state.items() if k != loops.PER_LOOP}
  (streams_NBTD,) = jax.tree.leaves(state[loops.PER_LOOP])
  logits_NBTV = model.apply(variables, streams_NBTD, None if seg_BT1 is None else seg_BT1[:, :-1],
                            method='exit_logits')
  nll_NBT = optax.softmax_cross_entropy_with_integer_labels(
      logits_NBTV, jnp.broadcast_to(tokens_BT1[None, :, 1:], logits_NBTV.shape[:-1]))
  exits_N = jax.vmap(lambda nll_BT: evaluation.mean_nll(nll_BT, batch_BT1))(nll_NBT)
  w_N = jnp.asarray(weights, jnp.float32) / sum(weights)
  aux.update({f'exit_loss_{j + 1}': exits_N[j] for j in range(len(weights))})
  return jnp.sum(w_N * exits_N), aux


class FlopsCounter:
  """Executed train FLOPs per token of a step at a depth (the nominal model FLOPs without
  recurrence or exits, whose steps are all alike: `depths` False), and its log entries."""

  def __init__(self, train: Any, cfg: ModelConfig, extra: float = 0.0):
    self.cfg, self.seq_len = cfg, int(train.seq_len)
    exits = step_loops(train, cfg).exits
    self.exits = len(exits) if exits else 1
    self.depths = cfg.recurrent_segment is not None or exits is not None
    self.extra = float(extra)   # per token besides the model's: a teacher's forward
    self.nominal = accounting.flops_per_token(cfg, self.seq_len) + self.extra
    self._at: dict[int, float] = {}

  def __call__(self, depth: int) -> float:
    if not self.depths:
      return self.nominal
    if depth not in self._at:
      self._at[depth] = executed_flops_per_token(self.cfg, self.seq_len, depth,
                                                 self.exits) + self.extra
    return self._at[depth]

  def row(self, depth: int) -> dict[str, float]:
    """metrics.jsonl entries of a step at `depth`: its depth and executed FLOPs per token."""
    if not self.depths:
      return {}
    return {'depth': depth, 'executed_flops_per_token': self(depth)}


def executed_flops_per_token(cfg: ModelConfig, seq_len: int, depth: int,
                             exits: int = 1) -> float:
  """Train FLOPs per token a step at `depth` executes (accounting.flops_per_token's model
  FLOPs): forward through every loop, backward (2x) through what carries gradient: the last
  grad_loops loops, the coda and head of each of `exits` exits, and the prelude where the
  gradient reaches it (no no-grad prefix, or an injection)."""
  head = 2 * accounting.readout_matmul_params(cfg)
  # a factorized embedding's lift (models/embeddings.py) runs where the prelude does
  lift = 2 * accounting.lift_matmul_params(cfg) + accounting.io_attention_flops(cfg, seq_len)
  shape = loops.looped(cfg)
  layer = (accounting.flops_per_token(cfg, seq_len, train=False) - head - lift) / cfg.num_layers
  prelude, K, coda = shape.start, shape.num_sets, shape.num_layers - shape.coda
  k = min(cfg.grad_loops, depth)
  adapter = 2 * 2 * cfg.d_model * cfg.d_model if cfg.recurrence.injection == 'concat' else 0
  out = exits * (coda * layer + head)
  fwd = lift + prelude * layer + depth * (K * layer + adapter) + out
  grad = k * (K * layer + adapter) + out
  if depth == k or cfg.recurrence.injection != 'none':
    grad += lift + prelude * layer
  return fwd + 2 * grad
