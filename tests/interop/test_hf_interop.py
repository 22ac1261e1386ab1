"""Hugging Face checkpoints in and out (sharenet/interop/), on the committed tiny fixtures.

tests/fixtures/hf/<arch>/ were built by tests/fixtures/make_hf_fixtures.py with transformers;
their reference.npz holds transformers' own logits, so every check here runs without torch.
Where transformers is importable, the exported directories are also loaded by it live.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.config import defaults
from sharenet.main import convert_workdir, eval_workdir
from sharenet.train import workdir_io
from sharenet.errors import ConfigError
from sharenet.interop import export_hf, import_hf, safetensors_io
from sharenet.models import ModelConfig

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'fixtures',
                        'hf')
ARCHS = ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2', 'gpt2', 'llama3_rope')


def _logits(workdir, tokens, dtype='float32'):
  """Logits of `workdir`'s latest checkpoint on `tokens` (1, T), in `dtype`."""
  config = workdir_io.load_config(workdir)
  state, _, exp = workdir_io.restore_state(config, workdir)
  model, params = exp.model, state.params
  if dtype != 'float32':
    model = type(model)(model.cfg.derive(dtype=dtype, param_dtype=dtype))
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
  return np.asarray(jax.jit(model.apply)(params, jnp.asarray(tokens)))


def _reference(arch):
  return np.load(os.path.join(FIXTURES, arch, 'reference.npz'))


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  """{arch: workdir} of every fixture, imported once for the module."""
  root = tmp_path_factory.mktemp('imported')
  return {a: import_hf.import_hf(os.path.join(FIXTURES, a), str(root / a))['workdir']
          for a in ARCHS}


@pytest.mark.slow
@pytest.mark.parametrize('arch', [pytest.param(a, marks=pytest.mark.slow) if a == 'llama' else a
                                  for a in ARCHS])
def test_import_matches_transformers_logits(imported, arch):
  ref = _reference(arch)
  err = np.abs(_logits(imported[arch], ref['tokens']) - ref['logits']).max()
  assert err <= 1e-4, (arch, err)


def test_fixtures_stay_small():
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(FIXTURES) for f in fs)
  assert size < 800_000, size


def _copy_fixture(tmp_path, arch):
  src = tmp_path / f'src_{arch}'
  shutil.copytree(os.path.join(FIXTURES, arch), src)
  return src


def _edit_config(src, **changes):
  path = src / 'config.json'
  hf = json.loads(path.read_text())
  hf.update(changes)
  path.write_text(json.dumps(hf))


@pytest.mark.parametrize('case,match', [
    ('no_dir', 'is not a directory'),
    ('no_config', 'has no config.json'),
    ('arch', r"model_type='gemma3' is not supported; valid: llama, mistral"),
    ('rope_scaling', r"rope_scaling='yarn' is not modelled by sharenet \(valid: null, "
                     r"default, linear, llama3\)"),
    ('activation', r"hidden_act='relu' is not modelled"),
    ('missing_shard', 'the shard index names model-00002-of-00003.safetensors, which is missing'),
    ('dtype', 'has dtype I8, which sharenet cannot hold'),
    ('extra_tensor', 'tensor lm_head.weight is not modelled'),
])
def test_bad_input_is_one_error_and_writes_nothing(tmp_path, case, match):
  src = _copy_fixture(tmp_path, 'llama')
  if case == 'no_dir':
    shutil.rmtree(src)
  elif case == 'no_config':
    (src / 'config.json').unlink()
  elif case == 'arch':
    _edit_config(src, model_type='gemma3')
  elif case == 'rope_scaling':
    _edit_config(src, rope_scaling={'rope_type': 'yarn', 'factor': 8.0})
  elif case == 'activation':
    _edit_config(src, hidden_act='relu')
  elif case == 'missing_shard':
    (src / 'model-00002-of-00003.safetensors').unlink()
  elif case == 'dtype':
    _write_one(src, 'model.layers.0.input_layernorm.weight', 'I8')
  else:   # a readout in a tied model: the checkpoint holds what config.json does not describe
    _edit_config(src, tie_word_embeddings=True)
  out = tmp_path / 'out'
  with pytest.raises(ConfigError, match=match) as e:
    import_hf.import_hf(str(src), str(out))
  assert '\n' not in str(e.value)
  assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [src.name] * src.exists()


