"""Tests for sharenet.train.metrics: the metrics.jsonl writer and reader."""
import glob
import importlib.util
import os

import jax.numpy as jnp
import numpy as np

from sharenet.train.metrics import MetricsWriter, read_metrics


def test_rows_round_trip_and_a_second_writer_appends(tmp_path):
  w = MetricsWriter(str(tmp_path))
  w.write(1, loss=np.float32(2.5), lr=jnp.asarray(1e-3))
  w.write(2, loss=2.25)
  w.close()
  w = MetricsWriter(str(tmp_path))   # a resumed run appends to the same file
  w.write(np.int64(3), eval_loss=1.5, eval_bits_per_byte=1.5 / np.log(2))
  w.close()
  rows = read_metrics(str(tmp_path))
  assert rows == [{'step': 1, 'loss': 2.5, 'lr': float(jnp.float32(1e-3))},
                  {'step': 2, 'loss': 2.25},
                  {'step': 3, 'eval_loss': 1.5, 'eval_bits_per_byte': 1.5 / np.log(2)}]
  assert all(type(r['step']) is int and all(type(v) is float for k, v in r.items() if k != 'step')
             for r in rows)


def test_reader_skips_blank_lines(tmp_path):
  (tmp_path / 'metrics.jsonl').write_text('{"step": 1, "loss": 3.0}\n\n  \n{"step": 2}\n')
  assert read_metrics(str(tmp_path)) == [{'step': 1, 'loss': 3.0}, {'step': 2}]


def test_scalars_are_mirrored_to_tensorboard_when_available(tmp_path):
  w = MetricsWriter(str(tmp_path))
  w.write(1, loss=1.0)
  w.close()
  events = glob.glob(os.path.join(tmp_path, 'tb', 'events.*'))
  assert bool(events) == (importlib.util.find_spec('tensorboardX') is not None)
