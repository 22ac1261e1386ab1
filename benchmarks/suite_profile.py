"""Where the test suite's time goes, and which tests form its slow tier.

  SHARENET_TEST_PROFILE=/tmp/prof python -m pytest -q tests --junitxml=/tmp/suite.xml
  python benchmarks/suite_profile.py /tmp/prof [--top 40]
  python benchmarks/suite_profile.py --junit /tmp/suite.xml [--threshold 4]

A profile directory (SHARENET_TEST_PROFILE) gives per test file: wall seconds, XLA compiles
and their seconds, lowering and tracing seconds (tracing counts nested traces too, so it can
exceed wall), then the costliest tests; tests that run a subprocess show wall time only (their
compiles happen in the child). A junit file gives each test's seconds per tier (slow /
fast) and names the tests not marked @pytest.mark.slow that took over --threshold seconds (in
that run, two workers sharing two cores): mark those slow to keep the fast tier fast.
"""
import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

KEYS = ('wall_s', 'compiles', 'compile_s', 'lower_s', 'trace_s')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def profile(directory, top):
  rows = load(directory)
  files = collections.defaultdict(collections.Counter)
  for r in rows:
    files[r['test'].split('::')[0]].update({k: r.get(k, 0) for k in KEYS})
  total = collections.Counter()
  for vals in files.values():
    total.update(vals)
  print(f'{len(rows)} tests; ' + ', '.join(f'{k} {total[k]:.0f}' for k in KEYS))
  table(files, top)
  print()
  table({r['test']: r for r in rows}, top)


def junit_seconds(path):
  """{node id: seconds} of a pytest --junitxml file."""
  out = {}
  for case in ET.parse(path).iter('testcase'):
    module = case.get('classname').split('.')
    # classname is the module's dotted path (and a class, if any: not used in this suite)
    out['/'.join(module) + '.py::' + case.get('name')] = float(case.get('time'))
  return out


def collect(marker):
  """Node ids pytest selects with -m `marker`."""
  r = subprocess.run([sys.executable, '-m', 'pytest', '--collect-only', '-q', '-n', '0', '-m',
                      marker, 'tests'], cwd=ROOT, capture_output=True, text=True, check=True)
  return {line.strip() for line in r.stdout.splitlines() if '::' in line}


def tiers(path, top, threshold):
  seconds = junit_seconds(path)
  marked_fast = collect('not slow')   # not marked @pytest.mark.slow
  fast = {n: s for n, s in seconds.items() if n in marked_fast}
  print(f'{len(seconds)} tests, {sum(seconds.values()):.0f} test-seconds: fast tier '
        f'{len(fast)} tests, {sum(fast.values()):.0f} s; slow tier '
        f'{len(seconds) - len(fast)} tests, {sum(seconds.values()) - sum(fast.values()):.0f} s')
  by_file = collections.Counter()
  for n, s in seconds.items():
    by_file[n.split('::')[0]] += s
  for name, s in by_file.most_common(top):
    print(f'{s:8.1f}  {name}')
  slow = sorted(n for n, s in fast.items() if s > threshold)
  if slow:
    print(f'{len(slow)} fast-tier tests took over {threshold:g} s '
          f'({sum(fast[n] for n in slow):.0f} '
          f's): mark them @pytest.mark.slow')
    for n in slow:
      print(f'{fast[n]:8.1f}  {n}')


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('directory', nargs='?', help='a SHARENET_TEST_PROFILE directory')
  parser.add_argument('--junit', help='a pytest --junitxml file of a full run')
  parser.add_argument('--threshold', type=float, default=4.0,
                      help='seconds over which an unmarked test is named (default 4)')
  parser.add_argument('--top', type=int, default=40)
  args = parser.parse_args()
  if (args.directory is None) == (args.junit is None):
    parser.error('give a profile directory or --junit FILE, one of them')
  if args.junit:
    tiers(args.junit, args.top, args.threshold)
  else:
    profile(args.directory, args.top)


if __name__ == '__main__':
  main()
