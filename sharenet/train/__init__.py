"""The one train loop and its pieces: the step, sampled depth, evaluation, metrics, sharding,
resume, workdirs."""
