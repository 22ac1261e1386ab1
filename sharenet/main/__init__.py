"""The library halves of the entry points: evaluate, generate from and convert a workdir (eval.py,
convert.py)."""
