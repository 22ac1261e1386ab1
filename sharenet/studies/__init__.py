"""Studies built on the library: coordinate checks and LR-transfer sweeps (muP, issue 5)."""