@pytest.mark.slow
@pytest.mark.parametrize('arch', ['mistral', 'gemma2'])
def test_sliding_window_imports_exact_within_its_window(tmp_path, arch, tiny_config):
  """A 16-token window below max_position_embeddings=64 (Mistral: every layer; Gemma 2: its
  sliding layers): imported as model.attention_window=16 with max_len capped to 16, so the
  12-token reference prompt (within the window, where sliding equals full attention) gives the
  reference logits, and a longer context is one error line."""
  from sharenet.train import experiment
  from sharenet.models import ModelConfig
  src = _copy_fixture(tmp_path, arch)
  _edit_config(src, sliding_window=16, max_position_embeddings=64)
  out = tmp_path / 'out'
  import_hf.import_hf(str(src), str(out))
  config = json.loads((out / 'config.json').read_text())
  assert (config['model']['attention_window'], config['model']['max_len']) == (16, 16)
  assert config['train']['seq_len'] <= 16
  ref = np.load(os.path.join(FIXTURES, arch, 'reference.npz'))
  logits = _logits(str(out), ref['tokens'])
  np.testing.assert_allclose(logits, ref['logits'], atol=1e-4)
  with pytest.raises(ConfigError, match=r'train.seq_len=32 exceeds model.attention_window=16.*'
                                        r'valid: train.seq_len <= 16') as e:
    experiment.validate(tiny_config(**{'model.attention_window': 16, 'model.max_len': 16,
                                       'train.seq_len': 32}))
  assert '\n' not in str(e.value)
  with pytest.raises(ConfigError, match='attention_window=16 with model.max_len=64.*valid: 0, '
                                        'or >= model.max_len'):
    ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, mlp_dim=64,
                attention_window=16, max_len=64)


def _write_one(src, name, dtype):
  """Rewrites the shard holding `name` with that tensor stored as `dtype` (int8 bytes)."""
  files = safetensors_io.open_model(str(src))
  st = files[name]
  header = {n: dict(st.entries[n]) for n in st.names()}
  raw = {n: st.read(n) for n in st.names()}
  blobs, offset = [], 0
  for n in header:
    data = raw[n].astype(np.int8 if n == name else np.float32).tobytes()
    header[n].update(dtype=dtype if n == name else 'F32', data_offsets=[offset, offset + len(data)])
    blobs.append(data)
    offset += len(data)
  text = json.dumps(header).encode()
  with open(st.path, 'wb') as f:
    f.write(len(text).to_bytes(8, 'little') + text + b''.join(blobs))


@pytest.mark.slow
def test_cli_error_is_one_line_and_out_untouched(tmp_path, repo_root):
  src = _copy_fixture(tmp_path, 'gpt2')
  _edit_config(src, model_type='bert')
  out = tmp_path / 'out'
  out.mkdir()
  env = dict(os.environ, PYTHONPATH=repo_root)
  r = subprocess.run([sys.executable, '-m', 'sharenet.interop.import_hf', f'--model={src}',
                      f'--out={out}'], capture_output=True, text=True, env=env, cwd=repo_root)
  assert r.returncode == 2, r.stderr
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and "model_type='bert' is not supported" in lines[0], r.stderr
  assert list(out.iterdir()) == []


