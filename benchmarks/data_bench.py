"""ArrayRecord input pipeline vs train-step consumption: can the data keep up?

Command: python -m benchmarks.data_bench [--config.configs=tiny,default]
             [--config.out=benchmarks/results/data_cpu.json]   (from the repository root)
         python -m benchmarks.data_bench --config.pod=True
             --config.out=benchmarks/results/data_pod_cpu.json   (`pod_main`, ~2 min)
Runtime: ~2 min on the 2-core CPU (writing the shards, two train-step compilations, 8 x 5 s of
pipeline timing).
Result (2026-12-01, 2-core CPU shared with other jobs, load ~6): the pipeline delivers 6-12x
the tokens/s of the tiny config's jitted train step (4 x 32 tokens per step: the pipeline's
per-batch overhead dominates) and ~4,400-14,000x the default config's (16 x 256); the segment
mask costs ~40 % of pipeline throughput, short (~1k-token) documents ~10-60 %. Full table in
benchmarks/results/data_cpu.json. The load slowed both sides (the default train step ran at
1,330 tokens/s vs ~3,000 on an idle machine); read the ratios, not the absolute rates.

Shards: the embedded stdlib corpus (sharenet/data/corpus.py) as bytes with end-of-document id 256
(vocab 257), written in the sharenet-arrayrecord-v1 format by `arrayrecord.write_split` into a
temporary directory, twice: one document per .py file (mean ~18k tokens), and the files cut into
1 KiB documents (mean ~1k tokens, closer to web text).

Pipeline tokens/s: `data.make_train_iterator` (grain: record reads, seeded shuffle, packing,
batching; with and without data.segment_mask) through
`jax.make_array_from_process_local_data` onto the device, i.e. shards to device-ready
batches, at each config's batch shape; predicted tokens (batch * seq_len) per second.
Train-step tokens/s: the same config's jitted train step (trainer.make_train_step) on a fixed
batch, median step time. ratio = pipeline tokens/s / train-step tokens/s; both are timed
separately on the same cores (in a run on an accelerator, reading overlaps the device step). On
a CPU the device transfer may be a no-copy; on a GPU/TPU it is a real host-to-device copy.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import tempfile
import time

import jax
import ml_collections

from configs import default, tiny
from sharenet.config import cli
from sharenet import data
from sharenet.train import sharding, trainer
from sharenet.data import arrayrecord, corpus
from sharenet.models import ModelConfig

EOD, VOCAB = 256, 257
CONFIGS = {'tiny': tiny.get_config, 'default': default.get_config}


def write_shards(path: str, num_files: int, num_shards: int, doc_bytes: int = 0) -> dict:
  """The first `num_files` stdlib .py files (train) and every 50th (validation) as shards: one
  document per file, or per `doc_bytes`-byte piece of a file if `doc_bytes` > 0."""
  root, files = corpus.stdlib_files()
  splits = {}

  def read(rels):
    for rel in rels:
      with open(os.path.join(root, rel), 'rb') as f:
        text = f.read()
      step = doc_bytes or max(1, len(text))
      yield from (list(text[i:i + step]) for i in range(0, len(text), step))

  for split, rels in (('train', files[:num_files]), ('validation', files[::50][:20])):
    docs = list(read(rels))
    splits[split] = arrayrecord.write_split(path, split, docs, EOD, num_shards)
    splits[split]['bytes'] = sum(len(d) for d in docs)
  arrayrecord.write_meta(path, splits, VOCAB, EOD, tokenizer='bytes+eod')
  return splits


def pipeline_tokens_per_sec(path: str, batch: int, seq_len: int, segment_mask: bool,
                            seconds: float) -> tuple[float, int]:
  """(tokens/s, batches) from shards to device arrays over ~`seconds` after 2 warm-up batches."""
  cfg = {'source': 'arrayrecord', 'path': path, 'segment_mask': segment_mask}
  it = data.make_train_iterator(cfg, seq_len, batch, seed=0)
  config = default.get_config()
  mesh = sharding.make_mesh(config.mesh)
  shard = sharding.batch_sharding(mesh, sharding.rules_of(config.mesh))
  shape = (batch, seq_len + 1)
  put = lambda b: jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(shard, x, shape), b)
  for _ in range(2):
    jax.block_until_ready(put(next(it)))
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    jax.block_until_ready(put(next(it)))
    n += 1
  return n * batch * seq_len / (time.perf_counter() - t0), n


def train_tokens_per_sec(config, steps: int) -> tuple[float, float]:
  """(tokens/s, median step seconds) of `config`'s jitted train step on a fixed batch."""
  t = config.train
  mcfg = ModelConfig.from_experiment(config)
  exp = trainer.setup(config, mcfg)
  state = jax.jit(functools.partial(trainer.init_state, exp.model, exp.tx, tr=exp.tr,
                                    pz=exp.pz))(jax.random.key(0))
  step = jax.jit(trainer.make_train_step(exp, t.grad_accum), donate_argnums=0)
  batch = jax.random.randint(jax.random.key(1), (t.batch_size, t.seq_len + 1), 0, VOCAB)
  state, m = step(state, batch)   # compile + warm-up
  jax.block_until_ready(m)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  return t.batch_size * t.seq_len / med, med


