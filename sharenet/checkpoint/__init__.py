"""Checkpoint I/O below the train loop: orbax checkpoints of the train state and a workdir's
config.json."""
