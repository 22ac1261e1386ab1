"""Downstream tasks by name through lm-evaluation-harness: resolved, checked, run, flattened.

Task names are the harness's (`hellaswag`, `piqa`, `arc_easy`, `lambada_openai`, `blimp`, ...;
docs/evaluation.md) plus the task definitions (the harness's YAML) found under `task_dir`, as the
harness's own `include_path` adds them. Indexing the harness's ~15,000 bundled definitions takes
seconds, so names that `task_dir` defines alone are resolved without it.

`run_tasks` returns {task: {metric: value}}: the harness's results per task with its filter
suffix dropped when it is the default one (`acc,none` -> `acc`; `exact_match,strict-match` ->
`exact_match_strict-match`) and without standard errors (bootstrap off). `metric_rows` flattens
them into metrics.jsonl keys `task/<task>/<metric>`.

A group (`blimp`, `mmlu`) runs its tasks and reports the group's aggregate where the harness
defines one. Checked before any model runs, one ConfigError line each: a name the harness does
not know (with the closest names it does) and a `num_fewshot` larger than the examples a task can
draw its shots from.
"""
from __future__ import annotations

import difflib
import functools
import logging
import os
from typing import Any, Sequence

from sharenet.errors import ConfigError
from sharenet.inference import test_time_depth
from sharenet.tasks.harness_lm import HarnessLM, check_model

ROW_PREFIX = 'task/'


def parse_tasks(text: str, what: str = '--tasks') -> list[str]:
  """'piqa,hellaswag' -> ['piqa', 'hellaswag']; one ConfigError line if it names none or one twice."""
  names = [t.strip() for t in str(text or '').split(',') if t.strip()]
  if not names or len(set(names)) != len(names):
    raise ConfigError(f'{what}={text!r}: valid: distinct comma-separated task names, e.g. '
                      f'{what}=piqa,hellaswag')
  return names


@functools.lru_cache(maxsize=4)
def _manager(task_dir: str | None, defaults: bool) -> Any:
  from lm_eval.tasks import TaskManager
  logging.getLogger('lm_eval').setLevel(logging.ERROR)
  return TaskManager(verbosity='ERROR', include_path=task_dir, include_defaults=defaults)


def task_manager(names: Sequence[str], task_dir: str | None) -> Any:
  """A harness TaskManager that knows every name (the bundled tasks only when needed); one
  ConfigError line for a name it does not know."""
  if task_dir is not None:
    if not os.path.isdir(task_dir):
      raise ConfigError(f'--task_dir={task_dir!r} is not a directory; valid: a directory of '
                        f'the harness\'s task YAML files')
    task_dir = os.path.abspath(task_dir)
    local = _manager(task_dir, False)
    if all(n in local.all_tasks for n in names):
      return local
  tm = _manager(task_dir, True)
  for name in names:
    if name not in tm.all_tasks:
      close = difflib.get_close_matches(name, tm.all_tasks, n=4)
      raise ConfigError(f'task {name!r} is unknown to lm-evaluation-harness'
                        f'{" and --task_dir" if task_dir else ""}; closest: '
                        f'{", ".join(close) or "none"} (lm-eval ls tasks lists all)')
  return tm


def load_tasks(names: Sequence[str], task_dir: str | None, num_fewshot: int | None,
               seed: int = 0) -> dict[str, Any]:
  """The harness's loaded tasks ({'tasks': ..., 'groups': ...}) for `names` (a group brings
  its tasks), set up as the harness's simple_evaluate sets them: `num_fewshot` shots unless a
  task fixes 0 (None: each task's own, else 0), shots drawn with `seed`; checked (module doc)."""
  tm = task_manager(names, task_dir)
  loaded = tm.load(list(names))
  for task in loaded['tasks'].values():
    if num_fewshot is not None and task.get_config('num_fewshot') != 0:
      task.set_config(key='num_fewshot', value=num_fewshot)
    elif task.get_config('num_fewshot') is None:
      task.set_config(key='num_fewshot', value=0)
    _check_shots(task, task.get_config('num_fewshot') or 0)
    task.set_fewshot_seed(seed=seed)
  return loaded


def _check_shots(task: Any, k: int) -> None:
  if not k:
    return
  split = task.config.fewshot_split
  if split:
    have, where = len(task.dataset[split]), f'its {split!r} split'
  elif task.has_training_docs():
    have, where = len(task.training_docs()), 'its training split'
  elif task.has_validation_docs():
    have, where = len(task.validation_docs()), 'its validation split'
  else:
    have, where = len(task.test_docs()) - 1, 'its test split, less the item answered'
  if k > have:
    raise ConfigError(f'--num_fewshot={k} exceeds the {have} examples task '
                      f'{task.config.task!r} draws its shots from ({where}); valid: 0 .. {have}')


