"""The size presets (configs/sizes/): each loads as a valid config for every plan, its
stored and applied parameters are the table's, and (slow) every slice it claims to fit, its
dry run fits (benchmarks/presets.py)."""
import json
import os

import pytest

from configs.sizes import presets
from sharenet.train import experiment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(size, plan):
  """configs/sizes/<size>.py[:plan] as train.py loads it (config_flags: FILE:ARG)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(f'preset_{size}',
                                                os.path.join(ROOT, 'configs', 'sizes',
                                                             f'{size}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(plan)


@pytest.mark.parametrize('size', list(presets.SHAPES))
def test_every_preset_and_plan_is_a_valid_config(size):
  """Each plan validates (the compatibility table, the mesh's axes), applies the untied
  model's layers, and the committed table's parameter counts are the preset's."""
  from sharenet.models import DecoderLM, ModelConfig, abstract_variables, accounting
  table = json.load(open(os.path.join(ROOT, 'benchmarks', 'results', 'presets.json')))
  rows = {(r['size'], r['plan']): r for r in table['sizes']}
  applied = set()
  for plan in presets.PLANS:
    config = _load(size, plan)
    assert config.mesh.fsdp * presets.SEQS_PER_CHIP == config.train.batch_size
    config.mesh.fsdp = -1   # this process's devices (the slow test runs the slices' meshes)
    cfg = experiment.validate(config)
    assert cfg.num_layers == presets.SHAPES[size][1] and cfg.dtype == 'bfloat16'
    v = abstract_variables(DecoderLM(cfg))
    assert accounting.params_unique(v) == rows[size, plan]['params_stored']
    applied.add(accounting.params_applied(v, cfg) - (rows[size, plan]['params_applied'] -
                                                     rows[size, 'untied']['params_applied']))
  assert len(applied) == 1   # the plans apply the untied layers (LoRA adds its own)


def test_a_bad_plan_names_the_valid_ones():
  with pytest.raises(ValueError, match='untied, cycle, middle_cycle_lora'):
    presets.config('350m', 'sandwich')


@pytest.mark.slow
def test_every_claimed_slice_fits_its_dry_run():
  """The untied preset's dry run on each slice it claims (simulated devices, the preset's mesh,
  remat and batch): the step's peak per device is under the chip's HBM, and the committed
  table's rows are these runs' (to 1 %: the CPU compiler's buffer assignment)."""
  from benchmarks import presets as bench
  rows = bench.dry_runs()
  assert {(r['size'], r['slice']) for r in rows} == set(bench.claims())
  committed = {(r['size'], r['slice']): r for r in json.load(open(os.path.join(
      ROOT, 'benchmarks', 'results', 'presets.json')))['dry_runs']}
  for r in rows:
    assert bench.fits(r), r
    c = committed[r['size'], r['slice']]
    assert r['state_bytes_per_device'] == c['state_bytes_per_device']
    assert r['step_peak_bytes_per_device'] == pytest.approx(c['step_peak_bytes_per_device'],
                                                            rel=0.01)
