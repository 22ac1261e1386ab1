"""The single train loop: train_and_evaluate(config, workdir)."""
from __future__ import annotations

import functools
import math
import os
import signal
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sharenet import data
from sharenet.data import corpus
from sharenet.checkpoint import config_file, orbax_io
from sharenet.errors import NonFiniteLoss
from sharenet.models import accounting, logical_axes
from sharenet.optim import chain, ema, trainable
from sharenet.tasks import task_eval
from sharenet.train import (batch_ramp, dynamic_tying, evaluation, experiment, perf, profile,
                            resume, sampled_depth, sharding, teacher)
from sharenet.train.metrics import MetricsWriter, note, parse_loggers
from sharenet.train.trainer import (TrainState, abstract_state, effective_params, init_state,
                                    make_train_step, setup)


class _Compiled(NamedTuple):
  """The jitted train step and the shardings it was compiled for (`_compile_step`)."""
  abstract: Any          # the TrainState's shapes
  shardings: Any         # its shardings
  batch_sharding: Any
  batch_shape: tuple[int, ...]
  step_fn: Callable
  mesh: Any
  rules: Any
  sampled: bool          # a sampled-depth model: the step takes its depth (train/sampled_depth.py)
  teacher: Any           # train.teacher's Loaded (train/teacher.py), or None
  watch_fn: Callable | None = None   # train.watch: the step of the log steps (train/watch.py)


