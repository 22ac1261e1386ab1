"""`data.mixture`: training batches drawn by weight from several prepared shard directories.

`data.mixture='DIR_A:0.8,DIR_B:0.2'` (with `data.source=arrayrecord` and no `data.path`) names
directories written by `python -m sharenet.data.prepare` and their weights (any positive
numbers, normalized to sum to 1); an entry `NAME=DIR:W` names its source, else the directory's
base name does (names label the metrics and must differ). The directories must share their
tokenizer (by contents), vocabulary and end-of-document id (one model reads them all) and all be
fine-tuning pairs with a loss mask or none.
`data.mixture_schedule='STEP:W_A/W_B,...'` changes the weights from each STEP on (piecewise
constant stages, as levanter's stage-wise mixtures; weights in data.mixture's order, >= 0, not
all 0); before its first STEP the data.mixture weights hold.

Which source feeds a row: global row k of the stream (row r of step s is k = s * B + r for the
global batch size B) draws from the source whose interval of [0, 1) (the step's weights laid end
to end, in data.mixture's order) holds u_k = frac(offset + k * (sqrt(5) - 1) / 2), the golden
ratio's Weyl sequence (a 64-bit integer recurrence, so every platform draws the same sources;
`offset` comes from the data seed). A source with weight w then feeds w * N rows of any N
consecutive rows up to an O(log N) discrepancy (Weyl's equidistribution theorem with the golden
ratio's bounded continued fraction; Kuipers & Niederreiter, "Uniform Distribution of Sequences",
ch. 1 sec. 3 and ch. 2 sec. 3): over 200 steps of 8 rows the shares are within a row or two of
the weights, far tighter than drawing each row at random (binomial noise of ~1 % per source).
The assignment is a pure function of (seed, weights, k), so `seen_rows` knows the shares at any
step without replaying the stream.

Each source is read as `arrayrecord.train_dataset` reads one directory: the process's record
slice of it, packed into `local_batch` streams (every B-th document each), optionally window
shuffled (data.shuffle_windows); a source's rows take windows from its streams in turn. The
iterator's state is the step, the windows taken from each source and every stream's packing
state, so a resume (also after kill -9, from the last checkpoint) continues the exact stream.

Evaluation reports every source's validation loss and bits per byte (`eval_loss/NAME`,
`eval_bits_per_byte/NAME`); `eval_loss` and `eval_bits_per_byte` are their averages under the
data.mixture weights (not a schedule's later stage), so the headline number keeps one meaning
over a run. Training log rows carry `data_share/NAME`, each source's share of the rows (hence of
the tokens: every row is seq_len + 1 tokens) of steps [0, step).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Sequence

import grain
import numpy as np

from sharenet.data import arrayrecord, tokenizer
from sharenet.errors import ConfigError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)   # round(2**64 * (sqrt(5) - 1) / 2), odd
_SEED_MIX = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's multiplier: the seed's offset
_SYNTAX = 'DIR:WEIGHT[,DIR:WEIGHT...] (or NAME=DIR:WEIGHT)'


@dataclasses.dataclass(frozen=True)
class Source:
  name: str
  path: str
  weight: float   # normalized data.mixture weight


@dataclasses.dataclass(frozen=True)
class Mixture:
  """The parsed data.mixture and data.mixture_schedule (`parse`)."""
  sources: tuple[Source, ...]
  stages: tuple[tuple[int, tuple[float, ...]], ...]   # (first step, normalized weights), step 0 first
  seed: int

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(s.name for s in self.sources)

  def weights_at(self, step: int) -> np.ndarray:
    """The normalized weights in force at `step`."""
    starts = [start for start, _ in self.stages]
    return np.asarray(self.stages[int(np.searchsorted(starts, step, side='right')) - 1][1])

  def row_sources(self, rows_N: np.ndarray, batch_size: int) -> np.ndarray:
    """Source index of each global row index in `rows_N` (row r of step s is s * B + r)."""
    rows_N = np.asarray(rows_N, np.uint64)
    offset = np.uint64(self.seed * int(_SEED_MIX) % 2**64)
    with np.errstate(over='ignore'):
      u_N = (offset + rows_N * _GOLDEN) >> np.uint64(11)   # the top 53 bits: exact in float64
    u_N = u_N.astype(np.float64) / 2.0**53
    out_N = np.zeros(len(rows_N), np.int64)
    steps_N = rows_N // np.uint64(batch_size)
    for start, weights in self.stages:   # later stages overwrite their steps
      cuts = np.cumsum(weights)[:-1]
      in_stage = steps_N >= np.uint64(start)
      out_N[in_stage] = np.searchsorted(cuts, u_N[in_stage], side='right')
    return out_N


def _number(text: str, what: str, allow_zero: bool) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
    bound = '>= 0' if allow_zero else '> 0'
    raise ConfigError(f'{what}={text!r}; valid: a number {bound}')
  return value


def _entry(text: str) -> tuple[str, str, float]:
  spec, colon, weight = text.rpartition(':')
  if not colon or not spec:
    raise ConfigError(f'data.mixture entry {text!r} has no weight; valid: {_SYNTAX}')
  name, eq, path = spec.partition('=')
  if not eq:
    name, path = os.path.basename(os.path.normpath(spec)), spec
  if not name or not path:
    raise ConfigError(f'data.mixture entry {text!r} names no directory; valid: {_SYNTAX}')
  return name, path, _number(weight, f'data.mixture weight of {path!r}', allow_zero=False)


def _entries(spec: str) -> list[tuple[str, str, float]]:
  entries = [_entry(x.strip()) for x in spec.split(',') if x.strip()]
  if not entries:
    raise ConfigError(f'data.mixture={spec!r} names no source; valid: {_SYNTAX}')
  return entries


def _schedule(spec: str, names: Sequence[str]) -> list[tuple[int, tuple[float, ...]]]:
  stages, last = [], 0
  for item in filter(None, (x.strip() for x in spec.split(','))):
    step, colon, weights = item.partition(':')
    if not colon or not step.strip().isdigit() or int(step) <= last:
      raise ConfigError(f'data.mixture_schedule entry {item!r}: valid: STEP:W/W/... with '
                        f'steps > 0 and increasing (one weight per data.mixture source: '
                        f'{", ".join(names)})')
    values = [_number(w, f'data.mixture_schedule weight at step {step}', allow_zero=True)
              for w in weights.split('/')]
    if len(values) != len(names) or not sum(values):
      raise ConfigError(f'data.mixture_schedule entry {item!r} has {len(values)} weights '
                        f'summing to {sum(values)}; valid: one per source ({", ".join(names)}), '
                        f'not all 0')
    stages.append((int(step), tuple(v / sum(values) for v in values)))
    last = int(step)
  return stages


@functools.lru_cache(maxsize=8)
def parse(spec: str, schedule: str = '', seed: int = 0) -> Mixture:
  """The mixture of data.mixture `spec` and data.mixture_schedule `schedule` (module doc); one
  ConfigError line for bad syntax, a weight <= 0, a directory that is not prepared shards, two
  sources of one name, or sources of different tokenizers."""
  entries = _entries(spec)
  names = [name for name, _, _ in entries]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ConfigError(f'data.mixture names two sources {dup[0]!r}; valid: distinct names '
                      f'(NAME=DIR:WEIGHT names one)')
  total = sum(w for _, _, w in entries)
  sources = tuple(Source(n, p, w / total) for n, p, w in entries)
  identities = {}
  for s in sources:
    if not os.path.isfile(os.path.join(os.path.expanduser(s.path), 'meta.json')):
      raise ConfigError(f'data.mixture source {s.name!r}: {s.path!r} is not a prepared '
                        f'directory (no meta.json); valid: directories written by python -m '
                        f'sharenet.data.prepare')
    meta = arrayrecord.meta(s.path)
    identities[s.name] = (tokenizer.identity(meta['tokenizer'], 'data.mixture',
                                             base_dir=os.path.expanduser(s.path)),
                          meta['vocab_size'], meta['eod_id'], bool(meta.get('loss_mask')))
  first = sources[0].name
  for name, ident in identities.items():
    if ident != identities[first]:
      raise ConfigError(f'data.mixture sources {first!r} and {name!r} were prepared with other '
                        f'tokenizers (tokenizer, vocab_size, eod_id, loss_mask: '
                        f'{identities[first]} vs {ident}); valid: directories prepared with one '
                        f'tokenizer, all fine-tuning pairs or none')
  stages = [(0, tuple(s.weight for s in sources))] + _schedule(schedule, names)
  return Mixture(sources, tuple(stages), int(seed) % 2**64)


def source_paths(spec: str) -> list[str]:
  """The directories data.mixture names (syntax checked; for what reads only the first's
  meta.json)."""
  return [path for _, path, _ in _entries(spec)]


class SeenRows:
  """Rows each source fed in steps [0, step): `at(step)`, counted once and kept (a log row
  asks at increasing steps, so each call counts only the new steps)."""

  def __init__(self, mixture: Mixture, batch_size: int):
    self._mix, self._batch = mixture, batch_size
    self._step, self._counts = 0, np.zeros(len(mixture.sources), np.int64)

  def at(self, step: int) -> np.ndarray:
    if step < self._step:
      self._step, self._counts = 0, np.zeros_like(self._counts)
    chunk = max(1, (1 << 20) // self._batch)   # steps per vectorized count
    while self._step < step:
      n = min(chunk, step - self._step)
      rows = np.arange(self._step * self._batch, (self._step + n) * self._batch)
      self._counts += np.bincount(self._mix.row_sources(rows, self._batch),
                                  minlength=len(self._counts))
      self._step += n
    return self._counts.copy()

  def shares(self, step: int) -> dict[str, float]:
    """{'data_share/NAME': share of the rows of steps [0, step)} (empty at step 0)."""
    counts = self.at(step)
    total = counts.sum()
    return {} if not total else {f'data_share/{n}': float(c / total)
                                 for n, c in zip(self._mix.names, counts)}


class _MixtureIterator(grain.DatasetIterator):
  """Step by step, each local row takes the next window of its source (`row_sources`), the
  source's streams taking turns."""

  def __init__(self, streams: list[list[grain.DatasetIterator]], mixture: Mixture,
               batch_size: int, first_row: int, local_batch: int, window: int):
    super().__init__([it for its in streams for it in its])
    self._streams, self._mix, self._batch = streams, mixture, batch_size
    self._rows = first_row + np.arange(local_batch)
    self._window = window
    self._step, self._taken = 0, [0] * len(streams)

  def __next__(self) -> np.ndarray:
    sources = self._mix.row_sources(self._step * self._batch + self._rows, self._batch)
    out_BW = np.empty((len(self._rows), self._window), arrayrecord.DTYPE)
    for j, i in enumerate(sources):
      its = self._streams[i]
      out_BW[j] = next(its[self._taken[i] % len(its)])
      self._taken[i] += 1
    self._step += 1
    return out_BW

  def get_state(self) -> dict[str, Any]:
    return {'step': self._step, 'taken': list(self._taken),
            'streams': [[it.get_state() for it in its] for its in self._streams]}

  def set_state(self, state: dict[str, Any]) -> None:
    self._step, self._taken = int(state['step']), [int(n) for n in state['taken']]
    for its, states in zip(self._streams, state['streams']):
      for it, s in zip(its, states):
        it.set_state(s)


