"""One training step: the state, the loss, the jitted update (train/loop.py runs the loop).

`setup` builds what a step needs from the config's typed sections (model, optimizer,
parametrization, transforms); `make_train_step` returns the step that train/loop.py jits with
its shardings, that the compatibility tests evaluate abstractly, and that studies call directly.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple, Sequence

import flax
import jax
import jax.numpy as jnp
import optax

from sharenet.models import (DecoderLM, ModelConfig, abstract_variables, curvature,
                             init_variables, lm, moe, norm_stats, routing, streams, unit_scale)
from sharenet.models.layers import INTERMEDIATES, watching
from sharenet.models.norm_stats import NORM_STATS
from sharenet.optim import chain, guard, kfac, trainable
from sharenet.parametrization import rules
from sharenet.train import distill, evaluation, experiment, output_norm, sampled_depth
from sharenet.train import watch as watch_lib
from sharenet.transforms import Transforms


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any        # trainable: {'params': ..., 'per_layer': ..., ['reparam': gains]}
  opt_state: Any
  tstate: Any        # non-trainable transform state (power-iteration vectors); {} if none


def init_state(model: DecoderLM, tx: optax.GradientTransformation, rng: jax.Array,
               tr: Transforms | None = None,
               pz: rules.Parametrization | None = None) -> TrainState:
  """Fresh state: SP init, rescaled to `pz`'s preset, then `tr`'s gains and projections.

  One compiled program: run op by op, the init's few hundred small ops (power iterations,
  rescalings) would each be compiled on first use (~20 s on a 2-core CPU for a tiny model
  with sigma-reparam). Inside a caller's jit or eval_shape it is inlined.
  """
  return jax.jit(functools.partial(_fresh_state, model, tx, tr=tr, pz=pz))(rng)


def abstract_state(model: DecoderLM, tx: optax.GradientTransformation,
                   tr: Transforms | None = None,
                   pz: rules.Parametrization | None = None) -> TrainState:
  """init_state's shapes and dtypes (as `jax.eval_shape(init_state, ...)`): the model's init
  is read from its role table (`models.param_table`, cached per config), so only the preset,
  the transforms and the optimizer are traced here."""
  return jax.eval_shape(functools.partial(_finish_state, model, tx, tr=tr, pz=pz),
                        abstract_variables(model))


def _fresh_state(model: DecoderLM, tx: optax.GradientTransformation, rng: jax.Array,
                 tr: Transforms | None = None,
                 pz: rules.Parametrization | None = None) -> TrainState:
  return _finish_state(model, tx, init_variables(model, rng), tr=tr, pz=pz)


def _finish_state(model: DecoderLM, tx: optax.GradientTransformation, params: Any,
                  tr: Transforms | None = None,
                  pz: rules.Parametrization | None = None) -> TrainState:
  """The state from the model's SP init `params`: `pz`'s rescaling, `tr`'s gains and
  projections, the optimizer's state."""
  tstate = {}
  if pz is not None:
    params = pz.init(params)
  if tr is not None:
    params, tstate = tr.init(params)
  tstate = {**tstate, **lm.initial_state(model.cfg)}   # balancing bias, norm statistics
  return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), tstate)


def effective(params: Any, tstate: Any, tr: Transforms | None = None,
              pz: rules.Parametrization | None = None) -> Any:
  """Stored params -> the variables the model applies: `tr`'s reparameterizations (with their
  state `tstate`), then `pz`'s forward multipliers; plus loss-free balancing's non-trainable
  bias from `tstate` (routing.BALANCE), read but never trained, and a statistics norm's
  running statistics (norm_stats.NORM_STATS)."""
  params = params if tr is None else tr.effective(params, tstate)
  params = params if pz is None or not pz.has_forward else pz.forward(params)
  if tstate and routing.BALANCE in tstate:
    params = {**params, routing.BALANCE: tstate[routing.BALANCE]}
  if tstate and NORM_STATS in tstate:   # a statistics norm's running statistics
    params = {**params, NORM_STATS: tstate[NORM_STATS]}
  if tstate and TAPS in tstate:   # train.optimizer=kfac's taps (models/curvature.py)
    params = curvature.insert(params, tstate[TAPS])
  return params


def effective_params(state: TrainState, tr: Transforms | None = None,
                     pz: rules.Parametrization | None = None) -> Any:
  """The variables the model applies for `state` (see `effective`)."""
  return effective(state.params, state.tstate, tr, pz)


