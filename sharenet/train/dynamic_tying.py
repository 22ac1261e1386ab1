"""Dynamic layer tying: a controller re-chooses the explicit sharing plan while the model trains.

Dynamic Layer Tying for Parameter-Efficient Transformers (David-Hay & Wolf, ICLR 2024,
arXiv:2401.12819): every few iterations an agent decides, for each layer i, whether to train it
independently or to copy the weights of an earlier layer j < i, and the copy stays tied to j.
Here, with train.tying.every = k > 0 and model.sharing.scheme=explicit (its pattern is the
first plan), the train loop asks the controller every k steps. Layer i's action a_i is i (its
own weights) or j < i (layer j's, tied to whatever j is tied to); the actions make an explicit
plan (`pattern_of`), and the model stores only that plan's unique sets. On a change the loop
builds the new plan's model and carries the train state over set by set (`carry_over`): each
new set starts from the set its first layer used, with that set's optimizer moments, transform
state and weight average, as the paper's copy does.

The controller is a bandit on the validation loss, not the paper's reinforcement-learning
agent (Q-learning over the layers' choices). Each layer i >= 1 has the arms 0..i (i: its own
weights), each valued by an exponential recency-weighted average (train.tying.step_size; the
non-stationary bandit of Sutton & Barto, Reinforcement Learning, section 2.5) of the rewards of
the intervals it was chosen in; every layer's chosen arm shares the interval's reward. The
reward is the drop of the validation loss over the interval (the first train.tying.eval_tokens
validation tokens; the loss before the interval's first step minus after its last) relative to
the running mean of earlier drops b (the same recency average): (drop - b) / |b|, so an arm is
valued by whether its intervals improved faster than the run's trend, on one scale early and
late in training (the first interval's reward is 0). Each layer takes its greedy arm (ties: the arm
it holds, then the lowest), or with probability train.tying.epsilon a uniformly random one;
with train.tying.max_sets the plan is then held to that many sets, tying first the layers whose
own weights are valued least above their best copy. The random draws are numpy's, seeded by
(train.seed, the decision's index), and the controller's state is saved with every checkpoint
(its JSON config item, `KEY`), so a resumed run decides as the uninterrupted one would.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharenet.checkpoint import orbax_io
from sharenet.errors import ConfigError

KEY = 'tying'   # the checkpoint config item's entry holding the controller's state


def enabled(t: Any) -> bool:
  """Whether train section (or ConfigDict group) `t` turns dynamic tying on."""
  return int(t['tying']['every']) > 0


def check(t: Any, mcfg: Any) -> None:
  """train.tying's settings against the model (one ConfigError line each)."""
  ty = t.tying
  if ty.every < 0:
    raise ConfigError(f'train.tying.every={ty.every} must be >= 0 (0: off)')
  if not ty.every:
    return
  s = mcfg.sharing
  if s.scheme != 'explicit':
    raise ConfigError(f'train.tying.every={ty.every} re-chooses an explicit plan, and '
                      f'model.sharing.scheme={s.scheme!r}; valid: model.sharing.scheme=explicit '
                      f'with model.sharing.pattern the first plan (e.g. '
                      f'{",".join(map(str, range(mcfg.num_layers)))})')
  if mcfg.num_layers < 2:
    raise ConfigError('train.tying.every > 0 ties layers to earlier ones, and model.num_layers=1 '
                      'has none; valid: model.num_layers >= 2')
  if ty.every >= t.steps:
    raise ConfigError(f'train.tying.every={ty.every} makes no decision in train.steps='
                      f'{t.steps}; valid: 1 <= every < train.steps')
  if not 0.0 <= ty.epsilon <= 1.0:
    raise ConfigError(f'train.tying.epsilon={ty.epsilon} must be in [0, 1]')
  if not 0.0 < ty.step_size <= 1.0:
    raise ConfigError(f'train.tying.step_size={ty.step_size} must be in (0, 1]')
  if ty.eval_tokens < 0:
    raise ConfigError(f'train.tying.eval_tokens={ty.eval_tokens} must be >= 0 (0: '
                      f'data.eval_tokens\')')
  if not 0 <= ty.max_sets <= mcfg.num_layers:
    raise ConfigError(f'train.tying.max_sets={ty.max_sets}: valid 0 (no cap) to '
                      f'model.num_layers={mcfg.num_layers}')
  index = tuple(mcfg.plan.index)
  if index != pattern_of(actions_of(index)):   # the controller numbers sets by first use
    raise ConfigError(f'model.sharing.pattern={s.pattern!r} does not number its sets by first '
                      f'use, which train.tying\'s plans do; valid: '
                      f'{pattern_string(pattern_of(actions_of(index)))!r}, the same plan')
  first = mcfg.plan.num_unique
  if ty.max_sets and first > ty.max_sets:
    raise ConfigError(f'model.sharing.pattern={s.pattern!r} stores {first} sets, above '
                      f'train.tying.max_sets={ty.max_sets}; valid: a first plan of at most '
                      f'{ty.max_sets} sets, or a larger max_sets')


