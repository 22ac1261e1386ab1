"""sharenet.perf: the in-process matmul peak that MFU is measured against."""
import math

from sharenet import perf


def test_matmul_peak_is_a_plausible_flop_rate():
  small = perf.matmul_peak_flops(n=128, repeats=2)
  assert math.isfinite(small) and small > 1e6   # any CPU does over a MFLOP/s
  # A larger matmul amortises dispatch overhead: its measured rate is not far below.
  assert perf.matmul_peak_flops(n=256, repeats=2) > 0.25 * small
