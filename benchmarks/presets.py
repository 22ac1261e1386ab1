"""The size presets' table: parameters, FLOPs per token, the slices each dry run fits, step time.

Command: python -m benchmarks.presets [--out benchmarks/results/presets.json] [--docs docs/scaling.md]
         (from the repository root; compiles on the CPU, runs nothing; reads
         benchmarks/results/roofline.json for the step times, so run benchmarks.roofline first
         after changing a shape)
Runtime: ~6 min on the 2-core CPU (12 dry runs, the 8B ones ~50 s each).

Per preset (configs/sizes/, configs/sizes/presets.py) and plan: stored and applied parameters,
and training FLOPs per token (models/accounting.py). Per preset and each slice it claims
(presets.FITS): the untied model's dry run (config.dry_run, sharenet/train/sharding.py
`report`) on that many simulated CPU devices, the preset's mesh (FSDP over the chips), remat and
batch (8 x 2,048 tokens per chip): the train state per device (exact) and the compiled step's
peak (XLA:CPU's memory analysis, an estimate of the chip's), against the chip's HBM
(sharenet/train/perf.py); and the roofline's lower bound on the step time of that chip
(benchmarks/results/roofline.json, the same shape and tokens per chip). A shared plan's state
is smaller and its activations the same, so the untied dry run bounds the preset's plans.
Writes --out and the table into docs/scaling.md between its presets markers;
tests/benchmarks/test_presets.py reruns every claimed dry run and checks it fits.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from absl import app, flags

from benchmarks import doc_tables
from configs.sizes import presets

_OUT = flags.DEFINE_string('out', 'benchmarks/results/presets.json', 'JSON results')
_DOCS = flags.DEFINE_string('docs', 'docs/scaling.md', 'Markdown page whose presets section is '
                            'rewritten ("" to leave it)')
_WORKER = flags.DEFINE_integer('worker', 0, 'internal: the dry runs of the slices of this many '
                               'chips, JSON lines on stdout')
ROOFLINE = 'benchmarks/results/roofline.json'
ROOFLINE_CHIP = {'TPU v5p': 'TPU v5p', 'NVIDIA H100 80GB HBM3': 'H100 SXM'}
BEGIN, END = '<!-- presets: begin (python -m benchmarks.presets) -->', '<!-- presets: end -->'


def claims() -> list[tuple[str, str]]:
  """(size, slice) of every slice a preset claims to fit."""
  return [(size, s) for size, (slices, _) in presets.FITS.items() for s in slices]


def dry_run(size: str, slice_: str) -> dict[str, Any]:
  """The untied preset's dry run for `slice_` (in a process with that many devices)."""
  from sharenet.train import loop
  c = presets.config(size, 'untied', slice_)
  c.dry_run = True
  with contextlib.redirect_stdout(io.StringIO()):
    totals = loop.train_and_evaluate(c, os.devnull)
  return {'size': size, 'slice': slice_, **totals}


def worker(chips: int) -> None:
  import jax
  assert jax.device_count() == chips, jax.devices()
  for size, slice_ in claims():
    if presets.SLICES[slice_][0] == chips:
      print(json.dumps(dry_run(size, slice_)), flush=True)


def dry_runs(only: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
  """The dry runs of `only` (default: every claim), one subprocess per device count."""
  wanted = only or claims()
  rows = []
  for chips in sorted({presets.SLICES[s][0] for _, s in wanted}):
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                        f' --xla_force_host_platform_device_count={chips}')
    res = subprocess.run([sys.executable, '-m', 'benchmarks.presets', f'--worker={chips}'],
                         env=env, capture_output=True, text=True)
    if res.returncode:
      raise RuntimeError(f'dry runs on {chips} devices failed: {res.stderr[-2000:]}')
    for line in res.stdout.splitlines():
      if line.startswith('{'):
        row = json.loads(line)
        if (row['size'], row['slice']) in wanted:
          rows.append(row)
  return rows


def fits(row: dict[str, Any]) -> bool:
  """Whether a dry run's step peak (or, without one, its state) fits its slice's chip."""
  from sharenet.train import perf
  hbm = perf.hbm_capacity(presets.SLICES[row['slice']][1])
  return row.get('step_peak_bytes_per_device', row['state_bytes_per_device']) <= hbm