def roofline_host_rate(path: str = 'benchmarks/results/roofline.json', model: str = '1B',
                       chip: str = 'TPU v5p', chips_per_host: int = 4) -> dict:
  """The tokens/s one host must feed for `model` at the roofline's lower-bound step time on
  `chip` (benchmarks/roofline.py: one chip's step of 8 x 2,048 tokens), per plan."""
  with open(path) as f:
    steps = json.load(f)['steps']
  out = {}
  for row in steps:
    if row['model'] == model:
      t = row['chips'][chip]['t_lower_s']
      out[row['plan']] = {'chip_step_s': t, 'chip_tokens': row['tokens'],
                          'host_tokens_per_sec': chips_per_host * row['tokens'] / t}
  return out


def prepare_tokens_per_sec(tmp: str, workers: int, max_documents: int) -> dict:
  """prepare's rate with the byte-level BPE (train_tokenizer, 4,096 ids) on the first
  `max_documents` stdlib files: tokens written per second of the whole command's work."""
  from sharenet.data import prepare, train_tokenizer
  tok = os.path.join(tmp, 'tok')
  if not os.path.exists(os.path.join(tok, 'tokenizer.json')):
    train_tokenizer.train_to_dir(train_tokenizer.stdlib_train_texts(), 4096, tok)
  out = os.path.join(tmp, f'bpe_w{workers}')
  t0 = time.perf_counter()
  meta = prepare.prepare('stdlib', f'hf:{tok}/tokenizer.json', out, shards=4, workers=workers,
                         max_documents=max_documents)
  seconds = time.perf_counter() - t0
  tokens = sum(s['tokens'] for s in meta['splits'].values())
  return {'workers': workers, 'tokens': tokens, 'seconds': round(seconds, 2),
          'tokens_per_sec': round(tokens / seconds), 'path': out}


def pod_main(args) -> None:
  """--config.pod: prepare's tokens/s per worker with the BPE, and the loader's batches/s at a
  pod host's batch (args.pod_batch x args.pod_seq_len) against the rate the roofline says one
  TPU v5p host (4 chips) needs for a 1B model."""
  need = roofline_host_rate()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for workers in (1, 2):
      rows.append(prepare_tokens_per_sec(tmp, workers, args.pod_documents))
      print(json.dumps({k: v for k, v in rows[-1].items() if k != 'path'}), flush=True)
    path = rows[-1].pop('path')
    rows[0].pop('path')
    B, T = args.pod_batch, args.pod_seq_len
    loader = []
    for shuffle in (0, 64):
      cfg = {'source': 'arrayrecord', 'path': path, 'shuffle_windows': shuffle}
      it = data.make_train_iterator(cfg, T, B, seed=0)
      next(it)
      n, t0 = 0, time.perf_counter()
      while time.perf_counter() - t0 < args.seconds:
        next(it)
        n += 1
      secs = time.perf_counter() - t0
      loader.append({'batch': B, 'seq_len': T, 'shuffle_windows': shuffle,
                     'batches_per_sec': round(n / secs, 2),
                     'tokens_per_sec': round(n * B * T / secs)})
      print(json.dumps(loader[-1]), flush=True)
  result = {'device': jax.devices()[0].device_kind, 'prepare': rows, 'loader': loader,
            'needed_by_1B_on_v5p_host': need, 'args': args.to_dict()}
  if args.out:
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=2)


