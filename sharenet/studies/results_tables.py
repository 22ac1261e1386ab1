"""Regenerates every measured table under docs/results/ from its JSON (no training, no JAX).

    python -m sharenet.studies.results_tables           # rewrite the tables
    python -m sharenet.studies.results_tables --check   # exit 1 naming each table that differs
    [--results=DIR]   # another copy of docs/results/ (tests/end_to_end/test_docs.py runs the
    rewrite so)

Each table is written by the same function its study uses when it runs (depth_report,
moe_report, norm_study, recursion_study, sharing_methods_study, nap_study, rank_study,
distill_study, coord_check, lr_sweep, norm_transfer, ladder, width_split, widen_study, and
benchmarks/summarize_runs for the sharing configs), so a table is never edited by hand: the
README and the pages link to these files instead of copying their numbers.
tests/end_to_end/test_docs.py checks that the committed tables equal what this writes.
"""
import json
import os
import sys
import tempfile
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, 'docs', 'results')


def _load(path: str) -> Any:
  with open(os.path.join(RESULTS, path)) as f:
    return json.load(f)


def _depth(path: str) -> str:
  from sharenet.studies import common, depth_report
  rows = _load(path)
  return depth_report.to_markdown(rows, common.parse_list(DEPTH_STUDY_DEPTHS, int))


def _nap(path: str) -> str:
  from sharenet.studies import nap_study
  with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, 'nap_study.md')
    nap_study.write_table(_load(path), out)
    return open(out).read()


def _sharing(path: str) -> str:
  sys.path.insert(0, ROOT)
  from benchmarks import summarize_runs
  return summarize_runs.to_markdown(_load(path))


def _fn(module: str, name: str = 'to_markdown') -> Callable[[str], str]:
  def make(path: str) -> str:
    import importlib
    return getattr(importlib.import_module(f'sharenet.studies.{module}'), name)(_load(path))
  return make


def _shifts(paths: tuple[tuple[str, str], ...]) -> str:
  from sharenet.studies import lr_sweep
  return lr_sweep.shift_table([(label, _load(path)) for label, path in paths
                               if os.path.exists(os.path.join(RESULTS, path))])


# The optimum shifts of the transfer sweeps, one table across optimizers and axes
SHIFT_SWEEPS = (('adamw', 'mup/lr_sweep.json'), ('muon', 'mup/muon/lr_sweep.json'),
                ('muon (scale=rms)', 'mup/muon/rms/lr_sweep.json'),
                ('shampoo', 'mup/shampoo/lr_sweep.json'),
                ('shampoo (graft=none)', 'mup/shampoo/vanilla/lr_sweep.json'),
                ('kfac (graft=none)', 'mup/kfac/vanilla/lr_sweep.json'),
                ('adamw', 'mup/beyond/lr_sweep.json'), ('muon', 'mup/muon/beyond/lr_sweep.json'),
                ('shampoo', 'mup/shampoo/beyond/lr_sweep.json'))

# The width sweeps split into width-stable and width-sensitive parts (sharenet/studies/width_split.py)
WIDTH_SWEEPS = (('adamw', 'mup/lr_sweep.json'), ('muon', 'mup/muon/lr_sweep.json'),
                ('muon (scale=rms)', 'mup/muon/rms/lr_sweep.json'),
                ('shampoo', 'mup/shampoo/lr_sweep.json'))


def _width_split(paths: tuple[tuple[str, str], ...]) -> str:
  from sharenet.studies import width_split
  return width_split.sweeps_markdown([(label, _load(path)) for label, path in paths])


# configs/depth_study.py's study.depths when the committed rows were measured
DEPTH_STUDY_DEPTHS = '1,2,3,4,6,8,12'

# Coordinate checks of the change from init (study.statistic=delta), under docs/results/mup/
DELTA_CHECKS = ('delta/', 'muon/coord_check/delta/', 'muon/rms/coord_check/delta/lr_0.01_steps8/',
                'muon/rms/coord_check/delta/lr_0.0625/',
                'muon/rms/coord_check/delta/lr_0.0625_steps8/',
                'muon/rms/coord_check/delta/lr_0.125/', 'shampoo/coord_check/delta/')

