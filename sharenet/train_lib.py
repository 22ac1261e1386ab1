"""The single train loop: train_and_evaluate(config, workdir)."""
from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.traverse_util import flatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharenet import checkpoint, config_lib, data, eval_lib, optim, parametrization, perf
from sharenet.errors import ConfigError
from sharenet.metrics import MetricsWriter
from sharenet.models import DecoderLM, ModelConfig, accounting, init_variables


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any        # the trainable collections: {'params': ..., 'per_layer': ...}
  opt_state: Any


class NonFiniteLoss(RuntimeError):
  pass


def make_mesh() -> Mesh:
  return Mesh(np.asarray(jax.devices()), ('data',))


def init_state(model: DecoderLM, tx: optax.GradientTransformation, rng: jax.Array,
               pz: parametrization.Parametrization | None = None) -> TrainState:
  """Fresh state; `pz` rescales the SP init to its preset's init std."""
  params = init_variables(model, rng)
  if pz is not None:
    params = pz.init(params)
  return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


def setup(config: Any, mcfg: ModelConfig):
  """(model, optimizer, parametrization) for a validated config."""
  pz = parametrization.build(config.parametrization, mcfg)
  return DecoderLM(pz.cfg), optim.make_optimizer(config.train, pz.opt_multipliers()), pz


def train_step(state: TrainState, batch_BT1: jax.Array, *, model: DecoderLM,
               tx: optax.GradientTransformation, grad_accum: int, forward=None):
  """One optimizer step; with grad_accum > 1 the batch is split into scanned micro-batches.

  `forward` maps raw to effective params (a parametrization's forward multipliers).
  """
  fwd = forward or (lambda p: p)
  loss_fn = lambda p, b: jnp.mean(eval_lib.token_nll(model, fwd(p), b))
  grad_fn = jax.value_and_grad(loss_fn)
  if grad_accum == 1:
    loss, grads = grad_fn(state.params, batch_BT1)
  else:
    micro = batch_BT1.reshape((grad_accum, -1) + batch_BT1.shape[1:])

    def body(acc, b):
      l, g = grad_fn(state.params, b)
      return jax.tree.map(jnp.add, acc, (l, g)), None

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
    (loss, grads), _ = jax.lax.scan(body, zeros, micro)
    loss, grads = jax.tree.map(lambda x: x / grad_accum, (loss, grads))
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {'loss': loss, 'grad_norm': optax.global_norm(grads)}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def param_shapes(tree: Any) -> dict[str, list[int]]:
  return {'/'.join(k): list(v.shape) for k, v in flatten_dict(tree).items()}