def _compile_step(run: experiment.Resolved, exp: Any,
                  tea: Any = None) -> tuple[_Compiled, Any, list[str]]:
  """The state's shapes and shardings on the run's mesh and the jitted step (with a teacher,
  its variables restored on that mesh, unless `tea` holds them already); -> (compiled, logical
  axes, sharding notes)."""
  model, tx, pz, tr = exp
  t = run.train
  abstract = abstract_state(model, tx, tr, pz)
  mesh, rules = sharding.make_mesh(run.mesh), sharding.rules_of(run.mesh)
  trainable.check(t.trainable, tr.infos, abstract.params)   # train.trainable trains something
  if tea is None:
    tea = teacher.load(run, mesh, rules)   # train.teacher: the step's last argument
  logical, notes = logical_axes(model), []
  if 'reparam' in abstract.params:   # transform gains carry no logical axes: replicated
    logical = {**logical, 'reparam': jax.tree.map(lambda _: P(), abstract.params['reparam'])}
  specs = sharding.param_specs(logical, abstract.params, mesh, rules, notes)
  shardings = sharding.state_shardings(abstract, specs, mesh)
  batch_sharding = sharding.batch_sharding(mesh, rules)
  sampled = sampled_depth.sampled(model.cfg)   # the depth: a third, replicated int32 argument
  jitted = lambda watch: jax.jit(
      make_train_step(exp, t.grad_accum, loops=sampled_depth.step_loops(t, model.cfg),
                      teacher=None if tea is None else tea.distill, trains=t.trainable,
                      watch=watch),
      in_shardings=(shardings, batch_sharding) + (NamedSharding(mesh, P()),) * sampled + (
          (tea.shardings,) if tea else ()),
      out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
  compiled = _Compiled(abstract, shardings, batch_sharding, (t.batch_size, t.seq_len + 1),
                       jitted(False), mesh, rules, sampled, tea,
                       jitted(True) if t.watch else None)
  return compiled, logical, notes


class _Built(NamedTuple):
  """One sharing plan's experiment, as the loop runs it (dynamic tying builds one per plan)."""
  run: experiment.Resolved
  exp: Any                           # trainer.Experiment: model, optimizer, parametrization...
  c: _Compiled
  logical: Any
  notes: list[str]
  shapes: dict[str, list[int]]       # the parameters' shapes (the checkpoint record's)
  target: Any                        # the restore target: the abstract state, with shardings


def _build(run: experiment.Resolved, tea: Any = None) -> _Built:
  exp = setup(run)
  c, logical, notes = _compile_step(run, exp, tea)
  return _Built(run, exp, c, logical, notes, resume.param_shapes(c.abstract.params),
                # a checkpoint from another mesh reshards onto this run's shardings
                sharding.with_shardings(c.abstract, c.shardings))


def _dry_run(run: experiment.Resolved, c: _Compiled, logical: Any,
             notes: list[str]) -> dict[str, Any]:
  """config.dry_run: compiles the step for the mesh and returns the sharding report."""
  with sharding.activate(c.mesh, c.rules):
    spec = jax.ShapeDtypeStruct(c.batch_shape, jnp.int32, sharding=c.batch_sharding)
    extra = {**({'segment_ids': spec} if run.data.segment_mask else {}),
             **({'loss_mask': spec} if data.has_loss_mask(run.data) else {})}
    if extra:
      spec = {'tokens': spec, **extra}
    depth = (jax.ShapeDtypeStruct((), jnp.int32),) * c.sampled
    tea = () if c.teacher is None else (c.teacher.variables,)   # its memory in the report
    compiled = c.step_fn.lower(sharding.with_shardings(c.abstract, c.shardings), spec,
                               *depth, *tea).compile()
  return sharding.report(c.abstract, c.shardings, logical, compiled, notes)


def _write_summary(run: experiment.Resolved, workdir: str, pz: Any, variables: Any,
                   shapes: Any) -> None:
  """config.json: the config and what the run built (unique / applied params, FLOPs, plan)."""
  mcfg = run.model
  summary = {
      **run.record, 'params_unique': accounting.params_unique(variables),
      'params_applied': accounting.params_applied(variables, mcfg),
      'flops_per_token': accounting.flops_per_token(mcfg, run.train.seq_len),
      'plan_index': list(mcfg.plan.index), 'param_shapes': shapes,
      'parametrization_table': pz.describe(),
  }
  if jax.process_index() == 0:
    config_file.write(workdir, summary)


def train_and_evaluate(config: Any, workdir: str) -> dict[str, float]:
  """Trains `config` in `workdir` (resuming if it holds a checkpoint); returns final metrics.

  With config.dry_run, prints the sharding report instead and returns its totals. Longer than
  the library's ~60 lines on purpose: the order of dispatch, reading a step's metrics,
  evaluation, the finite check, checkpointing and SIGTERM is the loop's contract, and it reads
  top to bottom here (setup lives in `_compile_step`, `_dry_run`, `_write_summary`).
  """
  # before anything touches a device
  sharding.maybe_initialize_distributed(bool(config.mesh.distributed))
  run = experiment.resolve(config)   # the one read of the ConfigDict: typed sections below
  mcfg, t = run.model, run.train
  schedule = chain.lr_schedule(t)
  rng = jax.random.key(t.seed)
  b = _build(run)   # the plan's experiment (with dynamic tying, the current plan's: `b` below)
  if run.dry_run:
    return _dry_run(run, b.c, b.logical, b.notes)
  for line in b.notes:
    note(f'note: {line}')
  # the same for every plan: the mesh and the batch
  mesh, rules, batch_sharding, batch_shape = b.c.mesh, b.c.rules, b.c.batch_sharding, \
      b.c.batch_shape

  os.makedirs(workdir, exist_ok=True)
  print(f'sharenet: writing to {os.path.abspath(workdir)}', flush=True)
  # This process reads the rows of the global batch its devices hold (all rows on one host).
  # train.batch_ramp: the iterator reads chunks of the ramp's first batch, a step takes as many
  # as its batch holds (sharenet/train/batch_ramp.py)
  ramp = batch_ramp.parse(t.batch_ramp, t.batch_size, t.steps)
  chunk = t.batch_size if ramp is None else ramp.chunk
  shard, num_shards = sharding.process_rows(batch_sharding, (chunk,) + batch_shape[1:])
  train_iter = data.make_train_iterator(run.data, t.seq_len, chunk, t.seed, shard, num_shards)
  mngr = orbax_io.manager(workdir, t.keep_checkpoints)
  # train.tying: the newest checkpoint's plan and controller (sharenet/train/dynamic_tying.py)
  tying = (dynamic_tying.Runtime(run, b, lambda r: _build(r, b.c.teacher), mngr)
           if dynamic_tying.enabled(t) else None)
  b = b if tying is None else tying.current
  # Sharded init: each device computes only its shards; no host holds the whole model.
  init_fn = jax.jit(functools.partial(init_state, b.exp.model, b.exp.tx, tr=b.exp.tr,
                                      pz=b.exp.pz), out_shardings=b.c.shardings)
  try:
    state, start = resume.restore_or_init(run, workdir, mngr, b.target, train_iter,
                                          lambda: init_fn(rng), b.exp.tx, b.shapes,
                                          None if tying is None else tying.target_at)
  except BaseException:
    mngr.close()
    raise
  if tying is not None:   # the restored checkpoint's plan and controller (an older one's, if
    b = tying.restored(start)   # the newest was unreadable)

  _write_summary(b.run, workdir, b.exp.pz, state.params, b.shapes)
  # executed FLOPs/token at a step's depth, with a teacher's forward
  flops_at = sampled_depth.FlopsCounter(t, mcfg, 0.0 if b.c.teacher is None else
                                        b.c.teacher.forward_flops)
  tea_vars = () if b.c.teacher is None else (b.c.teacher.variables,)
  # Saved with every checkpoint: a resume compares against the config that wrote the state
  # (and, with dynamic tying, builds the plan it holds).
  record = lambda: {**resume.config_dict(run.record), 'param_shapes': b.shapes,
                    **({} if tying is None else tying.record())}

  mfu_ref = perf.mfu_reference(mcfg.dtype)
  if mfu_ref.note:
    note(f'note: {mfu_ref.note}')
  writer = MetricsWriter(workdir, parse_loggers(t.loggers),
                         resume.config_dict(run.record), t.wandb)
  stop = {'sigterm': False}
  old_handler = signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))

  # train.eval_tasks: lm-evaluation-harness tasks at every eval (checked in experiment.resolve)
  tasks = (task_eval.TrainTasks(t, b.exp.model, corpus.for_data(run.data), checked=True)
           if t.eval_tasks else None)

  def run_eval(step: int) -> dict[str, float]:
    model, _, pz, tr = b.exp   # the current plan's
    with sharding.activate(mesh, rules):
      params = jax.jit(effective_params, static_argnums=(1, 2))(state, tr, pz)
      out = evaluation.evaluate(model, params, run.data, t.seq_len, t.eval_batch_size,
                              sampled_depth.eval_schedule(mcfg))
      if tasks is not None:
        tasks.model = model
        out.update(tasks.rows(params, sampled_depth.eval_schedule(mcfg)))
      if t.ema:   # train.ema: the weights' average too (sharenet/optim/ema.py)
        avg = state.replace(params=ema.averaged(state.opt_state, state.params))
        params = jax.jit(effective_params, static_argnums=(1, 2))(avg, tr, pz)
        out.update({f'ema/{k}': v for k, v in evaluation.evaluate(
            model, params, run.data, t.seq_len, t.eval_batch_size,
            sampled_depth.eval_schedule(mcfg)).items()})
    writer.write(step, **out)
    return out

  def retie(step: int) -> None:
    """train.tying: the controller's decision at `step` (its reward: the validation loss);
    a new plan takes the state over set by set and is written to config.json."""
    nonlocal state, b
    old = b
    with sharding.activate(mesh, rules):
      state, b, row = tying.decide(step, state, lambda built, s: evaluation.evaluate(
          built.exp.model, jax.jit(effective_params, static_argnums=(1, 2))(
              s, built.exp.tr, built.exp.pz),
          tying.reward_data, t.seq_len, t.eval_batch_size)['eval_loss'])
    writer.write(step, **row)
    if b is not old:
      _write_summary(b.run, workdir, b.exp.pz, state.params, b.shapes)

  bar = _progress(t, start)
  mix = data.mixture_of(run.data, t.seed)
  seen = None if mix is None else data.SeenRows(mix, t.batch_size)   # data_share/NAME
  last = {}
  rows_at = (lambda step: t.batch_size) if ramp is None else ramp.batch_at   # a step's batch
  window = {'t0': time.perf_counter(), 'tokens': 0, 'flops': 0.0}

  logs = lambda step: step % t.log_every == 0 or step == t.steps   # a log row's steps

  def settle(step: int, metrics: dict[str, Any], depth: int) -> None:
    """Reads step `step`'s metrics (the host waits for that step here, not at dispatch):
    raises NonFiniteLoss naming the step; writes the log row at log steps (MFU: the FLOPs
    the window's steps executed, at their depths)."""
    loss, gnorm = read_step_metrics(step, metrics, mngr.latest_step(), t.max_skips)
    done = time.perf_counter()   # step `step` has finished: the window ends here, not after
    tokens = rows_at(step) * t.seq_len   # the host's logging (the next step runs meanwhile)
    window['tokens'] += tokens
    window['flops'] += flops_at(depth) * tokens
    if logs(step):
      dt = done - window['t0']
      tps = window['tokens'] / dt
      row = dict(loss=loss, lr=float(schedule(step - 1)), grad_norm=gnorm, tokens_per_sec=tps,
                 **{mfu_ref.name: window['flops'] / dt / mfu_ref.flops},
                 **flops_at.row(depth),
                 **{k: float(v) for k, v in metrics.items()
                    if k.startswith(('routing_', 'exit_loss_', 'moe_', 'distill_', 'watch/',
                                     'skipped_steps', 'output_norm/'))},
                 **(seen.shares(step) if seen is not None else {}))
      writer.write(step, **row)
      last.clear()
      last.update(row)
      if bar is not None:
        bar.set_postfix(loss=f'{loss:.3f}', tok_s=f'{tps:,.0f}')
      window.update(t0=done, tokens=0, flops=0.0)

  # The host runs one step ahead: it dispatches step n+1, then reads step n's metrics, so the
  # device always has the next step queued. A step whose state is used (checkpoint, eval, the
  # last step, SIGTERM) is read before that use: a saved state is known finite.
  step, pending = start, None   # pending: (step, metrics, depth) dispatched but not read yet
  _status(bar, 'compiling the train step')   # the first dispatch traces and compiles it
  profiler = profile.StepProfiler(workdir, profile.parse_steps(t.profile.steps, t.steps))
  try:
    if tying is not None and tying.needs_start_loss:   # the first interval's starting loss
      _status(bar, 'measuring the tying reward')
      retie(step)
    while step < t.steps:
      depth = sampled_depth.sample_depth(mcfg, t.seed, step) if flops_at.depths else 0
      fn = b.c.watch_fn if b.c.watch_fn is not None and logs(step + 1) else b.c.step_fn
      rows = rows_at(step + 1)
      host_batch = batch_ramp.next_batch(train_iter, rows // chunk)
      with profiler.step(step + 1):
        state, metrics = dispatch(fn, state, host_batch, batch_sharding,
                                  (rows,) + batch_shape[1:], mesh, rules,
                                  *[depth] * b.c.sampled,
                                  teacher_vars=tea_vars)
      if step == start:
        _status(bar, 'train')
      step += 1
      profiler.finished(step, state)
      if pending is not None:
        settle(*pending)
      pending = (step, metrics, depth)
      evaluate = bool(t.eval_every) and step % t.eval_every == 0 and step != t.steps
      save = step % t.checkpoint_every == 0 or step == t.steps or stop['sigterm']
      decide = tying is not None and tying.decides_at(step)
      if evaluate or save or decide:
        settle(*pending)
        pending = None
      if bar is not None:
        bar.update(1)
      if decide:   # before the eval and the save: both are of the plan trained from here
        _status(bar, 'choosing the tying plan')
        retie(step)
        _status(bar, 'train')
        window['t0'] = time.perf_counter()
      if evaluate:
        _status(bar, 'evaluating')
        last.update(run_eval(step))
        _status(bar, 'train')
        window['t0'] = time.perf_counter()
      if save:
        _status(bar, 'saving a checkpoint')
        if not orbax_io.params_finite(state.params):
          raise NonFiniteLoss(f'non-finite parameters after step {step}; stopping without '
                              f'saving them (last checkpoint: {mngr.latest_step()})')
        orbax_io.save(mngr, step, state, train_iter, record())
        _status(bar, 'train')
      if stop['sigterm']:
        mngr.wait_until_finished()
        print(f'sharenet: SIGTERM at step {step}; checkpoint saved, exiting', flush=True)
        return last
    if start < t.steps or not last:
      _status(bar, 'final evaluation')
      last.update(run_eval(step))
    return last
  finally:
    profiler.stop()
    _status(bar, 'writing the last checkpoint')   # an async save finishing
    mngr.wait_until_finished()
    mngr.close()
    writer.close()
    if bar is not None:
      bar.close()
    signal.signal(signal.SIGTERM, old_handler)


def dispatch(step_fn: Callable, state: TrainState, host_batch: Any, batch_sharding: Any,
             batch_shape: tuple[int, ...], mesh: Any, rules: Any, *depth: int,
             teacher_vars: tuple[Any, ...] = ()) -> tuple[TrainState, dict[str, Any]]:
  """Uploads this process's rows of a batch (and a sampled-depth step's `depth`, the same host
  int on every process, as a replicated int32) and enqueues one train step; returns device
  arrays.

  Reads nothing from the device (host-to-device only), so it returns as soon as the step is
  queued; tests/train/test_loop_async.py runs the train loop with this function under a
  device-to-host transfer guard.
  """
  # Each process holds its rows of the global batch (see sharenet/data/pipeline.py); with
  # data.segment_mask the batch is a dict of tokens and segment ids, each of batch_shape.
  batch = jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(batch_sharding, x, batch_shape), host_batch)
  depth = tuple(jax.make_array_from_process_local_data(NamedSharding(mesh, P()),
                                                       np.asarray(d, np.int32), ()) for d in depth)
  with sharding.activate(mesh, rules):
    return step_fn(state, batch, *depth, *teacher_vars)   # a teacher's: already on the mesh