# ---- plans as actions ---------------------------------------------------------------------

def pattern_of(actions: Sequence[int]) -> tuple[int, ...]:
  """The explicit pattern (sets numbered by first use) of per-layer actions: a_i = i trains
  layer i's own weights, a_i = j < i ties it to layer j (and so to what j is tied to)."""
  root = []
  for i, a in enumerate(actions):
    if not 0 <= a <= i:
      raise ValueError(f'layer {i}: action {a} is not one of 0..{i}')
    root.append(i if a == i else root[a])
  number = {}
  return tuple(number.setdefault(r, len(number)) for r in root)


def actions_of(pattern: Sequence[int]) -> tuple[int, ...]:
  """Per-layer actions making `pattern`: each layer copies its set's first layer (that layer
  itself trains its own weights)."""
  first = {}
  return tuple(first.setdefault(p, i) for i, p in enumerate(pattern))


def sources(old: Sequence[int], new: Sequence[int]) -> np.ndarray:
  """For each set of plan `new`, the set of plan `old` it starts from: the one its first layer
  used (a layer that copies takes its donor's weights; one that keeps its own keeps them)."""
  first = actions_of(new)
  return np.asarray([old[first[i]] for i in sorted(set(first)) if first[i] == i], np.int32)


# ---- the controller -----------------------------------------------------------------------

class Bandit:
  """The per-layer bandit (module docstring); `state()` / `from_state` are its JSON form."""

  def __init__(self, settings: Any, seed: int, pattern: Sequence[int]):
    self.settings, self.seed = settings, int(seed)
    n = len(pattern)
    self.actions = list(actions_of(pattern))
    self.values = [[0.0] * (i + 1) for i in range(n)]
    self.counts = [[0] * (i + 1) for i in range(n)]
    self.last_loss: float | None = None
    self.baseline: float | None = None
    self.decisions = 0
    self.history: list[list[Any]] = []   # [step, pattern, loss, reward] per decision

  @property
  def pattern(self) -> tuple[int, ...]:
    return pattern_of(self.actions)

  def state(self) -> dict[str, Any]:
    return {'actions': list(self.actions), 'values': self.values, 'counts': self.counts,
            'last_loss': self.last_loss, 'baseline': self.baseline,
            'decisions': self.decisions, 'history': self.history}

  @classmethod
  def from_state(cls, settings: Any, seed: int, state: dict[str, Any]) -> 'Bandit':
    b = cls(settings, seed, pattern_of(state['actions']))
    b.actions = [int(a) for a in state['actions']]
    b.values = [[float(v) for v in row] for row in state['values']]
    b.counts = [[int(v) for v in row] for row in state['counts']]
    b.last_loss, b.baseline = state['last_loss'], state['baseline']
    b.decisions, b.history = int(state['decisions']), copy.deepcopy(state['history'])
    return b

  def observe(self, loss: float) -> float | None:
    """Credits the interval that ends here (validation `loss` now) to each layer's held arm;
    -> the reward (None at the first measurement, which starts the first interval)."""
    reward = None
    if self.last_loss is not None:
      drop = self.last_loss - loss
      base = self.baseline if self.baseline is not None else drop
      # relative to the trend, so the large early drops do not outweigh the later ones
      reward = (drop - base) / abs(base) if base else 0.0
      alpha = self.settings.step_size
      self.baseline = drop if self.baseline is None else self.baseline + alpha * (
          drop - self.baseline)
      for i in range(1, len(self.actions)):
        a = self.actions[i]
        self.counts[i][a] += 1
        q = self.values[i][a]
        self.values[i][a] = reward if self.counts[i][a] == 1 else q + alpha * (reward - q)
    self.last_loss = float(loss)
    return reward

  def choose(self) -> tuple[int, ...]:
    """The next plan's actions (greedy, epsilon-random, then held to max_sets); counts the
    decision. The draws: numpy's, seeded by (seed, the decision's index)."""
    rng = np.random.default_rng([self.seed, self.decisions])
    out = [0]
    for i in range(1, len(self.actions)):
      explore, arm = rng.random(), int(rng.integers(0, i + 1))   # both drawn every time
      if explore < self.settings.epsilon:
        out.append(arm)
        continue
      q = self.values[i]
      best = max(q)
      ties = [a for a in range(i + 1) if q[a] == best]
      out.append(self.actions[i] if self.actions[i] in ties else ties[0])
    cap = self.settings.max_sets
    while cap and len(set(pattern_of(out))) > cap:
      own = [i for i in range(1, len(out)) if out[i] == i]
      gap = lambda i: self.values[i][i] - max(self.values[i][:i])
      i = min(own, key=lambda i: (gap(i), -i))   # the least valued own weights; later first
      out[i] = int(np.argmax(self.values[i][:i]))
    self.actions = out
    self.decisions += 1
    return pattern_of(out)