class Experiment(NamedTuple):
  """What a validated config builds: the model, its optimizer, parametrization and transforms."""
  model: DecoderLM
  tx: optax.GradientTransformation
  pz: rules.Parametrization
  tr: Transforms


# tstate's key of the zero-valued K-FAC taps inside the differentiated loss (never stored)
TAPS = 'kfac_taps'


def setup(run: Any, mcfg: ModelConfig | None = None) -> Experiment:
  """The model, optimizer, parametrization and transforms of a validated config.

  `run` is the config's typed sections (train/experiment.py `resolve` or `sections`); a config
  itself is read into them here (with `mcfg`, its ModelConfig, if built). The model is
  DecoderLM(run.model), the one every other reader of the config builds, with its
  parametrization's model-level scalars.
  """
  if not isinstance(run, experiment.Resolved):
    run = experiment.sections(run, mcfg)
  pz = rules.Parametrization(run.model, run.train)
  model = DecoderLM(run.model)
  tr = Transforms(run.transforms, model)
  return Experiment(model, chain.make_optimizer(run.train, tr, pz.opt_multipliers()), pz, tr)


def loss_fn(params: Any, tstate: Any, batch_BT1: jax.Array, depth: Any = None, *,
            model: DecoderLM, tr: Transforms | None = None,
            pz: rules.Parametrization | None = None, mutable: Sequence[str] = (),
            loops: sampled_depth.StepLoops | None = None, step: Any = 0,
            micro: Any = None, teacher: distill.Distill | None = None,
            teacher_vars: Any = None) -> tuple[jax.Array, Any]:
  """Mean next-token NLL under the `effective` params, and the sown `mutable` collections.

  Under u-muP (`pz.loss_grad_scale` != 1) the value is the same mean, but its backward is u-muP's
  cross entropy (unit_scaling.functional.cross_entropy: sum reduction, mean as a forward-only
  scale, logits gradient x vocab / sqrt(vocab - 1)): per-token logit gradients are unit scale, so
  every gradient is N vocab / sqrt(vocab - 1) times the mean loss's (N tokens in the batch;
  Adam is invariant to that factor except through eps and train.grad_clip).

  A routed model (model.routing, Mixture-of-Recursions) adds its weighted auxiliary losses to
  the value (eval_loss never has them) and reports them and the realised capacities as
  `routing_*` entries of the returned collections (models/routing.py aux_loss); a model with
  experts (model.moe) adds their summed weighted aux loss, reported as `moe_aux_loss`.

  A recurrent-depth model (model.recurrence) or trained exits (`loops`, train.exit_loss) run
  sharenet/train/sampled_depth.py's loss at this step's `depth` (None: the fixed depth) and `step`
  (and `micro`, the micro-batch under train.grad_accum > 1: its own initial-state noise).

  With a statistics norm (NORM_STATS in `tstate`) the forward is in its training mode
  (sharenet/models/norm_stats.py); train_step reads the statistics from the cotangents.

  With a `teacher` (train.teacher; its applied variables `teacher_vars`, frozen) the value is
  sharenet/train/distill.py's mix of CE and the KD loss, reported as `distill_ce` and
  `distill_kd`.
  """
  if NORM_STATS in (tstate or {}):   # a statistics norm normalises in training mode
    loss, aux = _loss(params, tstate, batch_BT1, depth, model=model, tr=tr, pz=pz,
                      mutable=tuple(mutable) + (NORM_STATS,), loops=loops, step=step,
                      micro=micro, teacher=teacher, teacher_vars=teacher_vars)
    return loss, {k: v for k, v in aux.items() if k != NORM_STATS}
  return _loss(params, tstate, batch_BT1, depth, model=model, tr=tr, pz=pz, mutable=mutable,
               loops=loops, step=step, micro=micro, teacher=teacher, teacher_vars=teacher_vars)