def sizes() -> list[dict[str, Any]]:
  """Parameters and FLOPs per token of every preset and plan (abstract: no arrays)."""
  from sharenet.models import DecoderLM, ModelConfig, abstract_variables, accounting
  out = []
  for size in presets.SHAPES:
    for plan in presets.PLANS:
      cfg = ModelConfig.from_experiment(presets.config(size, plan))
      v = abstract_variables(DecoderLM(cfg))
      out.append({'size': size, 'plan': plan, 'params_stored': accounting.params_unique(v),
                  'params_applied': accounting.params_applied(v, cfg),
                  'flops_per_token': accounting.flops_per_token(cfg, presets.SEQ_LEN)})
  return out


def step_times(roofline: dict[str, Any]) -> dict[tuple[str, str], float]:
  """{(size, slice): the roofline's lower bound on its chip's step time (untied)}."""
  out = {}
  for size, slice_ in claims():
    chip = ROOFLINE_CHIP[presets.SLICES[slice_][1]]
    for r in roofline['steps']:
      if r['model'] == size.upper() and r['plan'] == 'untied':
        out[size, slice_] = r['chips'][chip]['t_lower_s']
  return out


def markdown(result: dict[str, Any]) -> str:
  g = lambda b: f'{b / 1e9:.1f}'
  m = lambda n: f'{n / 1e6:,.0f}M'
  lines = [textwrap.fill(
      'Parameters (stored / applied) and training FLOPs per token of each preset and plan '
      '(`python train.py --config configs/sizes/SIZE.py[:PLAN]`; byte vocabulary: the Llama '
      'shapes lack their token embeddings).', 96), '',
      '| preset | ' + ' | '.join(f'{p} (stored / applied)' for p in presets.PLANS) +
      ' | GFLOPs / token |', '|---|' + '---|' * (len(presets.PLANS) + 1)]
  by = {(r['size'], r['plan']): r for r in result['sizes']}
  for size in presets.SHAPES:
    cells = [f"{m(by[size, p]['params_stored'])} / {m(by[size, p]['params_applied'])}"
             for p in presets.PLANS]
    lines.append(f'| {size} | ' + ' | '.join(cells) +
                 f" | {by[size, 'untied']['flops_per_token'] / 1e9:.2f} |")
  lines += ['', textwrap.fill(
      'Where each preset fits: the untied model\'s dry run on the slice (FSDP over its chips, '
      '8 x 2,048 tokens per chip, the preset\'s remat; simulated CPU devices): the train state '
      'per device (exact) and the compiled step\'s peak (XLA:CPU\'s memory analysis, an estimate '
      'of the chip\'s), against the chip\'s HBM, and the roofline\'s lower bound on the step '
      'time (benchmarks/roofline.py). GB = 1e9 bytes.', 96), '',
      '| preset | slice | mesh | remat | state GB/device | step peak GB/device | HBM GB/chip | '
      'fits | step time >= (ms) |', '|---|---|---|---|---|---|---|---|---|']
  from sharenet.train import perf
  for r in result['dry_runs']:
    chips, kind = presets.SLICES[r['slice']]
    t = result['step_times'].get(f"{r['size']}/{r['slice']}")
    lines.append(
        f"| {r['size']} | {r['slice']} | fsdp={chips} | `{presets.FITS[r['size']][1]}` | "
        f"{g(r['state_bytes_per_device'])} | {g(r['step_peak_bytes_per_device'])} | "
        f"{g(perf.hbm_capacity(kind))} | {'yes' if fits(r) else 'no'} | "
        f"{'-' if t is None else f'{1e3 * t:.0f}'} |")
  return '\n'.join(lines)


def main(argv) -> None:
  del argv
  if _WORKER.value:
    worker(_WORKER.value)
    return
  with open(ROOFLINE) as f:
    roofline = json.load(f)
  result = {'sizes': sizes(), 'dry_runs': dry_runs(),
            'step_times': {f'{k[0]}/{k[1]}': v for k, v in step_times(roofline).items()}}
  for r in result['dry_runs']:
    print(f"{r['size']} on {r['slice']}: state {r['state_bytes_per_device'] / 1e9:.1f} GB, "
          f"peak {r['step_peak_bytes_per_device'] / 1e9:.1f} GB/device, fits: {fits(r)}",
          flush=True)
  os.makedirs(os.path.dirname(_OUT.value) or '.', exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=1)
  if _DOCS.value:
    doc_tables.splice(_DOCS.value, BEGIN, END, markdown(result))
  print(f'wrote {_OUT.value}' + (f' and the table in {_DOCS.value}' if _DOCS.value else ''))


if __name__ == '__main__':
  app.run(main)