# ---- the train state across a change ------------------------------------------------------

def per_set_leaves(state_at: Callable[[tuple[int, ...]], Any], num_layers: int) -> Any:
  """The train state's tree of ints: m > 0 where a leaf's first axis holds m entries per
  stored set, set-major (parameters and optimizer moments: m = 1; Shampoo's blocks, flattened
  over the leading stack axes and the block grid: m per set), 0 elsewhere; read from the
  abstract states `state_at(pattern)` of the untied and the universal plan. A leaf that changes
  with the plan otherwise is one ConfigError line: it cannot be carried over."""
  many, one = state_at(tuple(range(num_layers))), state_at((0,) * num_layers)

  def leaf(path, a, b):
    if a.shape == b.shape:
      return 0
    if a.shape[1:] != b.shape[1:] or not b.shape or a.shape[0] != num_layers * b.shape[0]:
      raise ConfigError(f'train.tying: the state leaf {jax.tree_util.keystr(path)} changes with '
                        f'the plan otherwise than by its entries per stored set ({a.shape} '
                        f'untied, {b.shape} universal), so a new plan cannot take it over; '
                        f'valid: train.tying.every=0 with this config')
    return b.shape[0]
  try:
    return jax.tree_util.tree_map_with_path(leaf, many, one)
  except ConfigError:
    raise
  except ValueError as e:   # tree structures differ: a part that comes and goes with the plan
    raise ConfigError(f'train.tying: the train state\'s tree changes with the plan '
                      f'({str(e).splitlines()[0][:120]}); valid: train.tying.every=0 with this '
                      f'config') from None


