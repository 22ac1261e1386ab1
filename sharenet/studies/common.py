"""Pieces shared by the studies: variants of a base config, a fixed batch, log-log fits."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import sys
import time
from typing import Any, Callable

import statistics

import numpy as np

from sharenet import data
from sharenet.config import cli
from sharenet.errors import ConfigError
from sharenet.models import ModelConfig, param_table
from sharenet.main import eval_workdir
from sharenet.train import experiment, loop, workdir_io


def parse_list(s: Any, cast=int) -> list:
  """'64,128' -> [64, 128] (lists / tuples pass through)."""
  if isinstance(s, (list, tuple)):
    return [cast(x) for x in s]
  return [cast(x) for x in str(s).replace(' ', '').split(',') if x]


def with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
  """A copy of `config` with dotted-key overrides ('model.d_model': 128); an unknown key is a
  ConfigError naming the nearest valid one (a typo never silently adds a field)."""
  c = copy.deepcopy(config)
  valid = cli.dotted_keys(c)
  for key, value in overrides.items():
    if key not in valid:
      raise ConfigError(cli.unknown_key(key, valid))
    node = c
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
  """'mup:loop_rule=inv_R:lr=0.5' -> (spec, {'kind': 'mup', 'loop_rule': 'inv_R', 'lr': 0.5})."""
  kind, *opts = spec.split(':')
  out: dict[str, Any] = {'kind': kind}
  for o in opts:
    k, v = o.split('=')
    try:
      out[k] = json.loads(v)
    except json.JSONDecodeError:
      out[k] = v
  return spec, out


def completed(res: dict[str, Any], workdir: str) -> dict[str, Any]:
  """`res` of loop.train_and_evaluate if the run reached its final evaluation; a run stopped
  early (SIGTERM: checkpoint saved, no eval) exits the study with one line instead of recording
  a row without results. Rerunning the same command resumes it from its checkpoint."""
  if 'eval_loss' not in res:
    print(f'sharenet: {workdir} stopped before its final evaluation (SIGTERM); checkpoint kept, '
          f'rerun the same command to resume', file=sys.stderr, flush=True)
    raise SystemExit(143)
  return res


def stored_params(workdir: str) -> int:
  """Stored trainable parameters of a workdir's model (its role table; nothing allocated)."""
  cfg = ModelConfig.from_experiment(workdir_io.load_config(workdir))
  return sum(math.prod(i.shape) for i in param_table(cfg).values())


def study_names(config: Any, key: str, valid: Any, example: str) -> list[str]:
  """config.study.<key> as a list of names from `valid` ('all' = every one); a missing study
  group or an unknown name is a one-line ConfigError naming the valid choices."""
  if 'study' not in config:
    raise ConfigError(f'the config has no study group; valid: a config like {example}')
  names = parse_list(config.study[key], str)
  names = list(valid) if names == ['all'] else names
  bad = [n for n in names if n not in valid]
  if bad:
    raise ConfigError(f'study.{key}: {bad[0]!r} is unknown; valid: {", ".join(valid)}')
  return names


