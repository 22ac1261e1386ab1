"""Recursive inference (sharenet/inference/loop_by_loop.py): early exit at its two ends against
independent decoders (never exit = plain greedy `generate`; always exit = the one-loop model),
and continuous depth-wise batching against each request decoded alone."""
import jax
import numpy as np
import pytest

from conftest import randomize_per_layer

from sharenet.inference import generate as gen
from sharenet.inference import loop_by_loop as ri
from sharenet.errors import ConfigError
from sharenet.models import DecoderLM, ModelConfig
from sharenet.models.lm import init_variables

K, R = 2, 3   # 2 sets looped 3 times
PROMPTS = ([3, 141, 59, 26, 5], [27, 18], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 1], [100, 101])
NEW = 8


def _model(tiny_config, repeats=R, readout_scale=1.0, **overrides):
  config = tiny_config(**{'model.num_layers': K * repeats, 'model.sharing.scheme': 'cycle',
                          'model.sharing.num_unique': K, **overrides})
  model = DecoderLM(ModelConfig.from_config(config.model, config.train.seq_len))
  variables = init_variables(model, jax.random.key(0))
  # A sharper readout so that confidences spread over (0, 1) and exits happen at every depth.
  variables['params']['readout']['kernel'] = variables['params']['readout']['kernel'] * \
      readout_scale
  return model, variables


@pytest.fixture(scope='module')
def cycle(tiny_config):
  return _model(tiny_config)


@pytest.fixture(scope='module')
def sharp(tiny_config):
  return _model(tiny_config, readout_scale=20.0)


@pytest.mark.slow
def test_never_exit_is_plain_greedy(cycle):
  model, variables = cycle
  _never_exit_is_plain_greedy(model, variables)


@pytest.mark.slow
def test_never_exit_is_plain_greedy_flat_learned(tiny_config):
  """The gathered lowering (same stored sets) and learned positions (the embedding side)."""
  _never_exit_is_plain_greedy(*_model(tiny_config, **{
      'model.scan_lowering': 'flat', 'model.position': 'learned', 'model.max_len': 64}))


def _never_exit_is_plain_greedy(model, variables):
  plain = gen.generate(model, variables, PROMPTS, NEW, temperature=0).tokens
  out = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit_threshold=1.0)
  assert out.tokens == plain
  assert out.exit_depths == [R] * len(PROMPTS)
  assert out.ticks == NEW * R   # lock step: every token runs every loop


RELAXED = {'model.sharing.scheme': 'middle_cycle', 'model.sharing.num_unique': K + 2,
           'model.sharing.lora_rank': 2, 'model.sharing.lora_targets': 'q,v,mlp_in',
           'model.sharing.untie_norms': True}


def _relaxed(tiny_config, repeats=R, **overrides):
  """Relaxed Recursive Transformer: U0 (A B) x R U_last, depth-wise LoRA and untied norms,
  every per-layer part randomised so that the loops differ."""
  config = tiny_config(**{**RELAXED, 'model.num_layers': K * repeats + 2, **overrides})
  model = DecoderLM(ModelConfig.from_config(config.model, config.train.seq_len))
  return model, randomize_per_layer(init_variables(model, jax.random.key(0)))


@pytest.mark.slow
def test_relaxed_middle_cycle_never_exit_is_plain_greedy(tiny_config):
  """Prelude, loops with their own LoRA and norms, coda: threshold 1.0 is `generate`'s greedy."""
  _never_exit_is_plain_greedy(*_relaxed(tiny_config))