def _loss(params: Any, tstate: Any, batch_BT1: jax.Array, depth: Any = None, *,
          model: DecoderLM, tr: Transforms | None, pz: rules.Parametrization | None,
          mutable: Sequence[str], loops: sampled_depth.StepLoops | None,
          step: Any, micro: Any = None, teacher: distill.Distill | None = None,
          teacher_vars: Any = None) -> tuple[jax.Array, Any]:
  """loss_fn's value and collections (`mutable` as given)."""
  experts = model.cfg.moe.aux
  if experts:  # model.moe: the experts' entropy / balancing losses join the training loss
    mutable = tuple(mutable) + (moe.MOE,)   # (models/moe.py; never eval_loss)
  if model.cfg.recurrent_segment is not None or (loops is not None and loops.exits):
    loss, aux = sampled_depth.loss(model, effective(params, tstate, tr, pz), batch_BT1, depth,
                                loops or sampled_depth.StepLoops(), step, tuple(mutable), micro)
    return _with_moe_loss(loss, aux) if experts else (loss, aux)
  s = 1.0 if pz is None else pz.loss_grad_scale
  routed = model.cfg.routing.kind != 'none'
  if routed:   # Mixture-of-Recursions: its aux losses join the training loss (not eval_loss)
    mutable = tuple(mutable) + (routing.ROUTING,)
  if teacher is not None:   # train.teacher: CE mixed with KD (sharenet/train/distill.py)
    base, nll_BT, aux = _distill_loss(model, effective(params, tstate, tr, pz), batch_BT1,
                                      mutable, teacher, teacher_vars)
  else:
    nll_BT, aux = evaluation.token_nll(model, effective(params, tstate, tr, pz), batch_BT1,
                                       mutable, logits_grad_scale=s)
    base = evaluation.mean_nll(nll_BT, batch_BT1)   # over the loss mask's targets, if any
  if routed:
    aux = dict(aux)
    router_loss, router_metrics = routing.aux_loss(model.cfg, aux.pop(routing.ROUTING))
    aux.update(router_metrics)
    return base + router_loss, aux
  if experts:
    return _with_moe_loss(base, aux)
  if s == 1.0:
    return base, aux
  w_BT = evaluation.target_weights(batch_BT1)   # u-muP: a sum, scaled forward to the mean
  if w_BT is None:
    return unit_scale.scale_fwd(jnp.sum(nll_BT), 1.0 / nll_BT.size), aux
  return unit_scale.scale_fwd(jnp.sum(nll_BT * w_BT), 1.0 / jnp.maximum(jnp.sum(w_BT), 1.0)), aux


def _distill_loss(model: DecoderLM, params: Any, batch_BT1: Any, mutable: Sequence[str],
                  teacher: distill.Distill, teacher_vars: Any
                  ) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
  """(loss, per-token NLL, collections and distill_* metrics) of a student against its frozen
  teacher: distill.mix of CE and KD, plus the matched streams' loss under train.teacher.match
  (both models' streams read through their untied views, sharenet/models/streams.py)."""
  w_BT = evaluation.target_weights(batch_BT1)
  if teacher.match:
    tokens_BT1, segment_ids_BT1 = evaluation.split_batch(batch_BT1)
    inputs = (tokens_BT1[:, :-1], None if segment_ids_BT1 is None else segment_ids_BT1[:, :-1])
    logits_BTV, h_LBTD, aux = streams.apply(model, params, *inputs, mutable=mutable)
    teacher_BTV, th_LBTD, _ = streams.apply(teacher.model, teacher_vars, *inputs)
  else:
    logits_BTV, aux = evaluation.token_logits(model, params, batch_BT1, mutable)
    teacher_BTV, _ = evaluation.token_logits(teacher.model, teacher_vars, batch_BT1)
  nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV,
                                                           evaluation.targets(batch_BT1))
  loss, metrics = distill.mix(nll_BT, distill.kd_per_token(logits_BTV, teacher_BTV,
                                                           teacher.temperature),
                              teacher.weight, w_BT)
  if teacher.match:
    hidden = distill.token_mean(distill.hidden_per_token(h_LBTD, th_LBTD, teacher.match,
                                                         teacher.match_norm), w_BT)
    loss = loss + teacher.match_weight * hidden
    metrics['distill_hidden'] = hidden
  return loss, nll_BT, {**aux, **metrics}


def _with_moe_loss(loss: jax.Array, aux: Any) -> tuple[jax.Array, Any]:
  """The loss plus the experts' summed weighted aux loss (sown by models/lm.py), which the
  returned collections report as `moe_aux_loss`."""
  aux = dict(aux)
  moe_loss = aux.pop(moe.MOE)['aux_loss'][0]
  aux['moe_aux_loss'] = moe_loss
  return loss + moe_loss, aux


