"""Normalize-and-Project (Lyle et al., arXiv:2407.01800): the effective-learning-rate claim.

  nice -n 5 python -m sharenet.studies.nap_study --config configs/nap_study.py --out OUT

For a weight the loss is scale-invariant in (here the MLP input kernels once
model.norm.pre_activation puts a norm after them), the angular step ||dW|| / ||W|| is what
the learning rate controls; without projection ||W|| grows and the step decays implicitly, with
transforms.project=nap ||W|| is pinned and the step keeps the size the schedule gives it. Each
variant (VARIANTS) trains from the same seed on the same batches; per step it records, for
groups of kernels, the mean over matrices (each stacked set separately) of ||W_t|| / ||W_0|| and
of ||W_{t+1} - W_t|| / ||W_t||, the train loss, and at the end the full validation eval. Writes
OUT/nap_study.json, OUT/nap_study.md and OUT/nap_study.png.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from sharenet import data
from sharenet.errors import ConfigError
from sharenet.studies import common
from sharenet.train import evaluation, experiment, trainer

VARIANTS: dict[str, dict[str, Any]] = {
    'baseline': {},
    'pre_act': {'model.norm.pre_activation': 'layernorm'},
    'nap': {'model.norm.pre_activation': 'layernorm', 'transforms.project': 'nap'},
}
# group -> roles and module names of its kernels (paths' last module)
GROUPS = {'mlp_in': ('reader', ('wi', 'wi_gate', 'wi_up')), 'attn_qkv': ('reader', ('q', 'k', 'v')),
          'writers': ('writer', None), 'readout': ('readout', None)}


def _g6(x) -> float:   # 6 significant digits keep the JSON small
  return float(f'{float(x):.6g}')


def _group_paths(infos) -> dict[str, list[tuple]]:
  out = {}
  for g, (role, modules) in GROUPS.items():
    out[g] = [p for p, l in infos.items()
              if l.role == role and (modules is None or p[-2] in modules)]
  return out


def run_one(base: Any, variant: str) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  from flax.traverse_util import flatten_dict

  config = common.with_overrides(base, VARIANTS[variant])
  t = config.train
  exp = trainer.setup(config, experiment.validate(config))
  groups = _group_paths(exp.tr.infos)
  infos = exp.tr.infos
  state = trainer.init_state(exp.model, exp.tx, jax.random.key(t.seed), exp.tr, exp.pz)
  step_fn = jax.jit(trainer.make_train_step(exp))

  def frob(w, leaf):   # one norm per stacked set
    return jnp.sqrt(jnp.sum(jnp.square(w.reshape(leaf.stack_shape + (-1,))), axis=-1)).ravel()

  @jax.jit
  def stats(old, new, init):
    fo, fn, fi = flatten_dict(old), flatten_dict(new), flatten_dict(init)
    out = {}
    for g, paths in groups.items():
      if not paths:
        continue
      norm = jnp.concatenate([frob(fn[p], infos[p]) / frob(fi[p], infos[p]) for p in paths])
      ang = jnp.concatenate([frob(fn[p] - fo[p], infos[p]) / frob(fo[p], infos[p])
                             for p in paths])
      out[g] = (jnp.mean(norm), jnp.mean(ang))
    return out

  it = data.make_train_iterator(config.data, t.seq_len, t.batch_size, t.seed)
  init = state.params
  rows, t0 = [], time.time()
  for s in range(t.steps):
    new, m = step_fn(state, jnp.asarray(next(it)))
    st = jax.device_get(stats(state.params, new.params, init))
    rows.append({'step': s + 1, 'loss': _g6(m['loss']),
                 **{f'{g}_norm': _g6(v[0]) for g, v in st.items()},
                 **{f'{g}_angular': _g6(v[1]) for g, v in st.items()}})
    state = new
  ev = evaluation.evaluate(exp.model, trainer.effective_params(state, exp.tr, exp.pz),
                         config.data, t.seq_len, t.eval_batch_size)
  return {'variant': variant, 'overrides': VARIANTS[variant], 'steps': rows,
          'seconds': round(time.time() - t0, 1), **ev}


def _window(rows, key, lo, hi):
  vals = [r[key] for r in rows[lo:hi] if key in r]
  return float(np.mean(vals)) if vals else float('nan')


def write_table(results: list[dict[str, Any]], path: str) -> None:
  lines = ['| variant | eval loss | eval bits/byte | final train loss | MLP-in norm / init | '
           'MLP-in angular step, steps 11-30 -> 181-200 | writers norm / init | '
           'writers angular step, 11-30 -> 181-200 | readout norm / init |',
           '|---|---|---|---|---|---|---|---|---|']
  for r in results:
    rows = r['steps']
    last = rows[-1]
    cell = lambda g: (f'{_window(rows, g + "_angular", 10, 30):.4f} -> '
                      f'{_window(rows, g + "_angular", -20, None):.4f}')
    lines.append(f'| {r["variant"]} | {r["eval_loss"]:.3f} | {r["eval_bits_per_byte"]:.3f} | '
                 f'{_window(rows, "loss", -10, None):.3f} | {last.get("mlp_in_norm", 1):.3f} | '
                 f'{cell("mlp_in")} | {last.get("writers_norm", 1):.3f} | {cell("writers")} | '
                 f'{last.get("readout_norm", 1):.3f} |')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')


def plot(results: list[dict[str, Any]], path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 4, figsize=(20, 4.2), constrained_layout=True)
  colors = {'baseline': 'tab:gray', 'pre_act': 'tab:blue', 'nap': 'tab:red'}
  for r in results:
    rows, v = r['steps'], r['variant']
    steps = [x['step'] for x in rows]
    col = colors.get(v)
    label = f'{v} (eval loss {r["eval_loss"]:.3f})'
    axes[0].plot(steps, [x['mlp_in_norm'] for x in rows], color=col, label=f'{v}: MLP in')
    axes[0].plot(steps, [x['writers_norm'] for x in rows], color=col, ls='--',
                 label=f'{v}: writers')
    axes[1].plot(steps, [x['mlp_in_angular'] for x in rows], color=col, label=v)
    axes[2].plot(steps, [x['writers_angular'] for x in rows], color=col, label=v)
    axes[3].plot(steps, [x['loss'] for x in rows], color=col, label=label)
  titles = ['||W_t|| / ||W_0||', 'angular update ||dW|| / ||W||: MLP input kernels',
            'angular update ||dW|| / ||W||: residual writers', 'train loss']
  for ax, title in zip(axes, titles):
    ax.set_title(title)
    ax.set_xlabel('step')
    ax.legend(fontsize=8)
  axes[1].set_yscale('log')
  axes[2].set_yscale('log')
  fig.suptitle('Normalize-and-Project (arXiv:2407.01800): constant LR, no weight decay')
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(config: Any, out: str) -> None:
  os.makedirs(out, exist_ok=True)
  variants = [v for v in str(config.study.variants).split(',') if v]
  for v in variants:
    if v not in VARIANTS:
      raise ConfigError(f'study.variants: {v!r} is unknown; valid: {", ".join(VARIANTS)}')
  results = []
  for v in variants:
    r = run_one(config, v)
    print(f'nap_study: {v}: eval_loss {r["eval_loss"]:.4f} ({r["seconds"]} s)', flush=True)
    results.append(r)
  with open(os.path.join(out, 'nap_study.json'), 'w') as f:
    json.dump(results, f, indent=1)
  write_table(results, os.path.join(out, 'nap_study.md'))
  plot(results, os.path.join(out, 'nap_study.png'))


if __name__ == '__main__':
  common.run_cli(main, 'runs/nap_study', 'configs/nap_study.py')
