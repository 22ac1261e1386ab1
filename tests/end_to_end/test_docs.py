"""The documentation is built and its commands are checked (docs/contributing.md, "Docs").

- `mkdocs build --strict` (mkdocs.yml): a broken link, a missing anchor or a page under docs/
  left out of the navigation fails.
- The measured tables under docs/results/ equal what `python -m sharenet.studies.results_tables`
  generates from their JSON.
- README.md stays short, and its Layout section names existing paths and every package.
- Every shell command shown in README.md and docs/**/*.md (```bash / sh / shell / console
  blocks) has its flags checked against the code: an absl flag must be defined by the CLI it is
  passed to, a `--config.a.b=v` key must exist in the config the command names (or the CLI's
  default config). Commands marked `# long: <measured time>` are only checked; every other one
  runs here at tiny size (test_shown_commands_run, through tests/end_to_end/docs_runner.py).
"""
import ast
import functools
import glob
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The quickstart (as shown in the README, whitespace-normalised): run first, in this order, in
# the one temporary directory every shown command runs in (they make runs/default).
RUN = [
    'python train.py',
    'python eval.py --workdir runs/default',
    'python eval.py --workdir runs/default --prompt "def fib(" --max_new_tokens 40 --temperature 0',
    'python convert.py --workdir runs/default --out runs/rec --config.to=recursive '
    '--config.scheme=universal --config.num_unique=1 --config.init=average '
    '--config.lora_rank=8 --config.lora_init=svd',
    'python -m sharenet.studies.results_tables --check',
]

# Known heavy flags, rewritten to tiny values when a command runs here.
TINY = {'config.train.steps': '3', 'config.train.checkpoint_every': '3',
        'config.data.eval_tokens': '8192', 'max_new_tokens': '8', 'num_samples': '1'}
# The data tools read the first DATA_DOCUMENTS train documents of the embedded corpus (their
# --max_documents), enough for a 4096-id BPE and the tiny runs on its shards; validation is whole.
DATA_TOOLS = ('sharenet.data.train_tokenizer', 'sharenet.data.prepare')
DATA_DOCUMENTS = '300'
# train.py runs configs/tiny.py in place of the default model; a command naming another config
# file keeps it (its plan, norms, parametrization) at tiny width and batch. A run's own config
# (configs/workdir.py:DIR) is kept whole: its checkpoint has that shape.
TINY_CONFIG = 'configs/tiny.py'
TINY_MODEL = {'config.model.d_model': '32', 'config.model.num_heads': '2',
              'config.model.mlp_dim': '64', 'config.model.remat': 'none',
              'config.train.batch_size': '4', 'config.train.seq_len': '32',
              'config.train.eval_batch_size': '64', 'config.train.progress': 'False'}
# On 8 simulated devices (a command with XLA_FLAGS or a mesh of several devices) the batch
# divides over them.
EIGHT_DEVICES = {'config.train.batch_size': '8', 'config.train.eval_batch_size': '64'}
# A dry run (config.dry_run=True: the step compiled abstractly, nothing allocated) keeps its
# model whole, the point of the command; on 8 simulated devices, unless it names its FSDP axis,
# that axis takes them all (a preset names its slice's chip count).
DRY_RUN_EIGHT = {'config.mesh.fsdp': '-1'}
# Files some shown commands read, written into the run directory first: a prompt file, and
# token ids for the imported fixture model (tests/fixtures/hf/llama, vocabulary 64).
PROMPTS = 'def fib(\nclass Stack:\n'
TOKENS_VOCAB = 64
# A workdir that only a long command makes (a download) is stood in by one the docs' runnable
# commands make: the command is run as shown, on the stand-in.
STAND_INS = {'runs/tinyllama': 'runs/llama'}
# The committed results a command reads (docs/results/...) are the run directory's copy of them
# (results_copy), so a command that writes beside its input never touches the repository.
RESULTS_LINK = ('docs/results', 'results_copy')
# Paths of the repository the commands name relatively (links in the run directory).
LINKED = ('configs', 'tests', 'benchmarks', 'README.md')   # README.md: a calibration text
# The only environment a command may set and still run here.
RUNNABLE_ENV = {'XLA_FLAGS'}