@pytest.mark.slow
def test_relaxed_middle_cycle_always_exit_is_the_one_loop_model(tiny_config):
  """Exit after loop 0 = prelude, loop 0 (its own per-layer parts), coda: the model at depth 1,
  whose per-layer rows are layers 0, 1..K and the last of the deep model (models/layout.py).
  One-token prompts: a prefilled prompt runs every loop, and the coda's keys of those tokens
  then come from their full-depth state, which the shallow model never sees."""
  from sharenet.models import layout
  model, variables = _relaxed(tiny_config)
  # One loop shares nothing, so LoRA on every layer; the unique layers' rows are zeros (the
  # deep model holds none there), which computes what no LoRA computes.
  shallow, shallow_vars = _relaxed(tiny_config, repeats=1, **{'model.sharing.lora_layers': 'all'})
  rows = layout.applied_per_layer(variables['per_layer'], model.cfg)
  keep = np.r_[0:K + 1, model.cfg.num_layers - 1]
  shallow_vars = {'params': variables['params'], 'per_layer': layout.from_applied_per_layer(
      shallow_vars['per_layer'], {p: v[keep] for p, v in rows.items()}, shallow.cfg)}
  prompts = [p[:1] for p in PROMPTS]
  truncated = gen.generate(shallow, shallow_vars, prompts, NEW, temperature=0).tokens
  out = ri.generate_early_exit(model, variables, prompts, NEW, exit_threshold=0.0)
  assert out.tokens == truncated
  assert truncated != gen.generate(model, variables, prompts, NEW, temperature=0).tokens


@pytest.mark.slow
def test_relaxed_middle_cycle_depthwise_batching_is_plain_greedy(tiny_config):
  """Continuous depth-wise batching of the relaxed model (2 slots for 5 requests, refilled as
  they finish) never exiting early serves each request as greedy `generate` alone does."""
  model, variables = _relaxed(tiny_config)
  plain = gen.generate(model, variables, PROMPTS, NEW, temperature=0).tokens
  out = ri.DepthwiseScheduler(model, variables, num_slots=2, max_new_tokens=NEW,
                              num_positions=24).run(PROMPTS)
  assert out.tokens == plain and out.exit_depths == [R] * len(PROMPTS)


@pytest.mark.slow
def test_python_loop_stack_never_exit_is_plain_greedy(tiny_config):
  """The Python-loop baseline stores one module per set: served from the same metadata."""
  _never_exit_is_plain_greedy(*_model(tiny_config, **{'model.scan_layers': False}))


@pytest.mark.slow
def test_always_exit_is_the_one_loop_model(cycle, tiny_config):
  model, variables = cycle
  one_loop, _ = _model(tiny_config, repeats=1)   # same stored sets, applied once
  truncated = gen.generate(one_loop, variables, PROMPTS, NEW, temperature=0).tokens
  out = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit_threshold=0.0)
  assert out.tokens == truncated
  assert out.exit_depths == [1.0] * len(PROMPTS)
  full = gen.generate(model, variables, PROMPTS, NEW, temperature=0).tokens
  assert truncated != full   # the two ends differ, so each comparison could fail


@pytest.mark.slow
def test_first_token_exits_where_the_truncated_readout_is_confident(sharp, tiny_config):
  """The first new token (no earlier exits in the cache): the exit depth is the first r whose
  r-loop model (the same sets applied r times, a full uncached forward) puts probability >= 0.9
  on its argmax, and the token is that argmax (R and the full model's argmax if none does)."""
  model, variables = sharp
  truncated = [_model(tiny_config, repeats=r)[0] for r in range(1, R + 1)]
  depths = set()
  for p in PROMPTS:
    for r, m in enumerate(truncated, 1):
      probs = jax.nn.softmax(m.apply(variables, np.asarray([p], np.int32))[0, -1])
      if probs.max() >= 0.9 or r == R:
        break
    out = ri.generate_early_exit(model, variables, [p], 1, exit_threshold=0.9)
    assert out.exit_depths == [r] and out.tokens == [[int(np.argmax(probs))]]
    depths.add(r)
  assert len(depths) > 1   # the prompts exit at different depths