def append_row(path: str, row: dict[str, Any], key: Callable[[dict[str, Any]], Any]
               ) -> list[dict[str, Any]]:
  """Adds `row` to the JSON list at `path` under an exclusive lock, replacing the row with the
  same `key(row)`, and returns the merged list.

  Several study processes may share one --out (e.g. one pinned to each core with `taskset`, each
  given its own variants): each re-reads the file under the lock, so no row is lost.
  """
  import fcntl
  with open(path + '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    rows = json.load(open(path)) if os.path.exists(path) else []
    rows = [r for r in rows if key(r) != key(row)]
    rows.append(row)
    with open(path + '.tmp', 'w') as f:
      json.dump(rows, f, indent=1)
    os.replace(path + '.tmp', path)
  return rows


def fixed_batch(data_cfg: Any, batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
  """`batch` windows of seq_len + 1 tokens at random (seeded) offsets of the train split."""
  train, _ = data.load_splits(data_cfg)
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(train) - seq_len - 1, batch)
  return np.stack([np.asarray(train[s:s + seq_len + 1], np.int32) for s in starts])


def loglog_slope(xs: list[float], ys: list[float]) -> float:
  """Least-squares slope of log(y) against log(x) (NaN if any y <= 0)."""
  y = np.asarray(ys, np.float64)
  if np.any(~np.isfinite(y)) or np.any(y <= 0):
    return float('nan')
  return float(np.polyfit(np.log(np.asarray(xs, np.float64)), np.log(y), 1)[0])


def point_overrides(axis: str, x: int, s: Any) -> dict[str, Any]:
  """Config overrides for one point on the swept axis."""
  d = x if axis == 'width' else s.fixed_width
  out = {'model.d_model': d, 'model.mlp_dim': int(s.mlp_ratio * d)}
  if axis == 'repeats':   # one shared block applied R times (recursive / universal plan)
    out.update({'model.num_layers': x * s.loop_unique, 'model.sharing.scheme': 'cycle',
                'model.sharing.num_unique': s.loop_unique, 'model.sharing.repeats': 0})
  elif axis == 'depth':
    out.update({'model.num_layers': x, 'model.sharing.scheme': 'untied',
                'model.sharing.num_unique': 0, 'model.sharing.repeats': 0})
  elif axis in BEYOND_WIDTH:
    out[BEYOND_WIDTH[axis]] = x
  return out


# Transfer beyond width: the swept axis -> the train key it sets, at d_model = study.fixed_width.
# batch: sequences per step at a fixed number of steps (more tokens at a larger batch); steps:
# the training horizon (the schedule spans it); weight_decay: train.weight_decay, read under the
# variant's parametrization.wd_mode (lr_coupled or independent); warmup: train.warmup_steps.
BEYOND_WIDTH = {'batch': 'train.batch_size', 'steps': 'train.steps',
                'weight_decay': 'train.weight_decay', 'warmup': 'train.warmup_steps'}


def _fingerprint(inputs: Any) -> str:
  return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_cell(cells_dir: str | None, key: str, inputs: Any,
                compute: Callable[[], dict[str, Any]], log=print,
                also: tuple[Any, ...] = ()) -> dict[str, Any]:
  """A study cell's row, computed once: with `cells_dir`, the row is kept in
  CELLS_DIR/<key>.json with a fingerprint of `inputs` (everything the cell's result depends on,
  JSON-serialisable: its config, learning rates, seeds), and a rerun whose cell has the same
  fingerprint reads it back instead of training (an interrupted sweep resumes at its first
  missing cell). A kept cell whose fingerprint is that of one of `also` (the same cell's
  inputs as an earlier version wrote them) is read back too. A cell whose inputs changed is
  computed again and overwritten. Without `cells_dir` it is computed every time."""
  if cells_dir is None:
    return compute()
  fingerprint = _fingerprint(inputs)
  path = os.path.join(cells_dir, re.sub(r'[^\w.=-]+', '_', key) + '.json')
  if os.path.exists(path):
    with open(path) as f:
      kept = json.load(f)
    if kept.get('fingerprint') in {fingerprint, *map(_fingerprint, also)}:
      log(f'{key}: kept from {path}')
      if kept['fingerprint'] != fingerprint:   # rewritten under the current fingerprint
        _write_cell(path, fingerprint, kept['row'])
      return kept['row']
  row = compute()
  os.makedirs(cells_dir, exist_ok=True)
  _write_cell(path, fingerprint, row)
  return row


def _write_cell(path: str, fingerprint: str, row: dict[str, Any]) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump({'fingerprint': fingerprint, 'row': row}, f)
  os.replace(tmp, path)   # a cell file is whole or absent, never half written


def run_axes(config: Any, out_dir: str, name: str, run_axis: Callable[..., dict[str, Any]],
             plot: Callable[[dict[str, Any], str, str], None],
             annotate: Callable[[dict[str, Any]], None] | None = None,
             table: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Any]:
  """Runs a study over each of `config.study.axes`: result[axis] = run_axis(config, axis, log),
  `annotate(result[axis])` if given, a plot OUT/<name>_<axis>.png per axis, then OUT/<name>.json
  with the total runtime and the config (progress lines go to stderr), and OUT/<name>.md =
  `table(result)` if given (the same function regenerates it from the JSON:
  `python -m sharenet.studies.results_tables`)."""
  axes = parse_list(config.study.axes, str)
  valid = [k[:-len('_values')] for k in config.study if k.endswith('_values')]
  for axis in axes:
    if axis not in valid:
      raise ConfigError(f'study.axes: unknown axis {axis!r}; valid: {", ".join(valid)}')
  os.makedirs(out_dir, exist_ok=True)
  t0 = time.perf_counter()
  result: dict[str, Any] = {}
  for axis in axes:
    result[axis] = run_axis(config, axis, log=lambda m: print(m, file=sys.stderr, flush=True))
    if annotate is not None:
      annotate(result[axis])
    plot(result[axis], axis, os.path.join(out_dir, f'{name}_{axis}.png'))
  result['runtime_s'] = round(time.perf_counter() - t0, 1)
  result['config'] = json.loads(experiment.to_json(config))
  with open(os.path.join(out_dir, f'{name}.json'), 'w') as f:
    json.dump(result, f, indent=1)
  if table is not None:
    with open(os.path.join(out_dir, f'{name}.md'), 'w') as f:
      f.write(table(result))
  return result


def run_cli(main: Callable[[Any, str], Any], default_out: str,
            default_config: str | None = None) -> None:
  """`python -m sharenet.studies.X --config FILE [--config.k=v ...] --out DIR` for a study whose
  entry point is main(config, out_dir); an int it returns is the exit status."""
  from absl import flags

  config = cli.define_config_file('config', default_config, 'Study config file.')
  out = flags.DEFINE_string('out', default_out, 'Output directory.')

  def run(argv):
    del argv
    from absl import logging
    logging.set_verbosity(logging.WARNING)   # orbax's per-checkpoint INFO lines, as train.py
    status = main(config.value, out.value)
    return status if isinstance(status, int) else 0

  cli.run(run)


def mean_sd(xs: list[float], fmt: str = '.4f', sep: str = '±') -> str:
  """'mean SEP sd' of `xs` in format `fmt` (the mean alone for one value)."""
  m = statistics.mean(xs)
  return f'{m:{fmt}} {sep} {statistics.stdev(xs):{fmt}}' if len(xs) > 1 else f'{m:{fmt}}'


def trained(config: Any, workdir: str) -> dict[str, float]:
  """Trains `config` into `workdir` (to its end; `completed` checks it) and returns the final
  evaluation's eval loss and bits per byte."""
  res = completed(loop.train_and_evaluate(config, workdir), workdir)
  return {'eval_loss': res['eval_loss'], 'eval_bits_per_byte': res['eval_bits_per_byte']}


def evaluated(workdir: str, eval_tokens: int) -> dict[str, float]:
  """eval.py's eval loss and bits per byte of `workdir` on `eval_tokens` validation tokens (0:
  all)."""
  ev = eval_workdir.evaluate_workdir(workdir, overrides={'data.eval_tokens': int(eval_tokens)})
  return {'eval_loss': ev['eval_loss'], 'eval_bits_per_byte': ev['eval_bits_per_byte']}


def write_result(out: str, name: str, result: dict[str, Any],
                 table: Callable[[dict[str, Any]], str]) -> None:
  """OUT/<name>.json and OUT/<name>.md (= `table(result)`, which results_tables regenerates
  from the JSON); prints the table."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f'{name}.json'), 'w') as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out, f'{name}.md'), 'w') as f:
    f.write(table(result))
  print(table(result), flush=True)
