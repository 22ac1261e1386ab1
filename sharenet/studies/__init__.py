"""Studies built on the library: coordinate checks, LR-transfer sweeps, the norm study."""