def train_step(state: TrainState, batch_BT1: jax.Array, depth: Any = None,
               teacher_vars: Any = None, *, model: DecoderLM,
               tx: optax.GradientTransformation, grad_accum: int = 1, tr: Transforms | None = None,
               pz: rules.Parametrization | None = None, mutable: Sequence[str] = (),
               loops: sampled_depth.StepLoops | None = None,
               teacher: distill.Distill | None = None,
               trains: str = 'all', watch: bool = False) -> tuple[TrainState, dict[str, Any]]:
  """One optimizer step on `loss_fn`; with grad_accum > 1 the batch is split into scanned
  micro-batches.

  The loss sees `effective` params: `tr`'s reparameterizations (gradients flow through them;
  their state, power iterations, advances once per step before the loss, outside the
  differentiated function), then `pz`'s forward multipliers. The learning rate is the
  optimizer's (chain.make_optimizer: its peak LR is in `state.opt_state`). Metrics: loss,
  grad_norm, the output layer's operator norms after the update (train/output_norm.py) and the
  `mutable` collections sown in the forward pass before the update (averaged
  over micro-batches). With loss-free routing balancing, the routing bias in `tstate` then moves
  by the step's exit fractions (models/routing.py update_balance). `depth`: a sampled-depth
  model's loops this step (a traced int32; sharenet/train/sampled_depth.py), `loops` its exits and
  seed. `teacher` / `teacher_vars`: distillation from a frozen teacher (`loss_fn`). `trains`
  (train.trainable): the frozen leaves enter the loss behind a stop_gradient, so no backward
  work feeds them (sharenet/optim/trainable.py; the optimizer leaves them unchanged).
  A statistics norm's state (norm_stats.NORM_STATS in `tstate`) is differentiated with the
  params; its cotangents give the next statistics (sharenet/models/norm_stats.py). `watch`
  (train.watch's log steps; `mutable` then holds the sown collection, traced inside
  layers.watching()): the metrics add sharenet/train/watch.py's rows. When the optimizer is
  K-FAC (its state holds a kfac.KfacState: train.optimizer=kfac), zero-valued taps beside the
  hidden kernels are differentiated with the params and their cotangents, the step's Kronecker
  statistics (models/curvature.py), reach its update (optim/kfac.py `statistics`).
  """
  tstate = state.tstate if tr is None else tr.update_state(state.params, state.tstate)
  loss_of = functools.partial(loss_fn, depth=depth, model=model, tr=tr, pz=pz, mutable=mutable,
                              loops=loops, step=state.step, teacher=teacher,
                              teacher_vars=teacher_vars)
  if trains != 'all':
    table = tr.infos if tr is not None else lm.param_table(model.cfg)
    unfrozen = loss_of
    loss_of = lambda p, *a, **k: unfrozen(trainable.freeze(trains, table, p), *a, **k)
  kfac_taps = kfac.in_state(state.opt_state)   # train.optimizer=kfac
  statistics = contextlib.nullcontext()   # K-FAC's, below (beside a statistics norm, refused
  # by config/compat.py, its update finds none and says so in one line)
  if NORM_STATS in tstate:   # a statistics norm (grad_accum 1: config/compat.py): its
    # statistics leave as cotangents
    with_stats = lambda p, s, b: loss_of(p, {**tstate, NORM_STATS: s}, b)
    (loss, aux), (grads, cot) = jax.value_and_grad(with_stats, argnums=(0, 1), has_aux=True)(
        state.params, tstate[NORM_STATS], batch_BT1)
    tstate = {**tstate, NORM_STATS: norm_stats.update(tstate[NORM_STATS], cot, model.cfg.norm)}
  else:
    fn, primal = loss_of, state.params
    if kfac_taps:   # the step's Kronecker statistics leave as the taps' cotangents
      table = tr.infos if tr is not None else lm.param_table(model.cfg)
      fn = lambda pt, ts, b, **k: loss_of(pt[0], {**ts, TAPS: pt[1]}, b, **k)
      primal = (state.params, curvature.zeros(table))
    (loss, aux), grads, micro = _accumulated(fn, primal, tstate, batch_BT1, grad_accum)
    if kfac_taps:
      grads, cot = grads
      statistics = kfac.statistics(curvature.statistics(cot, table))
  with statistics:
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {'loss': loss, 'grad_norm': optax.global_norm(grads), **aux,
             **guard.metrics(opt_state)}   # train.skip_nonfinite / spike_factor
  # the output layer's operator norms after the update (norm transfer, train/output_norm.py)
  w = output_norm.readout(model.cfg, lm.param_table(model.cfg), effective(params, tstate, tr, pz))
  if w is not None:
    metrics.update(output_norm.norms(w))
  if watch:
    metrics = {**watch_lib.pop_intermediates(metrics, model.cfg.num_layers,
                                             model.cfg.routing.kind != 'none'),
               **watch_lib.stats(lm.param_table(model.cfg), state.params, params, grads)}
    if watch_lib.reads_uses(model.cfg, loops is not None and bool(loops.exits)):
      first = batch_BT1 if grad_accum == 1 else jax.tree.map(lambda x: x[0], micro)
      untied_loss = lambda m, u: _loss(u, {}, first, model=m, tr=None, pz=None, mutable=(),
                                       loops=None, step=state.step, teacher=teacher,
                                       teacher_vars=teacher_vars)[0]
      metrics.update(watch_lib.uses(model.cfg, effective(state.params, tstate, tr, pz),
                                    untied_loss))
  if routing.BALANCE in tstate:   # loss-free balancing: after the update, from this step's exits
    balance = routing.update_balance(model.cfg, tstate[routing.BALANCE], metrics)
    tstate = {**tstate, routing.BALANCE: balance}
  new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, tstate=tstate)
  return new, metrics


