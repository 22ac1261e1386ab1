"""Runs the docs' shown commands in one process
(tests/end_to_end/test_docs.py::test_shown_commands_run).

    python tests/end_to_end/docs_runner.py JOBS.json RESULTS.jsonl

JOBS.json: [{"cli": "train.py" | "module.name", "argv": [...], "cwd": DIR, "text": shown}].
Each job runs as its entry point's `__main__` (runpy), with sys.argv set to its arguments, in
its directory, one after another: the same parsing, config loading and exit status as its own
process, without starting Python and importing JAX once per command (jit's caches are shared
across commands of the same shapes). Between jobs the flags the entry point defined are removed
and the rest reset, so each command sees only its own flags, as in a fresh process. One JSON
line per job goes to RESULTS.jsonl: {"text", "rc", "seconds", "tail"} (the tail of what it
printed). A failing job does not stop the later ones.
"""
import contextlib
import io
import json
import os
import runpy
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _own(module: str | None) -> bool:
  """Whether a flag defined from `module` belongs to the entry point just run: its own file
  (runpy names it by path), this repository's helpers that define its config flags, or
  ml_collections' --config.a.b overrides (defined through absl.flags._flag); a library's
  flags (grain, orbax, array_record: defined once, at its import) stay."""
  m = module or ''
  return (m == '__main__' or m.startswith(ROOT) or m.startswith('sharenet.')
          or m.startswith('ml_collections') or m == 'absl.flags._flag')


def run(cli: str, argv: list[str], cwd: str) -> tuple[int, str]:
  """(exit status, output) of one command run as its entry point's __main__ in `cwd`."""
  from absl import flags
  fv = flags.FLAGS
  before = set(fv)
  fv.unparse_flags()
  prog = os.path.join(ROOT, cli) if cli.endswith('.py') else cli
  saved_argv, saved_cwd = sys.argv, os.getcwd()
  sys.argv = [prog] + list(argv)
  out = io.StringIO()
  rc = 0
  try:
    os.chdir(cwd)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      if cli.endswith('.py'):
        runpy.run_path(prog, run_name='__main__')
      else:
        runpy.run_module(cli, run_name='__main__', alter_sys=True)
  except SystemExit as e:
    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if not isinstance(e.code, (int, type(None))):
      out.write(str(e.code))
  except BaseException:   # noqa: BLE001 - a traceback is the job's failure, reported
    rc = 1
    out.write(traceback.format_exc())
  finally:
    os.chdir(saved_cwd)
    sys.argv = saved_argv
    for name in set(fv) - before:   # the entry point's own flags (a library's stay defined)
      if _own(fv.find_module_defining_flag(name)):
        delattr(fv, name)
  return rc, out.getvalue()


def main(jobs_path: str, results_path: str) -> int:
  sys.path.insert(0, ROOT)
  from absl import app, logging   # their flags exist before the first job, and stay
  app.define_help_flags()
  logging.set_verbosity(logging.WARNING)
  with open(jobs_path) as f:
    jobs = json.load(f)
  failed = 0
  for job in jobs:
    t0 = time.time()
    rc, text = run(job['cli'], job['argv'], job['cwd'])
    failed += rc != 0
    with open(results_path, 'a') as f:
      f.write(json.dumps({'text': job['text'], 'rc': rc, 'seconds': round(time.time() - t0, 1),
                          'tail': text[-3000:]}) + '\n')
  return int(failed > 0)


if __name__ == '__main__':
  sys.exit(main(*sys.argv[1:3]))