@pytest.mark.parametrize('arch', ['llama', 'gpt2'])
def test_the_streamed_import_is_the_in_memory_save(imported, tmp_path, arch):
  """The import writes its checkpoint leaf by leaf (orbax_io.save_streamed): the state
  restores bit for bit as save_workdir's in-memory save of the same parameters, with the same
  tree, metadata tree, saved config and config.json."""
  from flax.traverse_util import flatten_dict
  from sharenet.checkpoint import orbax_io
  from sharenet.interop import hf_arch
  import ml_collections
  import orbax.checkpoint as ocp
  src, new = os.path.join(FIXTURES, arch), imported[arch]
  hf, keys = hf_arch.model_keys(import_hf.read_hf_config(src))
  has_tok = os.path.isfile(os.path.join(src, import_hf.TOKENIZER))
  raw = import_hf.experiment_config(keys, os.path.join(new, import_hf.TOKENIZER) if has_tok
                                    else None)
  cfg = ModelConfig.from_experiment(ml_collections.ConfigDict(raw))
  ref = str(tmp_path / 'ref')
  workdir_io.save_workdir(ref, raw, cfg, {'params': import_hf.read_params(src, hf, cfg)}, 0,
                           {'imported_from': src, 'hf_model_type': hf}, optimizer_state=False)
  read = lambda p: json.loads(open(p).read())
  assert read(os.path.join(new, 'config.json')) == read(os.path.join(ref, 'config.json'))
  meta = 'checkpoints/0/state/_METADATA'
  assert read(os.path.join(new, meta))['tree_metadata'] == \
      read(os.path.join(ref, meta))['tree_metadata']
  m_new, m_ref = (orbax_io.manager(w, 3, async_save=False) for w in (new, ref))
  assert m_new.all_steps() == m_ref.all_steps() == [0]
  assert orbax_io.saved_config(m_new, 0) == orbax_io.saved_config(m_ref, 0)
  tree = orbax_io._saved_tree(m_ref, 0)
  args = ocp.args.PyTreeRestore(restore_args=jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
  a, b = (flatten_dict(ocp.PyTreeCheckpointer().restore(orbax_io._state_dir(m, 0), args=args))
          for m in (m_new, m_ref))
  assert a.keys() == b.keys()
  for k in a:
    if a[k] is None or b[k] is None:   # opt_state: none saved
      assert a[k] is None and b[k] is None, k
      continue
    x, y = np.atleast_1d(a[k]), np.atleast_1d(b[k])
    assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), k


@pytest.mark.slow
def test_a_failure_midway_through_the_import_leaves_nothing(tmp_path, monkeypatch):
  """A tensor that fails to read after some parameters are already written (staged by the
  streamed checkpoint save) leaves nothing at --out and no staging directory."""
  out = tmp_path / 'out'
  read, calls, staged = safetensors_io.SafetensorsFile.read, [], []

  def failing_read(self, name):
    calls.append(name)
    if len(calls) == 30:   # of the llama fixture's 39 tensors
      staged.extend(os.listdir(next(tmp_path.glob('out.import-*.tmp/.stream-0'))))
      raise OSError(f'{name}: input/output error')
    return read(self, name)

  monkeypatch.setattr(safetensors_io.SafetensorsFile, 'read', failing_read)
  with pytest.raises(OSError, match='input/output error'):
    import_hf.import_hf(os.path.join(FIXTURES, 'llama'), str(out))
  assert staged, 'no parameter was staged before the failure'
  assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize('arch', ARCHS)
def test_export_round_trip(imported, tmp_path, arch):
  """import -> export: the same tensors as the source checkpoint (Gemma's 1 + w within a
  float32 rounding); export -> import: the same parameters."""
  out = tmp_path / 'hf'
  export_hf.export_hf(imported[arch], str(out))
  src, dst = safetensors_io.open_model(os.path.join(FIXTURES, arch)), safetensors_io.open_model(
      str(out))
  from sharenet.interop import hf_arch
  kept = {n for n in src if not hf_arch.ignored(arch, n)}
  assert kept == set(dst)
  for n in kept:
    np.testing.assert_allclose(dst[n].read(n), src[n].read(n), rtol=0, atol=1e-6, err_msg=n)
  if arch in ('llama', 'gemma', 'gpt2'):   # one per tensor layout; the others share llama's
    again = import_hf.import_hf(str(out), str(tmp_path / 'again'))['workdir']
    ref = _reference(arch)
    np.testing.assert_allclose(_logits(again, ref['tokens']),
                               _logits(imported[arch], ref['tokens']), rtol=0, atol=1e-6)