# Segments that set up an environment or are the test suite itself: shown, never run here
# (.ci/run runs exactly the README's set-up and test commands).
NOT_CLI = {'pip', 'pip3', '.', 'source', 'cd', 'export', 'mkdocs', 'git', 'wc', 'cat', 'ls', 'rm',
           'mkdir', 'cp', 'echo', 'kill', 'sleep', 'wait', 'nvidia-smi', 'XLA_FLAGS'}
NOT_CLI_MODULES = {'venv', 'pytest', 'pip'}
ABSL_CORE = {'help', 'helpfull', 'helpshort', 'helpxml', 'flagfile', 'undefok', 'logtostderr',
             'alsologtostderr', 'v', 'verbosity', 'log_dir', 'only_check_args'}
LONG = re.compile(r'^#\s*long:\s*(\S.*)$')


def doc_files():
  return ['README.md'] + sorted(os.path.relpath(p, ROOT) for p in
                                glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))


class Command:
  def __init__(self, text, where, long):
    self.text, self.where, self.long = text, where, long   # long: the measured time, or None

  def __repr__(self):
    return f'{self.where}: {self.text}'


def extract_commands(path):
  """Shell commands of a markdown file's bash / sh / shell / console blocks, continuation lines
  joined; `# long: T` marks the next command."""
  text = open(os.path.join(ROOT, path)).read()
  out = []
  for m in re.finditer(r'^([ \t]*)```(bash|sh|shell|console)[^\n]*\n(.*?)^\1```', text,
                       re.M | re.S):
    line0 = text[:m.start()].count('\n') + 1
    lines = [l[len(m.group(1)):] if l.startswith(m.group(1)) else l.lstrip()
             for l in m.group(3).split('\n')]
    if m.group(2) == 'console':
      lines = [l[2:] for l in lines if l.startswith('$ ')]
    joined, buf = [], ''
    for l in lines:
      if l.rstrip().endswith('\\'):
        buf += l.rstrip()[:-1] + ' '
        continue
      joined.append(buf + l)
      buf = ''
    long = None
    for l in joined:
      s = l.strip()
      if not s:
        continue
      if s.startswith('#'):
        mm = LONG.match(s)
        if mm:
          long = mm.group(1)
        continue
      out.append(Command(s, f'{path}:{line0}', long))
      long = None
  return out


def extract_inline(path):
  """Commands quoted in running text (`python ...` in backticks outside code blocks): their
  flags are checked like a block's; their time is given in the sentence."""
  text = re.sub(r'^([ \t]*)```.*?^\1```', '', open(os.path.join(ROOT, path)).read(),
                flags=re.M | re.S)
  return [Command(m.group(1), f'{path} (inline)', 'in running text')
          for m in re.finditer(r'`((?:[A-Z_]+=\S+ )*(?:taskset -c \d+ )?python3? [^`]+)`', text)]


@functools.lru_cache(maxsize=None)
def inline_commands():
  return [c for p in doc_files() for c in extract_inline(p)]


@functools.lru_cache(maxsize=None)
def all_commands():
  return [c for p in doc_files() for c in extract_commands(p)]


def tokens(text):
  lex = shlex.shlex(text, posix=True, punctuation_chars=True)
  lex.whitespace_split = True
  lex.commenters = '#'
  return list(lex)


def segments(text):
  """The simple commands of a command line: split at && ; | &, redirections dropped."""
  segs, cur, skip = [], [], False
  for t in tokens(text):
    if skip:
      skip = False
      continue
    if t in ('&&', ';', '|', '&', '||'):
      segs.append(cur)
      cur = []
    elif t in ('>', '>>', '<', '2>', '&>') or re.fullmatch(r'\d?>>?', t):
      skip = True
    else:
      cur.append(t)
  segs.append(cur)
  return [s for s in segs if s]


def parse_segment(seg):
  """(cli, args): cli = 'path/to/file.py' or 'module.name' of this repository, 'bash:PATH',
  or None for a segment that is not one of the repository's entry points."""
  i = 0
  while i < len(seg) and re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*=.*', seg[i]):
    i += 1                                               # VAR=value prefixes
  if i < len(seg) and seg[i] == 'taskset':
    i += 3
  if i < len(seg) and seg[i] == '/usr/bin/time':
    i += 1
    while i < len(seg) and seg[i].startswith('-'):
      i += 2
  seg = seg[i:]
  if not seg:
    return None, []
  prog = seg[0]
  if prog == 'bash' and len(seg) > 1:
    return f'bash:{seg[1]}', seg[2:]
  if not re.fullmatch(r'(.*/)?python3?', prog):
    return None, []
  if len(seg) > 2 and seg[1] == '-m':
    return (None if seg[2] in NOT_CLI_MODULES else seg[2]), seg[3:]
  if len(seg) > 1 and seg[1].endswith('.py'):
    return seg[1], seg[2:]
  return None, []


