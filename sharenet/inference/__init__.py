"""Serving a trained model: cached generation, loop-by-loop inference with adaptive exits, test-time
depth."""
