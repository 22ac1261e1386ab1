"""sharenet.train.perf: hardware peaks and the MFU figure logged for each device; FLOPs per
token."""
import math
import types

import jax
import jax.numpy as jnp
import pytest

from sharenet.train import experiment, perf
from sharenet.models import DecoderLM, accounting, init_variables


def test_matmul_peak_is_a_plausible_flop_rate():
  small = perf.matmul_peak_flops(n=128, repeats=2)
  assert math.isfinite(small) and small > 1e6   # any CPU does over a MFLOP/s
  # A larger matmul amortises dispatch overhead: its measured rate is not far below.
  assert perf.matmul_peak_flops(n=256, repeats=2) > 0.25 * small


# (jax device_kind, model dtype, jax_default_matmul_precision, dense TFLOP/s per chip or None)
PEAKS = [
    ('NVIDIA H100 80GB HBM3', 'bfloat16', None, 989.4),
    ('NVIDIA H200', 'bfloat16', None, 989.4),
    ('NVIDIA H200', 'float32', None, 494.7),          # jax's default: TF32 tensor cores
    ('NVIDIA H200', 'float32', 'highest', 66.9),      # true fp32: CUDA cores
    ('NVIDIA A100-SXM4-80GB', 'bfloat16', None, 312.0),
    ('NVIDIA A100-SXM4-40GB', 'float32', None, 156.0),
    ('NVIDIA A100 80GB PCIe', 'float32', 'float32', 19.5),
    ('TPU v4', 'bfloat16', None, 275.0),
    ('TPU v5 lite', 'bfloat16', None, 197.0),
    ('TPU v5', 'bfloat16', None, 459.0),
    ('TPU v5p', 'float32', None, 459.0),              # default: one bf16 MXU pass
    ('TPU v6 lite', 'bfloat16', None, 918.0),
    ('TPU v6 lite', 'float32', 'highest', None),      # no published multi-pass figure
    ('NVIDIA H100 PCIe', 'bfloat16', None, None),     # another part: not in the table
    ('cpu', 'float32', None, None),
]


@pytest.mark.parametrize('kind, dtype, precision, tflops', PEAKS)
def test_peak_flops_of_known_devices(kind, dtype, precision, tflops):
  got = perf.peak_flops(kind, dtype, precision)
  assert got == (None if tflops is None else pytest.approx(tflops * 1e12))


def _fake_devices(monkeypatch, kind, platform, count):
  device = types.SimpleNamespace(device_kind=kind, platform=platform)
  monkeypatch.setattr(jax, 'devices', lambda *a: [device] * count)
  monkeypatch.setattr(jax, 'device_count', lambda *a: count)
  monkeypatch.setattr(perf, 'matmul_peak_flops', lambda **kw: 1e9)


def test_cpu_logs_the_matmul_relative_figure():
  ref = perf.mfu_reference('float32')
  assert jax.devices()[0].platform == 'cpu'
  assert ref.name == 'mfu_vs_matmul' and ref.note is None and ref.flops > 1e6


def test_known_accelerator_logs_standard_mfu_over_all_chips(monkeypatch):
  _fake_devices(monkeypatch, 'TPU v5 lite', 'tpu', 8)
  assert perf.mfu_reference('bfloat16') == perf.Reference('mfu', 8 * 197e12, None)


def test_unknown_accelerator_logs_the_matmul_figure_with_a_note(monkeypatch):
  _fake_devices(monkeypatch, 'NVIDIA H100 PCIe', 'gpu', 2)
  ref = perf.mfu_reference('bfloat16')
  assert ref.name == 'mfu_vs_matmul' and ref.flops == 1e9
  assert 'H100 PCIe' in ref.note and 'instead of mfu' in ref.note


def _dot_flops(jaxpr) -> float:
  """2 x (output size) x (contracted size) summed over every dot_general, scan bodies times
  their trip count."""
  total = 0.0
  for e in jaxpr.eqns:
    if e.primitive.name == 'dot_general':
      (lhs_contract, _), _ = e.params['dimension_numbers']
      k = math.prod(e.invars[0].aval.shape[d] for d in lhs_contract)
      total += 2 * math.prod(e.outvars[0].aval.shape) * k
    times = e.params.get('length', 1) if e.primitive.name == 'scan' else 1
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          total += times * _dot_flops(inner)
  return total


@pytest.mark.parametrize('scheme', ['untied', 'universal'])
def test_flops_per_token_is_the_forward_matmul_count(scheme, tiny_config):
  # Independent count: every dot_general the forward pass runs (scan bodies x trip count, so
  # a universal model's one stored layer counts num_layers times). The jaxpr computes the full
  # (T, T) attention scores; accounting counts causal attention at half (MaxText), so the
  # jaxpr's count is accounting's plus that half.
  c = tiny_config(**{'model.sharing.scheme': scheme})
  mcfg = experiment.validate(c)
  model = DecoderLM(mcfg)
  B, T = 2, c.train.seq_len
  params = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
  jaxpr = jax.make_jaxpr(model.apply)(params, jnp.zeros((B, T), jnp.int32)).jaxpr
  fwd = accounting.flops_per_token(mcfg, T, train=False)
  attn_half = mcfg.num_layers * 2 * T * mcfg.num_heads * mcfg.d_head
  assert _dot_flops(jaxpr) / (B * T) == pytest.approx(fwd + attn_half, rel=1e-9)
  assert accounting.flops_per_token(mcfg, T) == 3 * fwd