def cli_path(cli):
  if cli.endswith('.py'):
    return os.path.join(ROOT, cli)
  return os.path.join(ROOT, *cli.split('.')) + '.py'


def parse_flags(args):
  """[(name, value or None)] of --name=value / --name value / --name; positionals dropped."""
  out, i = [], 0
  while i < len(args):
    a = args[i]
    if a.startswith('--'):
      if '=' in a:
        name, value = a[2:].split('=', 1)
      elif i + 1 < len(args) and not args[i + 1].startswith('-'):
        name, value = a[2:], args[i + 1]
        i += 1
      else:
        name, value = a[2:], None
      out.append((name, value))
    i += 1
  return out


@functools.lru_cache(maxsize=None)
def cli_spec(cli):
  """(flag names, config flag names, default config source) of an entry point, read from its
  source: absl DEFINE_*, cli.define_config_file / dict, argparse add_argument, and the
  studies' common.run_cli (--config FILE --out DIR)."""
  src = open(cli_path(cli)).read()
  names = set(re.findall(r"DEFINE_\w+\(\s*'(\w+)'", src))
  names |= set(re.findall(r"add_argument\(\s*'--([\w-]+)'", src))
  names |= set(re.findall(r"'--([\w-]+)' in argv", src))
  configs = {}
  for m in re.finditer(r"define_config_(file|dict)\(\s*'(\w+)',\s*([^\n]+)", src):
    configs[m.group(2)] = (m.group(1), m.group(3))
  m = re.search(r"run_cli\(\s*\w+,\s*'[^']*'(?:,\s*'([^']+)')?", src)
  if m:
    names |= {'out'}
    configs['config'] = ('file', m.group(1))
  return names | set(configs), configs


def load_config_file(path):
  """get_config() of a config file (FILE or FILE:ARG); configs/workdir.py reads a run's stored
  config, whose keys are the defaults'."""
  path, _, arg = path.partition(':')
  if os.path.basename(path) == 'workdir.py':
    from sharenet.config import defaults
    return defaults.default_config()
  spec = importlib.util.spec_from_file_location('_docs_config', os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  sys.path.insert(0, ROOT)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


@functools.lru_cache(maxsize=None)
def default_config(cli, name):
  """The config a CLI's --NAME holds when the command names no file."""
  kind, expr = cli_spec(cli)[1][name]
  if kind == 'file':
    m = re.search(r"'configs', '(\w+\.py)'", expr or '')
    if m:
      return load_config_file(f'configs/{m.group(1)}')
    if expr and expr.startswith('configs/'):
      return load_config_file(expr)
    raise AssertionError(f'{cli}: --{name} has no default config file; name one in the command')
  call = re.match(r'([\w.]+)\(\)', expr.strip()).group(1)
  if call.startswith('defaults.'):
    from sharenet.config import defaults
    return getattr(defaults, call.split('.', 1)[1])()
  # a function of the CLI's own module (benchmarks' options()): run its definition alone
  tree = ast.parse(open(cli_path(cli)).read())
  fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == call]
  imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
  namespace = {}
  exec(compile(ast.Module(imports + fn, []), cli_path(cli), 'exec'), namespace)
  return namespace[call]()


def has_key(config, dotted):
  node = config
  for part in dotted.split('.'):
    try:
      if part not in node:
        return False
      node = node[part]
    except TypeError:
      return False
  return True