@pytest.mark.slow
def test_early_exit_batch_equals_each_prompt_alone(sharp):
  model, variables = sharp
  batch = ri.generate_early_exit(model, variables, PROMPTS, NEW, exit_threshold=0.9)
  depths = np.array(batch.exit_depths)
  assert 1 < batch.mean_exit_depth < R and np.ptp(depths) > 0   # mixed depths
  for p, tokens, depth in zip(PROMPTS, batch.tokens, batch.exit_depths):
    alone = ri.generate_early_exit(model, variables, [p], NEW, exit_threshold=0.9)
    assert alone.tokens == [tokens] and alone.exit_depths == [depth]
  # The lock-step batch takes at least as many ticks as its slowest member alone.
  assert batch.ticks >= max(d * NEW for d in batch.exit_depths)


@pytest.mark.slow
def test_depthwise_scheduler_serves_each_request_as_alone(sharp):
  model, variables = sharp
  requests = PROMPTS + ([42] * 6, [1, 2, 3])   # 7 requests, 2 slots, mixed prompt lengths
  alone = [ri.generate_early_exit(model, variables, [p], NEW, exit_threshold=0.9)
           for p in requests]
  sched = ri.DepthwiseScheduler(model, variables, num_slots=2, max_new_tokens=NEW,
                                num_positions=24, exit_threshold=0.9)
  out = sched.run(requests)
  assert out.tokens == [a.tokens[0] for a in alone]
  assert out.exit_depths == [a.exit_depths[0] for a in alone]
  # Every slot-tick that computed is one loop of one token of some request: the work is exactly
  # the loops the requests use alone, and 7 requests passed through 2 slots (refills).
  loops = sum(round(a.exit_depths[0] * a.emitted[0]) for a in alone)
  assert out.busy_slot_ticks == loops
  assert out.ticks >= loops / 2
  # Refilled at once: idle slot-ticks only while the last request runs alone.
  last_alone = max(round(a.exit_depths[0] * a.emitted[0]) for a in alone)
  assert out.ticks * 2 - out.busy_slot_ticks <= last_alone
  # The static-batch baseline (waits for the slowest member and for the whole batch) is slower.
  static = ri.DepthwiseScheduler(model, variables, num_slots=2, max_new_tokens=NEW,
                                 num_positions=24, exit_threshold=0.9, sync=True).run(requests)
  assert static.tokens == out.tokens
  assert static.ticks > out.ticks


@pytest.mark.slow
def test_eos_ends_a_request_and_frees_its_slot(sharp):
  model, variables = sharp
  first = ri.generate_early_exit(model, variables, [PROMPTS[1]], NEW, exit_threshold=0.9)
  eos = first.tokens[0][2]   # the third token of that request ends it
  sched = ri.DepthwiseScheduler(model, variables, num_slots=1, max_new_tokens=NEW,
                                num_positions=24, exit_threshold=0.9, eos_id=eos)
  out = sched.run([PROMPTS[1], PROMPTS[0]])
  assert out.tokens[0] == first.tokens[0][:first.tokens[0].index(eos)]
  alone = ri.generate_early_exit(model, variables, [PROMPTS[0]], NEW, exit_threshold=0.9,
                                 eos_id=eos)
  assert out.tokens[1] == alone.tokens[0]


@pytest.mark.slow
def test_bad_settings_are_one_line_errors(cycle, tiny_config):
  model, variables = cycle
  with pytest.raises(ConfigError, match='exit_threshold'):
    ri.generate_early_exit(model, variables, PROMPTS, NEW, exit_threshold=1.5)
  with pytest.raises(ConfigError, match='cache positions'):
    ri.DepthwiseScheduler(model, variables, num_slots=2, max_new_tokens=NEW,
                          num_positions=8).run(PROMPTS)
  config = tiny_config(**{'model.num_layers': 4, 'model.sharing.scheme': 'sequence',
                          'model.sharing.num_unique': 2})   # A A B B: no loop over the sets
  seq = DecoderLM(ModelConfig.from_config(config.model, config.train.seq_len))
  with pytest.raises(ConfigError, match='looped cycle segment'):
    ri.generate_early_exit(seq, init_variables(seq, jax.random.key(0)), PROMPTS, NEW)
