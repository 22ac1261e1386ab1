"""The depth study's tables and plot from its rows (sharenet/studies/depth_study.py)."""
from __future__ import annotations

import statistics
from typing import Any, Sequence


VARIANTS: dict[str, str] = {
    'vanilla': 'untied, 5 layers (decode baseline)',
    'recursive': 'fixed depth, every loop with gradient',
    'sampled': 'poisson_lognormal depth, injection none',
    'sampled_inject': 'poisson_lognormal depth, injection add',
    'sampled_ode': 'poisson_lognormal depth, loops as Euler steps (ode_step)',
    'mor_expert': 'MoR expert choice (routes its own depth)',
}
# evaluated at every test-time depth
LOOPED = ('recursive', 'sampled', 'sampled_inject', 'sampled_ode')
KV_FIRST = 'recursive_kv_first'                       # decode-only row: recursive's parameters


def _mean_sd(xs: Sequence[float], fmt: str = '.3f') -> str:
  m = statistics.mean(xs)
  return f'{m:{fmt}} +- {statistics.stdev(xs):{fmt}}' if len(xs) > 1 else f'{m:{fmt}}'


def _by_variant(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
  return {v: [r for r in rows if r['variant'] == v] for v in VARIANTS
          if any(r['variant'] == v for r in rows)}


def depth_losses(rs: list[dict[str, Any]]) -> dict[int, list[float]]:
  """depth -> eval losses over the seeds (rows evaluated at test-time depths)."""
  out: dict[int, list[float]] = {}
  for r in rs:
    for d in r.get('depths', []):
      out.setdefault(d['depth'], []).append(d['eval_loss'])
  return out


def training_table(rows: list[dict[str, Any]]) -> str:
  lines = ['| variant | what | train FLOPs/token | steps | train FLOPs | tokens | '
           'eval loss (trained depth) | eval bits/byte |', '|---|---|---|---|---|---|---|---|']
  for v, rs in _by_variant(rows).items():
    steps = sorted({r['steps'] for r in rs})
    flops = statistics.mean(r['flops_per_token'] for r in rs)
    lines.append(
        f"| {v} | {rs[0]['what']} | {flops / 1e6:.3f} M | {', '.join(map(str, steps))} | "
        f"{statistics.mean(r['train_flops'] for r in rs) / 1e12:.3f} T | "
        f"{statistics.mean(r['tokens'] for r in rs):,.0f} | "
        f"{_mean_sd([r['eval_loss'] for r in rs])} | "
        f"{_mean_sd([r['eval_bits_per_byte'] for r in rs])} |")
  return '\n'.join(lines) + '\n'


def depth_table(rows: list[dict[str, Any]], depths: Sequence[int]) -> str:
  """Eval loss (mean over seeds) at each test-time depth; MoR and vanilla at their own depth."""
  head = ' | '.join(f'd={d}' for d in depths)
  lines = [f'| variant | {head} | best depth |', '|---|' + '---|' * (len(depths) + 1)]
  for v, rs in _by_variant(rows).items():
    losses = depth_losses(rs)
    if not losses:
      cells = ['-'] * len(depths)
      lines.append(f"| {v} | {' | '.join(cells)} | trained only: "
                   f"{_mean_sd([r['eval_loss'] for r in rs])} |")
      continue
    means = {d: statistics.mean(ls) for d, ls in losses.items()}
    best = min(means, key=means.get)
    cells = [f'{means[d]:.3f}' if d in means else '-' for d in depths]
    lines.append(f"| {v} | {' | '.join(cells)} | {best} |")
  flops = next((r['depths'] for r in rows if r.get('depths')), [])
  if flops:
    fl = {d['depth']: d['flops_per_token'] for d in flops}
    cells = [f'{fl[d] / 1e6:.2f} M' if d in fl else '-' for d in depths]
    lines.append(f"| eval FLOPs/token | {' | '.join(cells)} | |")
  return '\n'.join(lines) + '\n'


def decode_rows(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
  """model -> decode results over the seeds (recursive_kv_first from the recursive rows)."""
  out: dict[str, list[dict[str, Any]]] = {}
  for v, rs in _by_variant(rows).items():
    out[v] = [r['decode'] for r in rs if 'decode' in r]
    if v == 'recursive':
      out[KV_FIRST] = [r['decode_kv_first'] for r in rs if 'decode_kv_first' in r]
  return {k: v for k, v in out.items() if v}


def decode_table(rows: list[dict[str, Any]]) -> str:
  lines = ['| model | decode tokens/s | KV bytes/token | KV vs vanilla | '
           'compile s (first warm-up) |', '|---|---|---|---|---|']
  dec = decode_rows(rows)
  ref = statistics.mean(d['kv_bytes_per_token'] for d in dec['vanilla']) if 'vanilla' in dec \
      else None
  for k, ds in dec.items():
    kv = statistics.mean(d['kv_bytes_per_token'] for d in ds)
    rel = f'{kv / ref:.2f}' if ref else '-'
    lines.append(f"| {k} | {_mean_sd([d['tokens_per_sec'] for d in ds], ',.0f')} | {kv:,.0f} | "
                 f"{rel} | {max(d['compile_seconds'] for d in ds):.1f} |")
  return '\n'.join(lines) + '\n'


def to_markdown(rows: list[dict[str, Any]], depths: Sequence[int]) -> str:
  return ('Training at equal FLOPs (mean +- sd over seeds; steps per seed):\n\n' +
          training_table(rows) + '\nEval loss (nats/token) against test-time depth (loops of '
          'the looped layer; mean over seeds):\n\n' + depth_table(rows, depths) +
          '\nGreedy decoding of the fixed prompt batch (median of the timed calls, mean +- sd '
          'over seeds):\n\n' + decode_table(rows))


def plot(rows: list[dict[str, Any]], trained: int, path: str) -> None:
  """Eval loss against test-time depth: a line per looped variant (mean, min-max over seeds),
  MoR and vanilla as points at the trained depth."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for v, rs in _by_variant(rows).items():
    losses = depth_losses(rs)
    if losses:
      ds = sorted(losses)
      m = [statistics.mean(losses[d]) for d in ds]
      (line,) = ax.plot(ds, m, 'o-', label=v)
      ax.fill_between(ds, [min(losses[d]) for d in ds], [max(losses[d]) for d in ds], alpha=0.2,
                      color=line.get_color())
    else:
      ls = [r['eval_loss'] for r in rs]
      ax.errorbar([trained], [statistics.mean(ls)], fmt='s', capsize=3,
                  yerr=[[statistics.mean(ls) - min(ls)], [max(ls) - statistics.mean(ls)]],
                  label=f'{v} (trained depth only)')
  ax.axvline(trained, color='gray', linestyle=':', label=f'trained (mean) depth {trained}')
  ax.set_xscale('log', base=2)
  ticks = sorted({d for r in rows for d in (x['depth'] for x in r.get('depths', []))} |
                 {trained})
  ax.set_xticks(ticks, [str(d) for d in ticks])
  ax.set(xlabel='test-time depth (loops of the looped layer)', ylabel='eval loss (nats/token)',
         title='equal training FLOPs')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