@pytest.mark.parametrize('arch', ARCHS)
def test_transformers_loads_the_export(imported, tmp_path, arch):
  """Where transformers and torch are importable (not dependencies of the suite): the export
  of an imported fixture, loaded by transformers itself, gives the fixture's logits."""
  transformers = pytest.importorskip('transformers')
  torch = pytest.importorskip('torch')
  out = tmp_path / 'hf'
  export_hf.export_hf(imported[arch], str(out))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  ref = _reference(arch)
  with torch.no_grad():
    logits = model(torch.tensor(ref['tokens'], dtype=torch.long)).logits.numpy()
  assert np.abs(logits - ref['logits']).max() <= 1e-4


def test_export_refuses_what_no_architecture_holds():
  base = ModelConfig.from_config(defaults.default_config().model)
  assert export_hf.export_arch(base) == 'llama'
  assert export_hf.export_arch(base.derive(proj_bias='qkv')) == 'qwen2'
  for change, match in (({'sharing': {'scheme': 'cycle', 'num_unique': 2, 'lora_rank': 2}},
                         'model.sharing.lora_rank=2'),
                        ({'norm': {'placement': 'peri'}}, 'model.norm.placement=peri'),
                        ({'mlp': 'gelu'}, 'model.mlp=gelu'),
                        ({'embed_dim': 64}, 'model.embed_dim=64 \\(factorized embeddings\\)')):
    with pytest.raises(ConfigError, match=match):
      export_hf.export_arch(base.derive(**change))


@pytest.mark.slow
def test_gpt2_layernorm_to_rmsnorm_to_crmsnorm_is_exact_in_float64(imported):
  """The Pre-LN -> Pre-RMSNorm -> Pre-CRMSNorm conversions (Jiang et al., arXiv:2305.14858)
  on imported GPT-2, whose every projection has a bias: the same logits in float64."""
  from sharenet.models import DecoderLM
  from sharenet.transforms import convert
  config = workdir_io.load_config(imported['gpt2'])
  state, _, exp = workdir_io.restore_state(config, imported['gpt2'])
  tokens = jnp.asarray(_reference('gpt2')['tokens'])
  with jax.enable_x64(True):
    cfg = exp.model.cfg.derive(dtype='float64', param_dtype='float64')
    v0 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), state.params)
    logits0 = DecoderLM(cfg).apply(v0, tokens)
    cfg1, v1 = convert.ln_to_rms(cfg, v0)
    cfg2, v2 = convert.rms_to_crms(cfg1, v1)
    logits2 = DecoderLM(cfg2).apply(v2, tokens)
    err = float(jnp.max(jnp.abs(logits2 - logits0)))
  assert cfg2.norm.kind == 'crmsnorm' and cfg2.d_model == cfg.d_model - 1
  assert err <= 1e-9, err
  assert np.abs(np.asarray(logits0) - _reference('gpt2')['logits']).max() <= 1e-4


def _convert(src, out, **opts):
  o = defaults.conversion_config()
  o.update(opts)
  convert_workdir.convert_workdir(src, str(out), o)
  return str(out)


@pytest.mark.slow
def test_llama_to_recursive_at_full_svd_rank_equals_the_import(imported, tmp_path):
  """convert.py --config.to=recursive on imported Llama (Relaxed Recursive Transformers,
  arXiv:2410.20672): a cycle of 2 averaged sets with depth-wise LoRA from the SVD of each
  layer's residual at full rank and per-layer norms reproduces the imported model."""
  ref = _reference('llama')
  out = _convert(imported['llama'], tmp_path / 'rec', to='recursive', scheme='cycle',
                 num_unique=2, init='average', lora_rank=32, lora_init='svd',
                 lora_targets='q,k,v,o,mlp_in,mlp_out', untie_norms=True)
  assert workdir_io.load_config(out).model.sharing.scheme == 'cycle'
  assert np.abs(_logits(out, ref['tokens']) - ref['logits']).max() <= 1e-4
  with pytest.raises(ConfigError, match='lora_rank=32'):   # LoRA has no Hugging Face form
    export_hf.export_hf(out, str(tmp_path / 'hf'))
  assert not (tmp_path / 'hf').exists()