def _metric_name(key: str) -> str | None:
  metric, _, filt = key.partition(',')
  if metric in ('alias', 'samples', 'sample_len') or metric.endswith('_stderr'):
    return None
  return metric if filt in ('', 'none') else f'{metric}_{filt}'


def run_tasks(lm: Any, names: Sequence[str], task_dir: str | None = None,
              num_fewshot: int | None = None, limit: int | None = None,
              seed: int = 0) -> dict[str, dict[str, float]]:
  """Every task (or group) of `names` on the harness model `lm`; {name: {metric: value}}
  (module doc). `limit`: the first `limit` items of each task (None: all)."""
  from lm_eval.evaluator import evaluate
  loaded = load_tasks(names, task_dir, num_fewshot, seed)
  results = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0,
                     log_samples=False, verbosity='ERROR')
  out = {}
  for name in names:
    row = results.get('groups', {}).get(name) or results['results'].get(name, {})
    out[name] = {m: float(v) for k, v in row.items()
                 if (m := _metric_name(k)) is not None and isinstance(v, (int, float))
                 and not isinstance(v, bool)}
  return out


@functools.lru_cache(maxsize=1)
def _harness_class() -> type:
  from lm_eval.api.model import LM

  class SharenetLM(HarnessLM, LM):   # HarnessLM's methods fill LM's abstract ones
    def __init__(self, *args: Any, **kwargs: Any):
      LM.__init__(self)
      HarnessLM.__init__(self, *args, **kwargs)

  return SharenetLM


def as_harness_model(*args: Any, **kwargs: Any) -> Any:
  """HarnessLM(*args, **kwargs) as the harness's `lm_eval.api.model.LM`."""
  return _harness_class()(*args, **kwargs)


def metric_rows(results: dict[str, dict[str, float]]) -> dict[str, float]:
  """{'task/<task>/<metric>': value} for metrics.jsonl and TensorBoard."""
  return {f'{ROW_PREFIX}{task}/{m}': v for task, ms in results.items() for m, v in ms.items()}


HEADLINE = ('acc_norm', 'acc', 'exact_match', 'bits_per_byte', 'word_perplexity')


def headline(metrics: dict[str, float]) -> str | None:
  """The metric a task is plotted by: the first of HEADLINE it reports."""
  return next((m for m in HEADLINE if m in metrics), None)


def plot_depths(rows: Sequence[dict[str, Any]], trained: int, path: str) -> None:
  """Each task's headline metric against test-time depth (png), the trained depth marked."""
  curves = {}
  for task in dict.fromkeys(r['task'] for r in rows):
    mine = [r for r in rows if r['task'] == task]
    metric = headline(mine[0])
    if metric is not None:
      curves[f'{task} {metric}'] = ([r['depth'] for r in mine], [r[metric] for r in mine])
  test_time_depth.plot_against_depth(curves, trained, path, 'task metric')


class TrainTasks:
  """train.eval_tasks of a run: checked up front (`__init__`: names, shots, the tokenizer, the
  model; `checked`: the names and shots were, by experiment.resolve), then run at each eval on
  the current parameters (`rows`)."""

  def __init__(self, t: Any, model: Any, tok: Any, checked: bool = False):
    self.names = parse_tasks(t.eval_tasks, 'train.eval_tasks')
    self.task_dir = t.eval_task_dir or None
    self.num_fewshot = None if t.eval_num_fewshot < 0 else t.eval_num_fewshot
    self.limit = t.eval_task_limit or None
    if t.eval_task_limit < 0:
      raise ConfigError(f'train.eval_task_limit={t.eval_task_limit}; valid: 0 (all) or >= 1')
    if tok is None:
      raise ConfigError('train.eval_tasks needs text: the data names no tokenizer '
                        '(data.source=bin); valid: data.tokenizer=hf:PATH or sentencepiece:PATH')
    check_model(model.cfg)
    if not checked:   # the names and shots (loading the tasks' data)
      load_tasks(self.names, self.task_dir, self.num_fewshot)
    self.model, self.tok, self.max_length = model, tok, t.seq_len

  def rows(self, variables: Any, schedule: Any) -> dict[str, float]:
    lm = as_harness_model(self.model, variables, self.tok, max_length=self.max_length,
                          schedule=schedule)
    return metric_rows(run_tasks(lm, self.names, self.task_dir, self.num_fewshot, self.limit))