def check_command(cmd):
  """Problems with a command's entry point and flags (empty: none)."""
  problems = []
  for seg in segments(cmd.text):
    cli, args = parse_segment(seg)
    if cli is None:
      continue
    if cli.startswith('bash:'):
      if not os.path.exists(os.path.join(ROOT, cli[5:])):
        problems.append(f'{cmd}: no script {cli[5:]}')
      continue
    if not os.path.exists(cli_path(cli)):
      problems.append(f'{cmd}: no entry point {cli}')
      continue
    names, configs = cli_spec(cli)
    flags_ = parse_flags(args)
    files = {n: v for n, v in flags_ if n in configs and v}
    for name, value in flags_:
      head, _, key = name.partition('.')
      if key and head in configs:
        if name in files:
          continue
        config = (load_config_file(files[head]) if head in files
                  else default_config(cli, head))
        if not has_key(config, key):
          problems.append(f'{cmd}: --{name}: no key {key!r} in the config of {cli}')
      elif name in configs:
        if value and not os.path.exists(os.path.join(ROOT, value.partition(':')[0])):
          problems.append(f'{cmd}: --{name} {value}: no such file')
      elif name not in names and name not in ABSL_CORE and not (
          name.startswith('no') and name[2:] in names):
        problems.append(f'{cmd}: --{name} is not a flag of {cli}')
  return problems


def cli_of(text):
  return [c for c, _ in (parse_segment(s) for s in segments(text)) if c]


def normalise(text):
  return ' '.join(shlex.quote(t) for t in tokens(text))


def test_commands_flags_exist():
  """Every shown command, long ones included, passes only flags its entry point defines and
  config keys its config has; a renamed flag or key fails here."""
  cmds = all_commands() + inline_commands()
  assert len(cmds) > 20, cmds
  problems = [p for c in cmds for p in check_command(c)]
  assert not problems, '\n'.join(problems)


def env_of(seg):
  """{VAR: value} of a segment's VAR=value prefixes."""
  env = {}
  for t in seg:
    m = re.fullmatch(r'([A-Za-z_][A-Za-z0-9_]*)=(.*)', t)
    if not m:
      break
    env[m.group(1)] = m.group(2)
  return env


def on_eight_devices(seg, args):
  """A command that needs several devices: XLA_FLAGS (simulated devices) or a mesh of more than
  one device (--config.mesh.AXIS=N, N > 1 or -1)."""
  if 'XLA_FLAGS' in env_of(seg):
    return True
  return any(n.startswith('config.mesh.') and v not in (None, '0', '1', 'True', 'False')
             for n, v in parse_flags(args))


def tiny_args(cli, args, eight=False):
  """A shown command's arguments at tiny size (TINY, TINY_CONFIG, TINY_MODEL; EIGHT_DEVICES on
  8 simulated devices; DATA_DOCUMENTS for the data tools); results_tables rewrites a copy of
  docs/results/ (--results)."""
  out, seen = [], set()
  flags_ = parse_flags(args)
  names = {n for n, _ in flags_}
  config = dict(flags_).get('config') if cli == 'train.py' else None
  own_run = bool(config) and os.path.basename(config.partition(':')[0]) == 'workdir.py'
  dry_run = dict(flags_).get('config.dry_run') == 'True'
  extra = {}
  if cli == 'train.py':
    if config is None:
      out += ['--config', os.path.join(ROOT, TINY_CONFIG)]
    elif not own_run and not dry_run:
      extra.update(TINY_MODEL)
    if eight and not own_run:
      extra.update(EIGHT_DEVICES)
      if dry_run and 'config.mesh.fsdp' not in names:
        extra.update(DRY_RUN_EIGHT)
  for name, value in flags_:
    if name in TINY:
      value = TINY[name]
      seen.add(name)
    if name in extra:
      value = extra[name]
      seen.add(name)
    out.append(f'--{name}' if value is None else f'--{name}={value}')
  if cli == 'train.py':
    out += [f'--{k}={v}' for k, v in TINY.items() if k.startswith('config.') and k not in seen]
    out += [f'--{k}={v}' for k, v in extra.items() if k not in seen and k not in names]
  if cli == 'sharenet.studies.results_tables':
    out.append('--results=results_copy')
  if cli in DATA_TOOLS and 'max_documents' not in names:
    out.append(f'--max_documents={DATA_DOCUMENTS}')
  return out


