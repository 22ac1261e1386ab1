"""Optimizers: the optax chain (AdamW, AdamP, AGC, clipping, projections), Muon and Shampoo."""