def carry_over(state: Any, per_set: Any, src: np.ndarray) -> Any:
  """`state` for the new plan: every per-set leaf's sets (its first axis as (sets, m, ...))
  gathered by `src` (`sources`)."""
  idx = jnp.asarray(src)

  def take(x, m):
    if not m:
      return x
    sets = x.reshape((x.shape[0] // m, m) + x.shape[1:])
    return jnp.take(sets, idx, axis=0).reshape((len(src) * m,) + x.shape[1:])
  return jax.tree.map(take, state, per_set)


# ---- checkpoints and workdir readers ------------------------------------------------------

def saved_pattern(saved_config: dict[str, Any] | None) -> tuple[int, ...] | None:
  """The plan a checkpoint's config item records (None: none recorded)."""
  if not saved_config or KEY not in saved_config:
    return None
  return pattern_of(saved_config[KEY]['actions'])


def with_pattern(config: Any, pattern: Sequence[int]) -> Any:
  """A copy of experiment config `config` (ConfigDict or dict) training the explicit plan
  `pattern`: what a workdir reader builds for a checkpoint of a dynamic-tying run."""
  config = copy.deepcopy(config)
  config['model']['sharing']['pattern'] = pattern_string(pattern)
  return config


def pattern_string(pattern: Sequence[int]) -> str:
  return ','.join(str(int(p)) for p in pattern)


# ---- the train loop's side ----------------------------------------------------------------

class Runtime:
  """Dynamic tying in the train loop (train/loop.py): one build per plan (`build(run)`: the
  loop's experiment, compiled step and restore target, cached), the controller, and the
  decisions. Made before the restore: the newest checkpoint's plan and controller (else the
  config's pattern and a fresh controller) are `current`."""

  def __init__(self, run: Any, first: Any, build: Callable[[Any], Any], mngr: Any):
    self.run, self._build, self.mngr = run, build, mngr
    self.settings, self.seed = run.train.tying, run.train.seed
    self.builds = {tuple(run.model.plan.index): first}
    self._per_set = None
    data_cfg = run.data
    if self.settings.eval_tokens:   # the reward's validation tokens
      data_cfg = dataclasses.replace(data_cfg, eval_tokens=int(self.settings.eval_tokens))
    self.reward_data = data_cfg
    steps = mngr.all_steps()
    self._load(max(steps) if steps else None)

  def _saved(self, step: int | None) -> dict[str, Any] | None:
    return None if step is None else orbax_io.saved_config(self.mngr, step)

  def _load(self, step: int | None) -> None:
    state = (self._saved(step) or {}).get(KEY)
    self.bandit = (Bandit.from_state(self.settings, self.seed, state) if state else
                   Bandit(self.settings, self.seed, self.run.model.plan.index))

  def build(self, pattern: Sequence[int]) -> Any:
    key = tuple(int(p) for p in pattern)
    if key not in self.builds:
      model = self.run.model.derive(sharing={'pattern': pattern_string(key)})
      self.builds[key] = self._build(dataclasses.replace(self.run, model=model))
    return self.builds[key]

  @property
  def current(self) -> Any:
    return self.build(self.bandit.pattern)

  def target_at(self, step: int) -> Any:
    """The restore target of checkpoint `step`: its plan's state."""
    return self.build(saved_pattern(self._saved(step)) or self.run.model.plan.index).target

  def restored(self, step: int) -> Any:
    """After the restore of checkpoint `step` (0: a fresh start): its controller, its build."""
    if step:
      self._load(step)
    return self.current

  @property
  def needs_start_loss(self) -> bool:
    """No interval has started: the loop measures the loss before its first step."""
    return self.bandit.last_loss is None

  def decides_at(self, step: int) -> bool:
    return step % self.settings.every == 0 and step < self.run.train.steps

  def record(self) -> dict[str, Any]:
    """The checkpoint config item's entry: the plan (as actions) and the controller."""
    return {KEY: self.bandit.state()}

  def per_set(self) -> Any:
    if self._per_set is None:
      self._per_set = per_set_leaves(lambda p: self.build(p).c.abstract,
                                     self.run.model.num_layers)
    return self._per_set

  def decide(self, step: int, state: Any,
             loss_of: Callable[[Any, Any], float]) -> tuple[Any, Any, dict[str, float]]:
    """At `step`: the validation loss (`loss_of(build, state)`) credits the interval that
    ends, then the next plan is chosen; the first measurement (before the first interval)
    chooses nothing. -> (state, the plan's build, the log row)."""
    old = self.bandit.pattern
    loss = float(loss_of(self.current, state))
    reward = self.bandit.observe(loss)
    row = {'tying/loss': loss, **({} if reward is None else {'tying/reward': reward})}
    if reward is None:   # the first measurement: it starts the first interval
      return state, self.current, {**row, 'tying/sets': float(len(set(old)))}
    new = self.bandit.choose()
    self.bandit.history.append([int(step), pattern_string(new), loss, reward])
    b = self.build(new)
    if new != old:
      per_set, src = self.per_set(), sources(old, new)
      state = jax.jit(lambda s: carry_over(s, per_set, src), out_shardings=b.c.shardings)(state)
      print(f'sharenet: train.tying at step {step}: plan {pattern_string(old)} -> '
            f'{pattern_string(new)} ({len(set(new))} stored sets)', flush=True)
    return state, b, {**row, 'tying/sets': float(len(set(new))),
                      'tying/changed': float(new != old)}