class MixtureDataset(grain.IterDataset):
  """Endless (local_batch, seq_len + 1) uint32 windows of a mixture (module doc)."""

  def __init__(self, streams: list[list[grain.IterDataset]], mixture: Mixture, batch_size: int,
               first_row: int, local_batch: int, window: int):
    super().__init__([ds for dss in streams for ds in dss])
    self._streams = streams
    self._args = (mixture, batch_size, first_row, local_batch, window)

  def __iter__(self) -> _MixtureIterator:
    return _MixtureIterator([[ds.__iter__() for ds in dss] for dss in self._streams],
                            *self._args)


def train_dataset(mixture: Mixture, seq_len: int, batch_size: int, seed: int,
                  process_index: int = 0, process_count: int = 1, segment_mask: bool = False,
                  shuffle_windows: int = 0) -> grain.IterDataset:
  """Endless batches (batch_size // process_count, seq_len + 1) drawn from the mixture: this
  process's rows [p * B / P, (p + 1) * B / P) of every global batch."""
  local = batch_size // process_count
  streams = []
  for i, s in enumerate(mixture.sources):
    try:
      streams.append(arrayrecord.row_streams(s.path, seq_len, local, seed + 104729 * i,
                                             process_index, process_count, shuffle_windows))
    except ConfigError as e:
      raise ConfigError(f'data.mixture source {s.name!r}: {e}') from None
  mixed = MixtureDataset(streams, mixture, batch_size, process_index * local, local, seq_len + 1)
  first = mixture.sources[0].path
  eod_id = arrayrecord.meta(first)['eod_id'] if segment_mask else None
  return arrayrecord.to_batches(mixed, eod_id, arrayrecord.has_loss_mask(first))