def read_step_metrics(step: int, metrics: dict[str, Any], last_checkpoint: int | None,
                      max_skips: int = 0) -> tuple[float, float]:
  """(loss, grad_norm) of step `step` as floats (a device-to-host read that waits for the step);
  NonFiniteLoss naming the step if either is not finite, unless the bad-step guard skipped it
  (sharenet/optim/guard.py), and when the guard has skipped `max_skips` steps in a row."""
  loss, gnorm = float(metrics['loss']), float(metrics['grad_norm'])
  if 'step_skipped' in metrics:
    in_a_row = int(metrics['skipped_in_a_row'])
    if in_a_row >= max_skips:
      raise NonFiniteLoss(f'train.max_skips={max_skips}: {in_a_row} steps in a row skipped up '
                          f'to step {step} (gradient norm {gnorm}: non-finite or a spike); '
                          f'stopping (last checkpoint: {last_checkpoint})')
    if bool(metrics['step_skipped']):
      return loss, gnorm
  if not (math.isfinite(loss) and math.isfinite(gnorm)):
    raise NonFiniteLoss(f'non-finite loss ({loss}) or gradient norm ({gnorm}) at step {step}; '
                        f'stopping without saving it (last checkpoint: {last_checkpoint})')
  return loss, gnorm


def _status(bar: Any, what: str) -> None:
  """The progress bar's label: what the run is doing (compiling, evaluating, saving...)."""
  if bar is not None:
    bar.set_description(what, refresh=True)


def _progress(t: Any, start: int):
  if not t.progress or jax.process_index() != 0:
    return None
  from tqdm import tqdm
  return tqdm(total=t.steps, initial=start, file=sys.stderr, dynamic_ncols=True,
              mininterval=1.0, desc='train')