@pytest.mark.slow
def test_tied_plan_exports_expanded(imported, tmp_path, capsys):
  """A recursive (tied) conversion exports as its applied layers: re-imported, the same
  logits as the tied workdir."""
  ref = _reference('llama')
  tied = _convert(imported['llama'], tmp_path / 'rec', to='recursive', scheme='cycle',
                  num_unique=2, init='stepwise')
  export_hf.export_hf(tied, str(tmp_path / 'hf'))
  assert 'written expanded to its 4 applied layers' in capsys.readouterr().out
  assert json.loads((tmp_path / 'hf' / 'config.json').read_text())['num_hidden_layers'] == 4
  again = import_hf.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'again'))['workdir']
  np.testing.assert_allclose(_logits(again, ref['tokens']), _logits(tied, ref['tokens']),
                             rtol=0, atol=1e-5)


def test_eval_generates_greedily_with_the_imported_tokenizer(imported):
  """eval.py --prompt's library call on an imported model: its tokenizer encodes the prompt,
  and the first greedy token is the argmax of the imported model's logits."""
  from sharenet.data import corpus
  workdir = imported['llama']
  (row,) = eval_workdir.generate_from_workdir(
      workdir, None, {}, ['Hello world'], max_new_tokens=3, temperature=0.0, top_k=0,
      top_p=1.0, seed=0, num_samples=1, eos_id=None)
  assert row['num_tokens'] == 3
  tok = corpus.for_data(workdir_io.load_config(workdir).data)
  prompt = tok.encode('Hello world')
  first = int(np.argmax(_logits(workdir, prompt[None].astype(np.int32))[0, -1]))
  assert row['text'].startswith(tok.decode([first]))


@pytest.mark.slow
def test_train_continues_an_imported_workdir(imported, tmp_path, repo_root):
  """train.py --config configs/workdir.py:W continues an import on the user's token ids (a
  fresh optimizer state: the imported config has train.restore=params)."""
  workdir = str(tmp_path / 'w')
  shutil.copytree(imported['llama'], workdir)
  tokens = tmp_path / 'tokens.bin'
  np.random.default_rng(0).integers(0, 63, 20000).astype(np.uint16).tofile(tokens)
  env = dict(os.environ, PYTHONPATH=repo_root)
  r = subprocess.run([sys.executable, os.path.join(repo_root, 'train.py'),
                      f'--config={repo_root}/configs/workdir.py:{workdir}', f'--workdir={workdir}',
                      '--config.data.source=bin', f'--config.data.path={tokens}',
                      '--config.train.steps=2', '--config.train.batch_size=2',
                      '--config.train.seq_len=16', '--config.train.eval_batch_size=2',
                      '--config.data.eval_tokens=64', '--config.train.warmup_steps=1',
                      '--config.train.progress=False'],
                     capture_output=True, text=True, env=env, cwd=repo_root)
  assert r.returncode == 0, r.stderr[-2000:]
  assert 'optimizer state is fresh' in r.stdout
  assert np.isfinite(json.loads(r.stdout.strip().splitlines()[-1])['eval_loss'])


def test_gpt2_head_shared_copies_whole_heads_with_their_biases(imported, tmp_path):
  """convert.py --config.to=head_shared (DirectShare, arXiv:2402.11819) on imported GPT-2:
  each replaced head is its source head, q / k / v biases included."""
  from sharenet.models import layout as model_layout
  out = _convert(imported['gpt2'], tmp_path / 'hs', to='head_shared', share_rate=0.25)
  record = json.loads((tmp_path / 'hs' / 'config.json').read_text())['head_sharing']
  assert len(record['replaced']) == 2 and record['distinct_heads'] == record['heads'] - 2
  config = workdir_io.load_config(out)
  state, _, exp = workdir_io.restore_state(config, out)
  layers = model_layout.applied_params(state.params['params'], exp.model.cfg)
  for r in record['replaced']:
    for t in 'qkv':
      for leaf in ('kernel', 'bias'):
        a = np.asarray(layers[('attn', t, leaf)])
        head = (lambda x, l, h: x[l, :, h]) if leaf == 'kernel' else (lambda x, l, h: x[l, h])
        np.testing.assert_array_equal(head(a, r['layer'], r['head']),
                                      head(a, r['source_layer'], r['source_head']))


