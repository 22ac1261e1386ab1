"""LoRA out as a Hugging Face PEFT adapter (sharenet/interop/export_peft.py), checked without torch:
the file layout and tensor names peft reads, and the adapter merged into the base with numpy
(what peft's merge computes: W + alpha / r * B A), imported back, gives the workdir's logits."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharenet.config import defaults
from sharenet.errors import ConfigError
from sharenet.interop import export_peft, import_hf, safetensors_io
from sharenet.main import convert_workdir
from sharenet.train import workdir_io

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama')


def _logits(workdir, tokens):
  config = workdir_io.load_config(workdir)
  state, _, exp = workdir_io.restore_state(config, workdir)
  from sharenet.train import trainer
  variables = trainer.effective_params(state, exp.tr)
  return np.asarray(jax.jit(exp.model.apply)(variables, jnp.asarray(tokens)))


@pytest.fixture(scope='module')
def relaxed(tmp_path_factory):
  """The Llama fixture imported and converted to a cycle of 2 sets with depth-wise SVD LoRA of
  rank 4 (below full rank: the adapters differ per layer and do not recover the import)."""
  root = tmp_path_factory.mktemp('peft')
  imported = import_hf.import_hf(LLAMA, str(root / 'llama'))['workdir']
  o = defaults.conversion_config()
  o.update(to='recursive', scheme='cycle', num_unique=2, init='average', lora_rank=4,
           lora_init='svd', lora_targets='q,k,v,o,mlp_in,mlp_out')
  out = str(root / 'rec')
  convert_workdir.convert_workdir(imported, out, o)
  return out


@pytest.mark.slow
def test_adapter_layout_and_names(relaxed, tmp_path):
  info = export_peft.export_peft(relaxed, str(tmp_path / 'base'), str(tmp_path / 'adapter'))
  cfg = json.loads((tmp_path / 'adapter' / export_peft.ADAPTER_CONFIG).read_text())
  assert cfg['peft_type'] == 'LORA' and cfg['r'] == 4 and cfg['task_type'] == 'CAUSAL_LM'
  assert cfg['target_modules'] == ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj',
                                   'up_proj', 'v_proj']
  f = safetensors_io.SafetensorsFile(str(tmp_path / 'adapter' / export_peft.ADAPTER_WEIGHTS))
  layers = json.loads((tmp_path / 'base' / 'config.json').read_text())['num_hidden_layers']
  assert info['adapter_tensors'] == len(f.names()) == layers * 7 * 2
  name = 'base_model.model.model.layers.{i}.self_attn.q_proj.lora_{x}.weight'
  hidden = json.loads((tmp_path / 'base' / 'config.json').read_text())['hidden_size']
  for i in range(layers):
    assert f.shape(name.format(i=i, x='A')) == (4, hidden)
    assert f.shape(name.format(i=i, x='B'))[1] == 4


@pytest.mark.slow
def test_the_merged_adapter_gives_the_workdirs_logits(relaxed, tmp_path):
  export_peft.export_peft(relaxed, str(tmp_path / 'base'), str(tmp_path / 'adapter'))
  cfg = json.loads((tmp_path / 'adapter' / export_peft.ADAPTER_CONFIG).read_text())
  scale = cfg['lora_alpha'] / cfg['r']
  adapter = safetensors_io.SafetensorsFile(str(tmp_path / 'adapter' /
                                               export_peft.ADAPTER_WEIGHTS))
  base = safetensors_io.open_model(str(tmp_path / 'base'))
  merged_dir = tmp_path / 'merged'
  merged_dir.mkdir()
  shutil.copy(tmp_path / 'base' / 'config.json', merged_dir)
  delta_of = {}
  for n in adapter.names():
    if '.lora_A.' in n:
      target = n[len(export_peft.PREFIX):].replace('.lora_A.weight', '.weight')
      b = adapter.read(n.replace('.lora_A.', '.lora_B.'))
      delta_of[target] = scale * b.astype(np.float64) @ adapter.read(n).astype(np.float64)
  merged = {n: (f.read(n) + delta_of.get(n, 0.0)).astype(np.float32) for n, f in base.items()}
  assert len(delta_of) == 7 * json.loads((merged_dir / 'config.json').read_text())[
      'num_hidden_layers'] and all(np.abs(d).max() > 0 for d in delta_of.values())
  safetensors_io.write(str(merged_dir / 'model.safetensors'),
                       [(n, a.shape, np.float32) for n, a in merged.items()], merged.__getitem__)
  back = import_hf.import_hf(str(merged_dir), str(tmp_path / 'back'))['workdir']
  tokens = np.arange(24, dtype=np.int32)[None] % 60
  want, got = _logits(relaxed, tokens), _logits(back, tokens)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
  # and without the adapter the base alone is another model
  base_back = import_hf.import_hf(str(tmp_path / 'base'), str(tmp_path / 'base_back'))['workdir']
  assert np.abs(_logits(base_back, tokens) - want).max() > 1e-3


def test_peft_loads_the_adapter_onto_the_base(relaxed, tmp_path):
  """Where peft, transformers and torch are importable (not dependencies of the suite):
  PeftModel.from_pretrained(base, adapter) gives the workdir's logits."""
  transformers = pytest.importorskip('transformers')
  torch = pytest.importorskip('torch')
  peft = pytest.importorskip('peft')
  export_peft.export_peft(relaxed, str(tmp_path / 'base'), str(tmp_path / 'adapter'))
  base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'base'),
                                                           dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(base, str(tmp_path / 'adapter')).eval()
  tokens = np.arange(24, dtype=np.int32)[None] % 60
  with torch.no_grad():
    got = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  want = _logits(relaxed, tokens)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_what_peft_cannot_hold_is_one_line(relaxed, tmp_path):
  with pytest.raises(ConfigError, match='has no LoRA'):
    export_peft.export_peft(os.path.join(ROOT, 'tests', 'fixtures', 'workdirs_v2',
                                         'mor_token_choice'), str(tmp_path / 'b'),
                            str(tmp_path / 'a'))
  with pytest.raises(ConfigError, match='per-layer norm gains'):
    export_peft.export_peft(os.path.join(ROOT, 'tests', 'fixtures', 'workdirs_v2',
                                         'middle_cycle_lora'), str(tmp_path / 'b'),
                            str(tmp_path / 'a'))
  assert not (tmp_path / 'b').exists() and not (tmp_path / 'a').exists()


def test_ema_reads_the_average_or_is_one_line(relaxed, tmp_path):
  """--ema exports the moving average (train.ema; tests/optim/test_ema.py checks export_hf's
  tensors are the average's); a workdir without one is one line and leaves nothing."""
  with pytest.raises(ConfigError, match='keeps no average') as e:
    export_peft.export_peft(relaxed, str(tmp_path / 'base'), str(tmp_path / 'adapter'), ema=True)
  assert '\n' not in str(e.value)
  assert not (tmp_path / 'base').exists() and not (tmp_path / 'adapter').exists()