def shown_jobs(run_dir):
  """(one-device jobs, 8-device jobs) for tests/end_to_end/docs_runner.py: every entry point a shown
  command runs that is not marked long (RUN's first, then the docs' in order), each distinct
  one once, at tiny size, in `run_dir`."""
  seen, one, eight = set(), [], []
  texts = list(RUN) + [c.text for c in all_commands() if c.long is None]
  for text in texts:
    for seg in segments(text):
      cli, args = parse_segment(seg)
      key = normalise(' '.join(shlex.quote(t) for t in seg))
      if cli is None or key in seen:
        continue
      seen.add(key)
      many = on_eight_devices(seg, args)
      job = {'cli': cli, 'argv': tiny_args(cli, args, many), 'cwd': str(run_dir), 'text': text}
      (eight if many else one).append(job)
  return one, eight


def test_unmarked_commands_run_here():
  """Every command not marked `# long: T` can run here: its entry points are this repository's
  Python CLIs, it sets no environment but XLA_FLAGS, and it has no placeholder; RUN's commands
  are still shown."""
  shown = {normalise(s) for c in all_commands() for s in
           [' '.join(shlex.quote(t) for t in seg) for seg in segments(c.text)]}
  missing = [r for r in RUN if normalise(r) not in shown]
  assert not missing, f'RUN commands no longer shown in the docs: {missing}'
  bad = []
  for c in all_commands():
    if c.long is not None:
      continue
    for seg in segments(c.text):
      cli, _ = parse_segment(seg)
      if (cli or '').startswith('bash:') or '...' in seg or set(env_of(seg)) - RUNNABLE_ENV:
        bad.append(c)
  assert not bad, ('shown commands that cannot run here, not marked `# long: <measured time>`:'
                   '\n' + '\n'.join(map(repr, bad)))


def _run_jobs(jobs, tmp_path, env, name):
  """Runs `jobs` in one tests/end_to_end/docs_runner.py process; {shown text: [(rc, seconds,
  tail)]}."""
  jobs_path, results = tmp_path / f'{name}.json', tmp_path / f'{name}.jsonl'
  jobs_path.write_text(json.dumps(jobs))
  r = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', 'end_to_end', 'docs_runner.py'),
                      str(jobs_path), str(results)], env=env, capture_output=True, text=True,
                     timeout=900, cwd=ROOT)
  rows = [json.loads(l) for l in results.read_text().splitlines()] if results.exists() else []
  assert len(rows) == len(jobs), f'{name}: the runner stopped\n{r.stdout[-2000:]}{r.stderr[-3000:]}'
  return rows


@pytest.mark.slow
def test_shown_commands_run(tmp_path, subprocess_env):
  """Every shown command that is not marked long runs at tiny size (shown_jobs), one-device
  commands in one process, 8-device ones in another (8 simulated devices), all in one
  directory, in the order shown, so a command reads what the ones before it wrote; each exits
  0. Prints each command's seconds."""
  import numpy as np
  run_dir = tmp_path / 'run'
  run_dir.mkdir()
  for d in LINKED:
    os.symlink(os.path.join(ROOT, d), run_dir / d)
  shutil.copytree(os.path.join(ROOT, 'docs', 'results'), run_dir / RESULTS_LINK[1])
  (run_dir / os.path.dirname(RESULTS_LINK[0])).mkdir()
  os.symlink(run_dir / RESULTS_LINK[1], run_dir / RESULTS_LINK[0])
  (run_dir / 'prompts.txt').write_text(PROMPTS)
  np.random.default_rng(0).integers(0, TOKENS_VOCAB, 20_000).astype(np.uint16).tofile(
      run_dir / 'tokens.bin')
  (run_dir / 'runs').mkdir()
  for stand_in, source in STAND_INS.items():
    os.symlink(os.path.abspath(run_dir / source), run_dir / stand_in)
  one, eight = shown_jobs(run_dir)
  assert len(one) > 20 and len(eight) >= 3, (len(one), len(eight))
  env = dict(subprocess_env, JAX_PLATFORMS='cpu')
  rows = _run_jobs(one, tmp_path, env, 'one')
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
                      ' --xla_cpu_collective_timeout_seconds=900')
  rows += _run_jobs(eight, tmp_path, env, 'eight')
  for r in rows:
    print(f"{r['seconds']:5.1f} s  rc {r['rc']}  {r['text']}")
  failed = [f"{r['text']}\n{r['tail']}" for r in rows if r['rc'] != 0]
  assert not failed, '\n\n'.join(failed)