def options() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.pod = False                # the pod-rate check (pod_main) instead of the config table
  o.pod_batch = 64             # a host's batch rows and sequence length for --config.pod
  o.pod_seq_len = 4096
  o.pod_documents = 600        # stdlib train files prepare tokenizes for --config.pod
  o.configs = 'tiny,default'   # comma list of configs/ names
  o.num_files = 2000           # stdlib files in the train split
  o.num_shards = 8
  o.doc_bytes = 1024           # second dataset: files cut into documents of this many bytes
  o.seconds = 5.0              # pipeline timing per variant
  o.steps = 8                  # timed train steps per config
  o.out = ''                   # JSON results file ('' = print only)
  return o


_OPTIONS = cli.define_config_dict('config', options(), 'Benchmark options.')


def main(argv):
  del argv
  args = _OPTIONS.value
  if args.pod:
    return pod_main(args)
  rows, datasets = [], {}
  with tempfile.TemporaryDirectory() as tmp:
    for docs, doc_bytes in (('files', 0), (f'{args.doc_bytes}B', args.doc_bytes)):
      path = os.path.join(tmp, docs)
      splits = write_shards(path, args.num_files, args.num_shards, doc_bytes)
      datasets[docs] = {'path': path, 'splits': splits}
      train = splits['train']
      print(f"shards ({docs}): {train['documents']:,} train documents, {train['tokens']:,} "
            f"tokens (mean {train['tokens'] / train['documents']:,.0f}) in {args.num_shards} "
            f"shards", flush=True)
    for name in args.configs.split(','):
      config = CONFIGS[name]()
      config.model.vocab_size = VOCAB
      t = config.train
      step_tps, step_s = train_tokens_per_sec(config, args.steps)
      for (docs, d), segment_mask in itertools.product(datasets.items(), (False, True)):
        pipe_tps, n = pipeline_tokens_per_sec(d['path'], t.batch_size, t.seq_len, segment_mask,
                                              args.seconds)
        train = d['splits']['train']
        rows.append({'config': name, 'documents': docs,
                     'mean_doc_tokens': round(train['tokens'] / train['documents']),
                     'batch': t.batch_size, 'seq_len': t.seq_len,
                     'segment_mask': segment_mask, 'pipeline_tokens_per_sec': round(pipe_tps),
                     'pipeline_batches': n, 'train_step_tokens_per_sec': round(step_tps),
                     'train_step_ms': round(1e3 * step_s, 1),
                     'ratio': round(pipe_tps / step_tps, 1)})
        print(json.dumps(rows[-1]), flush=True)
  print('\n| config | batch x seq | documents (mean tokens) | segment_mask | pipeline tokens/s '
        '| train step tokens/s | ratio |')
  print('|---|---|---|---|---|---|---|')
  for r in rows:
    print(f"| {r['config']} | {r['batch']} x {r['seq_len']} | {r['documents']} "
          f"({r['mean_doc_tokens']:,}) | {r['segment_mask']} | "
          f"{r['pipeline_tokens_per_sec']:,} | {r['train_step_tokens_per_sec']:,} | "
          f"{r['ratio']}x |")
  if args.out:
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w') as f:
      shards = {k: d['splits'] for k, d in datasets.items()}
      json.dump({'device': jax.devices()[0].device_kind, 'shards': shards, 'rows': rows,
                 'args': args.to_dict()}, f, indent=2)


if __name__ == '__main__':
  cli.run(main)
