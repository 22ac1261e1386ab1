"""Eval loss against the depth-wise LoRA rank of a recursive conversion (issue 31 item 5).

  python -m sharenet.studies.rank_study --config configs/rank_study.py --out runs/rank_study \
      --config.study.source=WORKDIR

Relaxed Recursive Transformers (Bae et al., arXiv:2410.20672) convert a
pretrained model into a recursive one (K shared sets, cycled) and relax the tying with
depth-wise LoRA initialised from the truncated SVD of each layer's residual against its shared
set: at full rank the converted model is the source, at rank 0 it is the plain recursive model.
This study converts `study.source` (any untied workdir: a Hugging Face import, or a run of this
repository) at each rank in `study.ranks` with `convert.py`'s own conversion
(convert_workdir.convert_workdir: `--config.to=recursive`, the scheme, sets, init, targets and
untied norms of `study`), evaluates each converted workdir and the source on the same
validation bytes of the embedded corpus (`study.eval_tokens` of them), and writes
OUT/rank_study.json (one row per rank: eval loss, bits per byte, stored parameters),
OUT/rank_study.md and OUT/rank_study.png (eval loss against rank, the source and rank 0 as
lines). No training: the conversion alone, as the paper's
initialisation before uptraining. Converted workdirs stay in OUT/runs/rank{r}; a rerun converts
only the ranks not yet there.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from sharenet.config import defaults
from sharenet.errors import ConfigError
from sharenet.main import convert_workdir, eval_workdir
from sharenet.studies import common


def options(study: Any, rank: int) -> Any:
  """convert.py's options (defaults.conversion_config) for one rank."""
  opts = defaults.conversion_config()
  opts.to, opts.scheme, opts.num_unique = 'recursive', study.scheme, int(study.num_unique)
  opts.init, opts.lora_targets = study.init, study.lora_targets
  opts.lora_rank = int(rank)
  opts.lora_init = 'svd' if rank else 'zero'
  opts.untie_norms = bool(study.untie_norms)
  return opts


def to_markdown(result: dict[str, Any]) -> str:
  s = result['study']
  lines = [f"Recursive conversion of `{s['source']}` ({s['scheme']}, {s['num_unique']} sets, "
           f"init {s['init']}, LoRA on {s['lora_targets'] or 'the source targets'}), "
           f"no uptraining; eval on the same validation tokens:", '',
           '| LoRA rank | stored params | eval loss (nats/token) | vs source | eval bits/byte |',
           '|---|---|---|---|---|']
  src = result['source']
  lines.append(f"| source | {src['params_unique']:,} | {src['eval_loss']:.4f} | - | "
               f"{src['eval_bits_per_byte']:.4f} |")
  for r in result['rows']:
    lines.append(f"| {r['rank']} | {r['params_unique']:,} | {r['eval_loss']:.4f} | "
                 f"{r['eval_loss'] - src['eval_loss']:+.4f} | {r['eval_bits_per_byte']:.4f} |")
  return '\n'.join(lines) + '\n'


def plot(result: dict[str, Any], path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  rows = [r for r in result['rows'] if r['rank'] > 0]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot([r['rank'] for r in rows], [r['eval_loss'] for r in rows], 'o-',
          label='recursive + SVD LoRA')
  ax.axhline(result['source']['eval_loss'], color='k', ls='--', label='source (untied)')
  zero = [r for r in result['rows'] if r['rank'] == 0]
  if zero:
    ax.axhline(zero[0]['eval_loss'], color='tab:red', ls=':', label='rank 0 (no LoRA)')
  ax.set_xscale('log', base=2)
  ax.set_xlabel('depth-wise LoRA rank')
  ax.set_ylabel('eval loss (nats/token)')
  ax.set_title('recursive conversion, no uptraining')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(config: Any, out: str) -> int:
  """Converts and evaluates every rank of config.study not yet under OUT/runs; writes the
  json, table and plot."""
  s = config.study
  if not s.source or not os.path.isfile(os.path.join(s.source, 'config.json')):
    raise ConfigError(f'study.source={s.source!r} is not a workdir (no config.json); valid: the '
                      f'--out of train.py, convert.py or python -m sharenet.interop.import_hf')
  ranks = common.parse_list(s.ranks, int)
  if any(r < 0 for r in ranks):
    raise ConfigError(f'study.ranks={s.ranks!r}: ranks are >= 0 (0: no LoRA)')
  # every workdir on the embedded corpus' validation bytes (an import's config names no data)
  overrides = {'data.source': 'stdlib', 'data.tokenizer': 'bytes', 'data.path': '',
               'data.eval_tokens': int(s.eval_tokens)}
  t0 = time.time()
  source = eval_workdir.evaluate_workdir(s.source, overrides=overrides)
  source['params_unique'] = common.stored_params(s.source)
  rows = []
  for r in ranks:
    dst = os.path.join(out, 'runs', f'rank{r}')
    if not os.path.isfile(os.path.join(dst, 'config.json')):
      convert_workdir.convert_workdir(s.source, dst, options(s, r))
    ev = eval_workdir.evaluate_workdir(dst, overrides=overrides)
    rows.append({'rank': r, 'eval_loss': ev['eval_loss'],
                 'eval_bits_per_byte': ev['eval_bits_per_byte'], 'params_unique': common.stored_params(dst)})
    print(json.dumps(rows[-1]), flush=True)
  result = {'study': s.to_dict(), 'source': {k: source[k] for k in (
      'eval_loss', 'eval_bits_per_byte', 'params_unique')}, 'rows': rows,
            'runtime_s': round(time.time() - t0, 1)}
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'rank_study.json'), 'w') as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out, 'rank_study.md'), 'w') as f:
    f.write(to_markdown(result))
  plot(result, os.path.join(out, 'rank_study.png'))
  print(to_markdown(result))
  return 0


if __name__ == '__main__':
  common.run_cli(main, 'runs/rank_study', 'configs/rank_study.py')