def _mkdocs_build(root, site):
  """`mkdocs build --strict` of the site at `root` (warnings printed: -q would hide them, and
  --strict then passes a broken link)."""
  return subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--strict', '-d', str(site)],
                        cwd=root, capture_output=True, text=True,
                        env=dict(os.environ, NO_MKDOCS_2_WARNING='1'), timeout=170)


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
  """The site builds with --strict: no broken link or anchor, every page in the navigation."""
  r = _mkdocs_build(ROOT, tmp_path / 'site')
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


@pytest.mark.parametrize('damage, words', [
    ('link', 'missing_page.md'),          # a link to a page that does not exist
    ('page', 'not included in the "nav"'),  # a page the navigation omits
])
@pytest.mark.slow
def test_mkdocs_build_fails_on_a_broken_site(tmp_path, damage, words):
  """The same build fails on a copy of the site with one broken link or one page left out."""
  shutil.copytree(os.path.join(ROOT, 'docs'), tmp_path / 'docs')
  shutil.copy(os.path.join(ROOT, 'mkdocs.yml'), tmp_path / 'mkdocs.yml')
  if damage == 'link':
    with open(tmp_path / 'docs' / 'index.md', 'a') as f:
      f.write('\nSee [the missing page](missing_page.md).\n')
  else:
    (tmp_path / 'docs' / 'orphan.md').write_text('# Orphan\n')
  r = _mkdocs_build(tmp_path, tmp_path / 'site')
  assert r.returncode != 0 and words in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]


def test_results_tables_are_generated():
  """Every measured table under docs/results/ is what its JSON generates."""
  from sharenet.studies import results_tables
  for table, text in results_tables.generate().items():
    with open(os.path.join(results_tables.RESULTS, table)) as f:
      assert f.read() == text, (f'docs/results/{table} differs from its JSON: run python -m '
                                'sharenet.studies.results_tables')


def git_files():
  r = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True)
  if r.returncode != 0:
    pytest.skip('not a git checkout')
  return set(r.stdout.split())


def test_readme_is_short_and_its_layout_exists():
  text = open(os.path.join(ROOT, 'README.md')).read()
  assert text.count('\n') <= 250
  layout = re.search(r'^## Layout\n.*?```\n(.*?)```', text, re.M | re.S).group(1)
  named = set(re.findall(r'`([^`\s]+)`', layout))
  files = git_files()
  dirs = {os.path.dirname(f) for f in files}
  dirs |= {d2 for d in dirs for d2 in [os.path.dirname(d)] if d2}
  missing = [p for p in named if p.rstrip('/') not in files and p.rstrip('/') not in dirs]
  assert not missing, f'README Layout names paths git does not have: {missing}'
  packages = {os.path.dirname(f) for f in files if f.endswith('/__init__.py')}
  top = {f.split('/')[0] for f in files if '/' in f and not f.startswith('.')}
  unnamed = [p for p in sorted(packages | top)
             if p + '/' not in named and p not in named and not p.startswith('tests/')]
  assert not unnamed, f'README Layout does not name: {unnamed}'
  for link in re.findall(r'\]\(([^)#\s]+)', text):
    if not re.match(r'https?:', link):
      assert link.rstrip('/') in files or link.rstrip('/') in dirs, f'README link {link}'


def test_generated_tables_are_not_copied():
  """No hand-written table row (README, pages, study READMEs) repeats three or more measured
  numbers (3+ decimals or thousands) of one row of a generated table: pages link to it instead."""
  from sharenet.studies import results_tables
  # numbers specific enough to identify a measurement: >= 1 with 3+ decimals, or thousands
  number = re.compile(r'(?<![\w.+-])[1-9]\d*\.\d{3,}|(?<![\w.])\d{1,3}(?:,\d{3})+')
  generated = {os.path.join('docs', 'results', t) for t in results_tables.TABLES}
  rows = []
  for table in generated:
    for line in open(os.path.join(ROOT, table)):
      found = set(number.findall(line))
      if line.startswith('|') and len(found) >= 3:
        rows.append((table, found))
  copies = []
  for path in doc_files():
    if path in generated or path == os.path.join('docs', 'compatibility.md'):
      continue
    for i, line in enumerate(open(os.path.join(ROOT, path)), 1):
      if line.startswith('|'):
        found = set(number.findall(line))
        copies += [f'{path}:{i} copies a row of {t}' for t, r in rows if len(found & r) >= 3]
  assert not copies, '\n'.join(copies)