def check_workdir(workdir: str, config: Any, shapes: dict[str, list[int]]) -> None:
  """A workdir holding another model's run fails with one line, not a shape traceback."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return
  with open(path) as f:
    old = json.load(f)
  old_shapes = old.get('param_shapes', {})
  if old_shapes and old_shapes != shapes:
    diff = [f'model.{k}: {old["model"].get(k)} -> {v}' for k, v in config.model.to_dict().items()
            if old.get('model', {}).get(k) != v]
    first = next((k for k in sorted(set(old_shapes) | set(shapes))
                  if old_shapes.get(k) != shapes.get(k)), '?')
    raise ConfigError(
        f'--workdir {workdir} holds a run of a different model ({"; ".join(diff) or "shapes"}; '
        f'first differing param {first}: {old_shapes.get(first)} vs {shapes.get(first)}); '
        f'use a new --workdir or the old config')


def _check_finite_state(state: TrainState) -> None:
  if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.params)):
    raise ValueError('non-finite parameters')


def train_and_evaluate(config: Any, workdir: str) -> dict[str, float]:
  """Trains `config` in `workdir` (resuming if it holds a checkpoint); returns final metrics."""
  mcfg: ModelConfig = config_lib.validate(config)
  t = config.train
  os.makedirs(workdir, exist_ok=True)
  print(f'sharenet: writing to {os.path.abspath(workdir)}', flush=True)

  model, tx, pz = setup(config, mcfg)
  forward = pz.forward if pz.has_forward else None
  schedule = optim.lr_schedule(t)
  rng = jax.random.key(t.seed)
  abstract = jax.eval_shape(functools.partial(init_state, model, tx, pz=pz), rng)
  shapes = param_shapes(abstract.params)
  check_workdir(workdir, config, shapes)

  mesh = make_mesh()
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P('data'))
  train_iter = data.make_train_iterator(config.data, t.seq_len, t.batch_size, t.seed,
                                        jax.process_index(), jax.process_count())
  mngr = checkpoint.manager(workdir, t.keep_checkpoints)
  restored = checkpoint.restore_latest(mngr, abstract, train_iter, _check_finite_state)
  if restored is None:
    state = jax.jit(functools.partial(init_state, model, tx, pz=pz),
                    out_shardings=replicated)(rng)
    start = 0
  else:
    state, start = restored
    print(f'sharenet: resumed from checkpoint at step {start}', flush=True)

  variables = state.params
  flops_tok = accounting.flops_per_token(mcfg, t.seq_len)
  summary = {
      **config.to_dict(), 'params_unique': accounting.params_unique(variables),
      'params_applied': accounting.params_applied(variables, mcfg),
      'flops_per_token': flops_tok, 'plan_index': list(mcfg.plan.index),
      'param_shapes': shapes, 'parametrization_table': pz.describe(),
  }
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      json.dump(summary, f, indent=2, sort_keys=True, default=str)

  step_fn = jax.jit(functools.partial(train_step, model=model, tx=tx, grad_accum=t.grad_accum,
                                      forward=forward), donate_argnums=0)
  peak = perf.matmul_peak_flops()
  writer = MetricsWriter(workdir)
  stop = {'sigterm': False}
  old_handler = signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))

  def run_eval(step: int) -> dict[str, float]:
    out = eval_lib.evaluate(model, pz.forward(state.params), config.data, t.seq_len,
                            t.eval_batch_size)
    writer.write(step, **out)
    return out

  bar = _progress(t, start)
  last = {}
  tokens_per_step = t.batch_size * t.seq_len
  window_t0, window_steps = time.perf_counter(), 0
  step = start
  try:
    while step < t.steps:
      # Each process holds its rows of the global batch (see sharenet/data/pipeline.py).
      batch = jax.make_array_from_process_local_data(batch_sharding, next(train_iter))
      state, metrics = step_fn(state, batch)
      step += 1
      loss, gnorm = float(metrics['loss']), float(metrics['grad_norm'])
      if not (math.isfinite(loss) and math.isfinite(gnorm)):
        raise NonFiniteLoss(f'non-finite loss ({loss}) or gradient norm ({gnorm}) at step {step}; '
                            f'stopping without saving it (last checkpoint: '
                            f'{mngr.latest_step()})')
      window_steps += 1
      if step % t.log_every == 0 or step == t.steps:
        dt = time.perf_counter() - window_t0
        tps = window_steps * tokens_per_step / dt
        last = dict(loss=loss, lr=float(schedule(step - 1)), grad_norm=gnorm, tokens_per_sec=tps,
                    mfu=tps * flops_tok / peak)
        writer.write(step, **last)
        if bar is not None:
          bar.set_postfix(loss=f'{loss:.3f}', tok_s=f'{tps:,.0f}')
        window_t0, window_steps = time.perf_counter(), 0
      if bar is not None:
        bar.update(1)
      if t.eval_every and step % t.eval_every == 0 and step != t.steps:
        last.update(run_eval(step))
        window_t0 = time.perf_counter()
      if step % t.checkpoint_every == 0 or step == t.steps or stop['sigterm']:
        checkpoint.save(mngr, step, state, train_iter)
      if stop['sigterm']:
        mngr.wait_until_finished()
        print(f'sharenet: SIGTERM at step {step}; checkpoint saved, exiting', flush=True)
        return last
    if start < t.steps or not last:
      last.update(run_eval(step))
    return last
  finally:
    mngr.wait_until_finished()
    mngr.close()
    writer.close()
    if bar is not None:
      bar.close()
    signal.signal(signal.SIGTERM, old_handler)


def _progress(t: Any, start: int):
  if not t.progress or jax.process_index() != 0:
    return None
  from tqdm import tqdm
  return tqdm(total=t.steps, initial=start, file=sys.stderr, dynamic_ncols=True,
              mininterval=1.0, desc='train')