@pytest.mark.slow
def test_llama_recursive_error_shrinks_with_the_svd_rank(imported):
  """Relaxed Recursive Transformers' trade-off on imported Llama: the distance of a cycle of
  2 averaged sets to the import falls as the SVD-LoRA rank grows, and vanishes at full rank."""
  from sharenet.models import DecoderLM
  from sharenet.transforms import recursive
  config = workdir_io.load_config(imported['llama'])
  state, _, exp = workdir_io.restore_state(config, imported['llama'])
  tokens = jnp.asarray(_reference('llama')['tokens'])
  ref = np.asarray(jax.jit(exp.model.apply)(state.params, tokens))
  errs = []
  for rank in (0, 8, 16, 32):
    rcfg, rv = recursive.to_recursive(exp.model.cfg, state.params, scheme='cycle',
                                      num_unique=2, init='average', lora_rank=rank,
                                      lora_init='svd',
                                      lora_targets=('q', 'k', 'v', 'o', 'mlp_in', 'mlp_out'),
                                      untie_norms=True, lora_layers='shared')
    errs.append(float(np.abs(np.asarray(jax.jit(DecoderLM(rcfg).apply)(rv, tokens)) - ref).max()))
  assert errs[0] > errs[1] > errs[2] > errs[3] and errs[3] <= 1e-4, errs


def _hf_llama3_freq(theta, d, factor, low, high, original):
  """transformers' _compute_llama3_parameters restated in numpy, loop by loop."""
  out = []
  for i in range(0, d, 2):
    f = 1.0 / theta ** (i / d)
    wavelen = 2 * math.pi / f
    if wavelen < original / high:
      out.append(f)
    elif wavelen > original / low:
      out.append(f / factor)
    else:
      s = (original / wavelen - low) / (high - low)
      out.append((1 - s) * f / factor + s * f)
  return np.array(out)


