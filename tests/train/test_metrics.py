"""Tests for sharenet.train.metrics: the metrics.jsonl writer and reader."""
import glob
import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

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


def _wandb_records(run_dir):
  """(config {key: value}, history rows [{key: value}]) of an offline W&B run directory, read
  from its run-*.wandb file: a ':W&B' header, then LevelDB log records (32 KiB blocks, each
  record a 7-byte header: crc, length, type 1 full / 2 first / 3 middle / 4 last) holding
  wandb's protobuf Records."""
  import json
  import struct
  from wandb.proto import wandb_internal_pb2
  (path,) = glob.glob(os.path.join(run_dir, 'run-*.wandb'))
  raw = open(path, 'rb').read()
  assert raw[:4] == b':W&B'
  pos, part, records = 7, b'', []
  while pos + 7 <= len(raw):
    if 32768 - pos % 32768 < 7:   # a block's tail too short for a header is padding
      pos += 32768 - pos % 32768
      continue
    _, n, kind = struct.unpack('<IHB', raw[pos:pos + 7])
    if n == 0 and kind == 0:
      break
    part += raw[pos + 7:pos + 7 + n]
    pos += 7 + n
    if kind in (1, 4):
      records.append(part)
      part = b''
  config, history = {}, []
  for data in records:
    r = wandb_internal_pb2.Record()
    r.ParseFromString(data)
    which = r.WhichOneof('record_type')
    if which in ('run', 'config'):
      items = r.run.config.update if which == 'run' else r.config.update
      config.update({i.key: json.loads(i.value_json) for i in items})
    elif which == 'history':
      history.append({i.key or '/'.join(i.nested_key): json.loads(i.value_json)
                      for i in r.history.item})
  return config, history


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_and_the_config(tmp_path, tiny_config, monkeypatch):
  """train.loggers=jsonl,wandb under WANDB_MODE=offline: the run directory under the workdir
  holds every logged row of metrics.jsonl at its step and the run's config; a resumed run logs
  to the same W&B run id."""
  pytest.importorskip('wandb')
  from sharenet.train import loop
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  workdir = str(tmp_path / 'run')
  config = tiny_config(**{'train.steps': 4, 'train.log_every': 2, 'train.loggers': 'jsonl,wandb'})
  loop.train_and_evaluate(config, workdir)
  (run_dir,) = glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*'))
  cfg, history = _wandb_records(run_dir)
  assert cfg['model']['d_model'] == 32 and cfg['train']['loggers'] == 'jsonl,wandb'
  rows = read_metrics(workdir)
  for row in rows:
    (logged,) = [h for h in history if h['_step'] == row['step'] and
                 set(row) - {'step'} <= set(h)]
    assert all(logged[k] == pytest.approx(v) for k, v in row.items() if k != 'step')
  assert not glob.glob(os.path.join(workdir, 'tb'))   # tensorboard left out
  run_id = open(os.path.join(workdir, 'wandb_run_id')).read().strip()
  assert run_dir.endswith(run_id)
  config.train.steps = 6
  loop.train_and_evaluate(config, workdir)
  runs = glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*'))
  assert len(runs) == 2 and all(r.endswith(run_id) for r in runs)
  resumed = _wandb_records(max(runs))[1]
  assert {h['_step'] for h in resumed if 'loss' in h} == {6}


@pytest.mark.slow
def test_a_wandb_run_held_in_a_shared_service_is_one_clear_line(tmp_path, monkeypatch):
  """A process that shares a W&B service (WANDB_SERVICE) where a killed run of the workdir left
  its stream open cannot resume that W&B run: one line naming the run, the file and the way
  out, not wandb's traceback."""
  pytest.importorskip('wandb')
  import subprocess
  import sys
  from conftest import share_a_wandb_service
  share_a_wandb_service(tmp_path, monkeypatch)
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / 'wandb_run_id').write_text('killedrun1\n')
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time, wandb\n'
       'wandb.init(project="p", id="killedrun1", dir=sys.argv[1]); print("up", flush=True)\n'
       'time.sleep(300)', str(tmp_path)], stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == 'up'
  holder.kill()
  holder.wait()
  with pytest.raises(RuntimeError, match=r'W&B run killedrun1 \(named by .*wandb_run_id\) is '
                                         r'still open in the W&B service') as e:
    MetricsWriter(str(workdir), ('jsonl', 'wandb'))
  assert '\n' not in str(e.value)


def test_bad_loggers_are_one_line_and_write_nothing(tmp_path, tiny_config):
  from sharenet.errors import ConfigError
  from sharenet.train import loop
  for overrides, match in (({'train.loggers': 'jsonl,mlflow'}, "'mlflow' is unknown; valid: "
                                                               "jsonl plus any of tensorboard"),
                           ({'train.loggers': 'tensorboard'}, 'leaves out jsonl'),
                           ({'train.wandb.mode': 'cloud'}, "train.wandb.mode='cloud'")):
    with pytest.raises(ConfigError, match=match) as e:
      loop.train_and_evaluate(tiny_config(**overrides), str(tmp_path / 'run'))
    assert '\n' not in str(e.value) and not (tmp_path / 'run').exists()