def _accumulated(fn: Callable, primal: Any, tstate: Any, batch_BT1: Any, grad_accum: int):
  """((loss, aux), gradients of `fn(primal, tstate, batch)` with respect to `primal`, the
  micro-batches or None): with grad_accum > 1 the mean over scanned micro-batches."""
  grad_fn = jax.value_and_grad(fn, has_aux=True)
  if grad_accum == 1:
    loss_aux, grads = grad_fn(primal, tstate, batch_BT1)
    return loss_aux, grads, None
  # a batch is an array or, with data.segment_mask, a dict of them (evaluation.split_batch)
  micro = jax.tree.map(lambda x: x.reshape((grad_accum, -1) + x.shape[1:]), batch_BT1)

  # Gradients (shaped as the primal) accumulate in the carry; each micro-batch's loss and
  # metrics come out stacked. The loss is traced once (an eval_shape for the metrics' zeros
  # would trace it twice: ~1.5 s more per step build for a tiny model).
  def body(acc, i_b):   # micro-batch i: its own noise for a sampled initial state
    loss_aux, g = grad_fn(primal, tstate, i_b[1], micro=i_b[0])
    return jax.tree.map(jnp.add, acc, g), loss_aux

  zeros = jax.tree.map(jnp.zeros_like, primal)
  grads, (loss, aux) = jax.lax.scan(body, zeros, (jnp.arange(grad_accum), micro))
  loss, aux = jax.tree.map(lambda x: jnp.sum(x, axis=0) / grad_accum, (loss, aux))
  return (loss, aux), jax.tree.map(lambda x: x / grad_accum, grads), micro


def make_train_step(exp: Experiment, grad_accum: int = 1, mutable: Sequence[str] = (),
                    loops: sampled_depth.StepLoops | None = None,
                    teacher: distill.Distill | None = None, trains: str = 'all',
                    watch: bool = False) -> Callable[..., tuple[TrainState, dict[str, Any]]]:
  """`train_step` of `exp`, not jitted (the loop jits it; the studies vmap and scan it):
  (state, batch[, depth][, teacher_vars]); `loops` (sampled_depth.step_loops): train.exit_loss
  and the seed; `teacher`: distillation (the step then takes the teacher's variables last);
  `trains`: train.trainable; `watch`: the watched step of train.watch's log steps."""
  if watch:
    mutable = tuple(dict.fromkeys(tuple(mutable) + (INTERMEDIATES,)))
  step = functools.partial(train_step, model=exp.model, tx=exp.tx, grad_accum=grad_accum,
                           tr=exp.tr, pz=exp.pz, mutable=tuple(mutable), loops=loops,
                           teacher=teacher, trains=trains, watch=watch)
  if teacher is not None and not sampled_depth.sampled(exp.model.cfg):
    plain = step
    step = lambda state, batch_BT1, teacher_vars: plain(state, batch_BT1, None, teacher_vars)
  if not watch:
    return step
  unwatched = step

  def watched(*args):   # traced inside watching(): the blocks sow their streams' RMS
    with watching():
      return unwatched(*args)
  return watched