def test_rope_scaling_frequencies_and_bad_input():
  """llama3 and linear RoPE frequencies against a restatement of transformers' formulas, with
  every band of llama3's piecewise rule present; bad keys are one line."""
  from sharenet.models import positions
  llama3 = dict(kind='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_len=32)
  cfg = ModelConfig(d_model=32, num_heads=4, num_layers=1, mlp_dim=8, vocab_size=16,
                    rope_base=500.0, rope_scaling=llama3)
  plain = 500.0 ** (-np.arange(0, 8, 2) / 8)
  got = positions.frequencies(cfg, 8)
  np.testing.assert_allclose(got, _hf_llama3_freq(500.0, 8, 8.0, 1.0, 4.0, 32), rtol=1e-12)
  kept, divided = got == plain, np.isclose(got, plain / 8)
  assert kept.sum() == 1 and divided.sum() == 2, got / plain   # and one smoothed between
  linear = cfg.derive(rope_scaling=dict(kind='linear', factor=4.0))
  np.testing.assert_allclose(positions.frequencies(linear, 8), plain / 4, rtol=1e-12)
  for kw, words in ((dict(rope_scaling=dict(kind='linear', factor=0.5)), 'factor=0.5 must be'),
                    (dict(rope_scaling=dict(llama3, high_freq_factor=1.0)), 'valid: 0 < low'),
                    (dict(rope_scaling=dict(kind='ntk')), 'valid: none, linear, llama3'),
                    (dict(rope_scaling=llama3, position='learned'),
                     'this position kind does not use')):
    with pytest.raises(ConfigError, match=words) as e:
      ModelConfig(d_model=32, num_heads=4, num_layers=1, mlp_dim=8, vocab_size=16, **kw)
    assert '\n' not in str(e.value)


def test_softcaps_bend_logits_and_bad_values_are_one_line():
  """model.logit_softcap maps logits to cap * tanh(logits / cap); a negative cap is one line."""
  from sharenet.models import DecoderLM, init_variables
  base = dict(d_model=16, num_heads=2, num_layers=1, mlp_dim=16, vocab_size=32)
  cfg = ModelConfig(**base)
  v = init_variables(DecoderLM(cfg), jax.random.key(0))
  toks = jnp.arange(8)[None] % 32
  plain = np.asarray(DecoderLM(cfg).apply(v, toks))
  capped = np.asarray(DecoderLM(cfg.derive(logit_softcap=0.5)).apply(v, toks))
  np.testing.assert_allclose(capped, 0.5 * np.tanh(plain / 0.5), rtol=1e-5, atol=1e-6)
  for name in ('attn_softcap', 'logit_softcap'):
    with pytest.raises(ConfigError, match=f'model.{name}=-1.0 must be >= 0') as e:
      ModelConfig(**base, **{name: -1.0})
    assert '\n' not in str(e.value)


def test_similarity_groups_is_the_best_contiguous_split():
  """similarity.similarity_groups (init=similar) against an exhaustive search over every
  split of the layers into K contiguous groups and every choice of their representatives."""
  import itertools
  from sharenet.transforms import similarity
  rng = np.random.default_rng(0)
  L = 6
  sim = rng.uniform(-1, 1, (L, L))
  for K in range(1, L + 1):
    best = -np.inf
    for cuts in itertools.combinations(range(1, L), K - 1):
      bounds = (0,) + cuts + (L,)
      best = max(best, sum(max(sim[a:b, r].sum() for r in range(a, b))
                           for a, b in zip(bounds, bounds[1:])))
    groups, reps = similarity.similarity_groups(sim, K)
    assert groups == sorted(groups) and sorted(set(groups)) == list(range(K))
    assert all(groups[r] == g for g, r in enumerate(reps))
    assert sum(sim[l, reps[groups[l]]] for l in range(L)) == pytest.approx(best)


@pytest.mark.slow
def test_llama_folded_by_output_similarity(imported, tmp_path):
  """FoldGPT-style folding of imported Llama (convert.py --config.to=recursive
  --config.scheme=explicit --config.init=similar): the captured layer outputs are the model's
  own stream (their mean |x| is what the block sows as 'residual'); each group's set is its
  representative's weights; with SVD LoRA at full rank (pruned-block replacement) the folded
  model equals the import; without a calibration batch or with a mismatched scheme it is one
  error line."""
  from flax.traverse_util import flatten_dict
  from sharenet.models import layout
  from sharenet.models.layers import INTERMEDIATES
  from sharenet.transforms import similarity
  text = tmp_path / 'calibration.txt'
  text.write_text('the quick brown fox jumps over the lazy dog. ' * 40)
  config = workdir_io.load_config(imported['llama'])
  state, _, exp = workdir_io.restore_state(config, imported['llama'])
  cfg = exp.model.cfg
  o = defaults.conversion_config()
  o.update(calibration=str(text), calibration_windows=4)
  tokens = convert_workdir.calibration_tokens(config, o, cfg.max_len)
  h = similarity.layer_outputs(cfg, state.params, tokens)
  _, sown = exp.model.apply(state.params, jnp.asarray(tokens), mutable=[INTERMEDIATES])
  residual = [np.ravel(v) for p, v in flatten_dict(sown[INTERMEDIATES]).items()
              if p[-1] == 'residual']
  np.testing.assert_allclose(np.abs(h).mean(axis=(1, 2, 3)), np.concatenate(residual),
                             rtol=1e-5)
  opts = dict(to='recursive', scheme='explicit', init='similar', num_unique=2,
              calibration=str(text), calibration_windows=4)
  folded = _convert(imported['llama'], tmp_path / 'fold', **opts)
  pattern = [int(p) for p in workdir_io.load_config(folded).model.sharing.pattern.split(',')]
  groups, reps = similarity.similarity_groups(similarity.output_similarity(h), 2)
  assert pattern == groups and len(pattern) == cfg.num_layers
  fstate, _, fexp = workdir_io.restore_state(workdir_io.load_config(folded), folded)
  src = layout.applied_params(state.params['params'], cfg)
  sets = layout.unique_sets(fstate.params['params'], fexp.model.cfg)
  for path, stored in sets.items():
    np.testing.assert_array_equal(np.asarray(stored), np.asarray(src[path])[reps])
  ref = _reference('llama')
  exact = _convert(imported['llama'], tmp_path / 'replaced', lora_rank=32, lora_init='svd',
                   lora_targets='q,k,v,o,mlp_in,mlp_out', untie_norms=True, **opts)
  assert np.abs(_logits(exact, ref['tokens']) - ref['logits']).max() <= 1e-4
  with pytest.raises(ConfigError, match='--config.calibration=TEXT_FILE'):
    _convert(imported['llama'], tmp_path / 'nocal', **{**opts, 'calibration': ''})
  with pytest.raises(ConfigError, match='valid: those with scheme=explicit'):
    _convert(imported['llama'], tmp_path / 'mixed', **{**opts, 'init': 'average'})
  assert not (tmp_path / 'nocal').exists() and not (tmp_path / 'mixed').exists()


MESH_IMPORT = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
from sharenet.train import workdir_io
from sharenet.interop import hf_arch, import_hf
from sharenet.models import ModelConfig
import ml_collections
src, out = sys.argv[1], sys.argv[2]
arch, keys = hf_arch.model_keys(import_hf.read_hf_config(src))
raw = import_hf.experiment_config(keys, None)
raw['mesh'].update(import_hf.mesh_overrides('fsdp=4,tensor=2'))
cfg = ModelConfig.from_experiment(ml_collections.ConfigDict(raw))
shardings = import_hf.param_shardings(raw, cfg)
params = import_hf.read_params(src, arch, cfg, shardings)
flat = {k: v for k, v in import_hf.flatten_dict(params).items()}
placed = all(v.sharding == shardings[k] for k, v in flat.items())
split = sum(v.addressable_shards[0].data.shape != v.shape for v in flat.values())
import_hf.import_hf(src, out, mesh='fsdp=4,tensor=2')
config = workdir_io.load_config(out)
state, _, exp = workdir_io.restore_state(config, out)
ref = np.load(src + '/reference.npz')
err = float(np.abs(np.asarray(exp.model.apply(state.params, jnp.asarray(ref['tokens'])))
                   - ref['logits']).max())
print(json.dumps({'placed': placed, 'split': split, 'leaves': len(flat), 'err': err,
                  'mesh': [config.mesh.fsdp, config.mesh.tensor]}))
'''


@pytest.mark.slow
def test_import_under_a_mesh_places_each_tensor_in_its_sharding(tmp_path, subprocess_env,
                                                                 repo_root):
  """import_hf --mesh fsdp=4,tensor=2 on 8 simulated devices: every parameter is created in
  its NamedSharding (most of them split over the devices, none gathered first), the workdir's
  config.mesh is the import's, and its checkpoint restores to the reference logits."""
  env = dict(subprocess_env)
  env['XLA_FLAGS'] = env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  r = subprocess.run([sys.executable, '-c', MESH_IMPORT, os.path.join(FIXTURES, 'llama'),
                      str(tmp_path / 'wd')], cwd=repo_root, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(r.stdout.strip().splitlines()[-1])
  assert res['placed'] and res['mesh'] == [4, 2], res
  assert res['split'] >= res['leaves'] // 2, res
  assert res['err'] <= 1e-4, res
  with pytest.raises(ConfigError, match='valid axes: data, fsdp, tensor, expert'):
    import_hf.mesh_overrides('fsdp=4,pipeline=2')
