"""Downstream tasks: a sharenet model answering lm-evaluation-harness requests, and the tasks it
runs by name or from a directory of task definitions."""
