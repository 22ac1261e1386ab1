"""Default: a 4-layer byte-level LM on the embedded stdlib corpus.

Command:   python train.py                      (same as --config configs/default.py)
Runtime:   ~1 min 45 s to 2 min 16 s on the 2-core CPU (120 steps at 5,000-7,000 tokens/s,
           then the final eval over the full validation split; measured 2026-12-01 on a fresh
           clone, no install, and 2026-12-04).
Result:    eval bits per byte: README.md, Quickstart (the one place it is quoted);
           docs/performance.md, "Default run", for the history of that number.
"""
import ml_collections

from sharenet.config import defaults


def get_config() -> ml_collections.ConfigDict:
  return defaults.default_config()   # every field, with its meaning, in sharenet/config/defaults.py
