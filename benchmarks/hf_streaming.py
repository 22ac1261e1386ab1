"""Peak host memory of the Hugging Face import and export on a synthetic Llama checkpoint.

Command: python -m benchmarks.hf_streaming [--d_model 2048 --layers 22 --mlp_dim 5632
             --vocab 32000 --heads 32 --kv_heads 4] [--dir /tmp/hf_streaming]
             [--out benchmarks/results/hf_streaming.json]          (from the repository root)
Runtime: the defaults are TinyLlama's shape (~1.1B parameters, 4.4 GB in float32): ~7 min on
the 2-core CPU, 5.6 GB peak (the `read` phase), results in
benchmarks/results/hf_streaming_1b.json (2026-12-04). --d_model 1024 --layers 16 --mlp_dim 2816
--heads 16 --kv_heads 4 (246M) takes ~2 minutes (benchmarks/results/hf_streaming.json;
docs/interop.md, "Tests and memory").
Result: one JSON object, each phase run in its own process and measured by its peak RSS
(ru_maxrss): `baseline` (the interpreter with the libraries imported), `write` (the synthetic checkpoint, written tensor by tensor), `read` (import's
read of every tensor into the stacked parameters, all held), `import` (the whole import: each
stacked parameter read, then written to the workdir's orbax checkpoint before the next is
read) and `export` (one stored parameter restored at a time, the safetensors written tensor by
tensor), beside the checkpoint's bytes, its largest tensor's and its largest stacked
parameter's (a block tensor over all layers). `read` is about the parameters plus one stacked
parameter, `write` about one tensor, `import` about three times the largest stacked parameter
(it and orbax's write and compression buffers for it; not the whole model), `export` about
twice the largest stored parameter plus one tensor.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np


def _hf_config(a) -> dict:
  return dict(architectures=['LlamaForCausalLM'], model_type='llama', vocab_size=a.vocab,
              hidden_size=a.d_model, intermediate_size=a.mlp_dim, num_hidden_layers=a.layers,
              num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
              max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, hidden_act='silu')


def _tensors(a) -> list[tuple[str, tuple[int, ...]]]:
  d, f, dh = a.d_model, a.mlp_dim, a.d_model // a.heads
  out = [('model.embed_tokens.weight', (a.vocab, d)), ('model.norm.weight', (d,)),
         ('lm_head.weight', (a.vocab, d))]
  for i in range(a.layers):
    p = f'model.layers.{i}.'
    out += [(p + 'input_layernorm.weight', (d,)), (p + 'post_attention_layernorm.weight', (d,)),
            (p + 'self_attn.q_proj.weight', (a.heads * dh, d)),
            (p + 'self_attn.k_proj.weight', (a.kv_heads * dh, d)),
            (p + 'self_attn.v_proj.weight', (a.kv_heads * dh, d)),
            (p + 'self_attn.o_proj.weight', (d, a.heads * dh)),
            (p + 'mlp.gate_proj.weight', (f, d)), (p + 'mlp.up_proj.weight', (f, d)),
            (p + 'mlp.down_proj.weight', (d, f))]
  return out


def _write(a, hf_dir: str) -> dict:
  from sharenet.interop import safetensors_io
  os.makedirs(hf_dir, exist_ok=True)
  with open(os.path.join(hf_dir, 'config.json'), 'w') as f:
    json.dump(_hf_config(a), f)
  specs = _tensors(a)
  shapes = dict(specs)
  rng = np.random.default_rng(0)
  produce = lambda name: (rng.standard_normal(shapes[name], np.float32) * 0.02
                          if len(shapes[name]) > 1 else np.ones(shapes[name], np.float32))
  safetensors_io.write(os.path.join(hf_dir, 'model.safetensors'),
                       [(n, s, np.float32) for n, s in specs], produce)
  sizes = [4 * int(np.prod(s)) for _, s in specs]
  stacked: dict[str, int] = {}   # a block tensor's bytes over all layers: one stored parameter
  for (name, _), size in zip(specs, sizes):
    key = '.'.join(p for p in name.split('.') if not p.isdigit())
    stacked[key] = stacked.get(key, 0) + size
  return {'checkpoint_bytes': sum(sizes), 'largest_tensor_bytes': max(sizes),
          'largest_stacked_bytes': max(stacked.values()), 'params': sum(sizes) // 4}


def _phase(a) -> dict:
  """Runs one phase in this process; returns its result with this process's peak RSS."""
  hf_dir, work, back = (os.path.join(a.dir, n) for n in ('hf', 'workdir', 'export'))
  t = time.perf_counter()
  out = {}
  if a.phase == 'baseline':   # the interpreter with jax, flax, orbax and sharenet imported
    from sharenet.interop import export_hf, import_hf  # noqa: F401
    from sharenet.train import workdir_io  # noqa: F401
  elif a.phase == 'write':
    out = _write(a, hf_dir)
  elif a.phase == 'read':
    from sharenet.interop import hf_arch, import_hf
    from sharenet.models import ModelConfig
    import ml_collections
    arch, keys = hf_arch.model_keys(import_hf.read_hf_config(hf_dir))
    raw = import_hf.experiment_config(keys, None)
    cfg = ModelConfig.from_experiment(ml_collections.ConfigDict(raw))
    import_hf.read_params(hf_dir, arch, cfg)
  elif a.phase == 'import':
    from sharenet.interop import import_hf
    import_hf.import_hf(hf_dir, work)
  else:
    from sharenet.interop import export_hf
    export_hf.export_hf(work, back)
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
  return {**out, 'peak_rss_bytes': rss, 'seconds': round(time.perf_counter() - t, 1)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, default in (('d_model', 2048), ('layers', 22), ('mlp_dim', 5632), ('vocab', 32000),
                        ('heads', 32), ('kv_heads', 4)):
    p.add_argument(f'--{name}', type=int, default=default)
  p.add_argument('--dir', default='/tmp/hf_streaming')
  p.add_argument('--out', default='')
  p.add_argument('--phase', default='', help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.phase:
    print(json.dumps(_phase(a)))
    return
  shutil.rmtree(a.dir, ignore_errors=True)
  result = {'shape': {k: getattr(a, k) for k in ('d_model', 'layers', 'mlp_dim', 'vocab',
                                                  'heads', 'kv_heads')}}
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  for phase in ('baseline', 'write', 'read', 'import', 'export'):
    cmd = [sys.executable, '-m', 'benchmarks.hf_streaming', '--phase', phase, '--dir', a.dir]
    cmd += [f'--{k}={v}' for k, v in result['shape'].items()]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
      raise SystemExit(f'{phase} failed: {r.stderr[-2000:]}')
    row = json.loads(r.stdout.strip().splitlines()[-1])
    result.update({k: v for k, v in row.items() if k not in ('peak_rss_bytes', 'seconds')})
    result[phase] = {'peak_rss_gb': round(row['peak_rss_bytes'] / 1e9, 2),
                     'seconds': row['seconds']}
    print(phase, result[phase], flush=True)
  result['checkpoint_gb'] = round(result['checkpoint_bytes'] / 1e9, 2)
  result['largest_tensor_gb'] = round(result['largest_tensor_bytes'] / 1e9, 3)
  result['largest_stacked_gb'] = round(result['largest_stacked_bytes'] / 1e9, 3)
  shutil.rmtree(a.dir, ignore_errors=True)
  print(json.dumps(result), flush=True)
  if a.out:
    with open(a.out, 'w') as f:
      json.dump(result, f, indent=2)


if __name__ == '__main__':
  main()