# table (under docs/results/) -> (its JSON, the function that writes it)
TABLES: dict[str, tuple[str, Callable[[str], str]]] = {
    'sharing_cpu.md': ('sharing_cpu.json', _sharing),
    'depth_study/depth_study.md': ('depth_study/depth_study.json', _depth),
    'moe_study/table.md': ('moe_study/results.json', _fn('moe_report')),
    'norm_study/norm_study.md': ('norm_study/norm_study.json', _fn('norm_study')),
    'norm_study/norm_study_seeds.md': ('norm_study/norm_study_seeds.json', _fn('norm_study')),
    'recursion_study/recursion_study.md': ('recursion_study/recursion_study.json',
                                           _fn('recursion_study')),
    'sharing_methods_study/sharing_methods_study.md': (
        'sharing_methods_study/sharing_methods_study.json', _fn('sharing_methods_study')),
    'nap/nap_study.md': ('nap/nap_study.json', _nap),
    'rank_study/rank_study.md': ('rank_study/rank_study.json', _fn('rank_study')),
    'distill_study/distill_study.md': ('distill_study/distill_study.json',
                                       _fn('distill_study')),
    'widen_study/widen_study.md': ('widen_study/widen_study.json', _fn('widen_study')),
    'ladder/ladder.md': ('ladder/ladder.json', _fn('ladder')),
    'norm_transfer/norm_transfer.md': ('norm_transfer/norm_transfer.json', _fn('norm_transfer')),
    **{f'mup/{d}coord_check.md': (f'mup/{d}coord_check.json', _fn('coord_check'))
       for d in ('', 'depth/coord_check/', 'lora/', 'lora/a_zero/', 'lora/lr_0.04/', 'umup/',
                 'umup/lr0.125/', 'zero_init/', 'muon/coord_check/', 'muon/coord_check/lr_0.125/',
                 'muon/rms/coord_check/', 'muon/rms/coord_check/lr_0.0625/',
                 'muon/rms/coord_check/lr_0.125/', 'muon/rms/coord_check/lr_0.25/',
                 'muon/rms/coord_check/lr_0.0625_steps8/', 'shampoo/coord_check/',
                 'shampoo/vanilla/coord_check/', 'kfac/coord_check/',
                 'kfac/vanilla/coord_check/', *DELTA_CHECKS)},
    **{f'mup/{d}lr_sweep.md': (f'mup/{d}lr_sweep.json', _fn('lr_sweep'))
       for d in ('', 'depth/', 'depth/alpha_0.5/', 'loops/', 'muon/', 'muon/rms/', 'shampoo/',
                 'beyond/', 'shampoo/vanilla/', 'muon/beyond/', 'shampoo/beyond/',
                 'kfac/vanilla/', 'kfac/vanilla/damping_1e-6/')},
    **{f'mup/{d}coord_check_steps.md': (f'mup/{d}coord_check.json',
                                        _fn('coord_check', 'steps_markdown'))
       for d in ('muon/rms/coord_check/lr_0.0625_steps8/', 'kfac/coord_check/',
                 'kfac/vanilla/coord_check/', *DELTA_CHECKS)},
    'mup/transfer_shifts.md': (SHIFT_SWEEPS, _shifts),
    'ladder/width_split.md': (WIDTH_SWEEPS, _width_split),
}


def generate() -> dict[str, str]:
  """{table path under docs/results/: its text generated from its JSON}."""
  return {table: make(src) for table, (src, make) in TABLES.items()}


def main(argv: list[str]) -> int:
  global RESULTS
  check = '--check' in argv[1:]
  for a in argv[1:]:
    if a.startswith('--results='):
      RESULTS = a.split('=', 1)[1]
  stale = []
  for table, text in generate().items():
    path = os.path.join(RESULTS, table)
    old = open(path).read() if os.path.exists(path) else None
    if old != text:
      stale.append(table)
      if not check:
        with open(path, 'w') as f:
          f.write(text)
  verb = 'differ from their JSON' if check else 'rewritten'
  print(f'{len(TABLES)} tables; {len(stale)} {verb}' + (': ' + ', '.join(stale) if stale else ''))
  return 1 if check and stale else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
