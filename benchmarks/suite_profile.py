"""Where the test suite's time goes: a summary of SHARENET_TEST_PROFILE's per-test lines.

  SHARENET_TEST_PROFILE=/tmp/prof python -m pytest -q tests
  python benchmarks/suite_profile.py /tmp/prof [--top 40]

Prints per test file: wall seconds, XLA compiles and their seconds, lowering and tracing
seconds (tracing counts nested traces too, so it can exceed wall), then the costliest tests.
Tests that run a subprocess show wall time only: their compiles happen in the child.
"""
import argparse
import collections
import glob
import json
import os

KEYS = ('wall_s', 'compiles', 'compile_s', 'lower_s', 'trace_s')


def load(directory):
  rows = []
  for path in sorted(glob.glob(os.path.join(directory, '*.jsonl'))):
    with open(path) as f:
      rows += [json.loads(line) for line in f if line.strip()]
  return rows


def table(groups, top):
  print(f'{"":60s}' + ''.join(f'{k:>11s}' for k in KEYS))
  for name, vals in sorted(groups.items(), key=lambda kv: -kv[1]['wall_s'])[:top]:
    print(f'{name[-60:]:60s}' + ''.join(f'{vals.get(k, 0):11.1f}' for k in KEYS))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('directory')
  parser.add_argument('--top', type=int, default=40)
  args = parser.parse_args()
  rows = load(args.directory)
  files = collections.defaultdict(collections.Counter)
  for r in rows:
    files[r['test'].split('::')[0]].update({k: r.get(k, 0) for k in KEYS})
  total = collections.Counter()
  for vals in files.values():
    total.update(vals)
  print(f'{len(rows)} tests; ' + ', '.join(f'{k} {total[k]:.0f}' for k in KEYS))
  table(files, args.top)
  print()
  table({r['test']: r for r in rows}, args.top)


if __name__ == '__main__':
  main()
