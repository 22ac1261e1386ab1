"""A compact nanoGPT-style PyTorch (eager) GPT with sharenet's default block, for speed comparisons.

Not part of sharenet: it imports only torch and runs where torch is importable, typically a separate
virtual environment (benchmarks/peer_compare.py starts it as a worker subprocess, see --worker).

The model mirrors the shape and arithmetic of sharenet's default untied decoder
(sharenet/models/, configs/default.py) so both do the same FLOPs per token: byte vocabulary,
learned embedding, pre-RMSNorm blocks with a gain (eps 1e-6), multi-head causal attention with
RoPE (base 10000, rotate-half layout) and no biases, SwiGLU MLP (gate, up, down; no biases),
final RMSNorm, untied readout without bias; AdamW (lr 3e-3, betas 0.9/0.95, eps 1e-8, weight
decay 0.1 on matrices only) with global-norm clipping at 1.0; float32. Attention is
torch.nn.functional.scaled_dot_product_attention(is_causal=True), PyTorch's fused causal kernel
(what a nanoGPT user gets).

Worker protocol (--worker): prints one JSON line with the model's FLOPs per token, then answers
one JSON line per stdin command: `steps N` (times N train steps: {"times": [seconds, ...]}),
`matmul` (best-of-5 FLOP/s of a float32 2048^3 torch.matmul: {"matmul_flops": x}),
`profile N` (torch.profiler over N steps: self CPU seconds per step by op category, see
`profile_steps`: {"profile": {...}}), `quit`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
  def __init__(self, d: int, eps: float = 1e-6):
    super().__init__()
    self.eps = eps
    self.weight = nn.Parameter(torch.ones(d))

  def forward(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0):
  inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
  angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv[None]
  return torch.cos(angles), torch.sin(angles)      # (T, head_dim / 2)


def apply_rope(x, cos, sin):
  """x (B, H, T, Dh), rotate-half layout."""
  x1, x2 = x.chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
  def __init__(self, d: int, heads: int, mlp_dim: int):
    super().__init__()
    self.heads = heads
    self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
    self.qkv = nn.Linear(d, 3 * d, bias=False)
    self.o = nn.Linear(d, d, bias=False)
    self.gate_up = nn.Linear(d, 2 * mlp_dim, bias=False)
    self.down = nn.Linear(mlp_dim, d, bias=False)

  def forward(self, x, cos, sin):
    B, T, D = x.shape
    q, k, v = self.qkv(self.attn_norm(x)).split(D, dim=-1)
    q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
    gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
    return x + self.down(F.silu(gate) * up)


class GPT(nn.Module):
  def __init__(self, vocab: int, d: int, layers: int, heads: int, mlp_dim: int, seq_len: int):
    super().__init__()
    self.embed = nn.Embedding(vocab, d)
    self.blocks = nn.ModuleList(Block(d, heads, mlp_dim) for _ in range(layers))
    self.final_norm = RMSNorm(d)
    self.readout = nn.Linear(d, vocab, bias=False)
    cos, sin = rope_tables(seq_len, d // heads)
    self.register_buffer('cos', cos, persistent=False)
    self.register_buffer('sin', sin, persistent=False)
    for name, p in self.named_parameters():
      if p.dim() == 2 and 'embed' not in name:
        nn.init.normal_(p, std=p.shape[1] ** -0.5)     # fan-in init, as sharenet's default

  def forward(self, tokens):
    x = self.embed(tokens)
    for b in self.blocks:
      x = b(x, self.cos, self.sin)
    return self.readout(self.final_norm(x))

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token, counted as sharenet/models/accounting.py counts them: 6 x the
    weights each token multiplies with (embedding lookup excluded, readout included) plus causal
    attention at half of 2 * 2 * T * d per layer, x3 for forward + backward."""
    matmul = sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2 and 'embed' not in n)
    d = self.embed.embedding_dim
    attn = len(self.blocks) * 2 * seq_len * d
    return 3 * (2 * matmul + attn)


def make(args):
  torch.manual_seed(0)
  model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.mlp_dim, args.seq_len)
  decay = [p for p in model.parameters() if p.dim() == 2]
  no_decay = [p for p in model.parameters() if p.dim() < 2]
  opt = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1},
                           {'params': no_decay, 'weight_decay': 0.0}],
                          lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
  g = torch.Generator().manual_seed(1)
  batch = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
  return model, opt, batch


def train_step(model, opt, batch) -> float:
  logits = model(batch[:, :-1])
  loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
  opt.zero_grad(set_to_none=True)
  loss.backward()
  torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
  opt.step()
  return float(loss.detach())


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
  a, b = torch.randn(n, n), torch.randn(n, n)
  torch.matmul(a, b)
  best = float('inf')
  for _ in range(repeats):
    t0 = time.perf_counter()
    torch.matmul(a, b)
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best


# torch op name -> category of benchmarks/step_profile.py (first match wins; the rest is
# 'elementwise and reductions').
TORCH_CATEGORIES = (
    ('matmul', ('aten::mm', 'aten::addmm', 'aten::bmm', 'aten::baddbmm')),
    ('attention kernel', ('flash_attention', 'scaled_dot_product')),
    ('copies and transposes', ('aten::copy_', 'aten::clone', 'aten::contiguous', 'aten::cat',
                               'aten::index_select', 'aten::embedding')),
)


def profile_steps(model, opt, batch, steps: int) -> dict:
  """Self CPU seconds per step by op category (torch.profiler), and the step's wall time."""
  from torch.profiler import ProfilerActivity, profile
  t0 = time.perf_counter()
  with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
      train_step(model, opt, batch)
  wall = (time.perf_counter() - t0) / steps
  cats: dict[str, float] = {}
  for ev in prof.key_averages():
    name = ev.key
    cat = next((c for c, keys in TORCH_CATEGORIES if any(k in name for k in keys)),
               'elementwise and reductions')
    cats[cat] = cats.get(cat, 0.0) + ev.self_cpu_time_total / 1e6 / steps
  return {'wall_s': wall, 'categories_s': cats}


def worker(args) -> None:
  model, opt, batch = make(args)
  train_step(model, opt, batch)      # warm-up (allocator, kernel selection)
  print(json.dumps({'flops_per_token': model.flops_per_token(args.seq_len),
                    'torch': torch.__version__, 'threads': torch.get_num_threads()}), flush=True)
  for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == 'quit':
      break
    if cmd[0] == 'steps':
      times = []
      for _ in range(int(cmd[1])):
        t0 = time.perf_counter()
        loss = train_step(model, opt, batch)
        times.append(time.perf_counter() - t0)
      print(json.dumps({'times': times, 'loss': loss}), flush=True)
    elif cmd[0] == 'profile':
      print(json.dumps({'profile': profile_steps(model, opt, batch, int(cmd[1]))}), flush=True)
    elif cmd[0] == 'matmul':
      print(json.dumps({'matmul_flops': matmul_flops()}), flush=True)
    else:
      valid = 'steps N, profile N, matmul, quit'
      print(json.dumps({'error': f'unknown command {cmd[0]!r}; valid: {valid}'}), flush=True)


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--vocab', type=int, default=256)
  p.add_argument('--d_model', type=int, default=256)
  p.add_argument('--layers', type=int, default=8)
  p.add_argument('--heads', type=int, default=4)
  p.add_argument('--mlp_dim', type=int, default=768)
  p.add_argument('--seq_len', type=int, default=256)
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--threads', type=int, default=0, help='torch.set_num_threads (0: torch default)')
  p.add_argument('--worker', action='store_true', help='serve timing commands on stdin')
  p.add_argument('--steps', type=int, default=10, help='without --worker: steps to time')
  return p.parse_args(argv)


def main(argv=None) -> None:
  args = parse(argv)
  if args.threads:
    torch.set_num_threads(args.threads)
  if args.worker:
    worker(args)
    return
  model, opt, batch = make(args)
  train_step(model, opt, batch)
  t0 = time.perf_counter()
  for _ in range(args.steps):
    loss = train_step(model, opt, batch)
  dt = (time.perf_counter() - t0) / args.steps
  print(json.dumps({'tokens_per_sec': args.batch * args.seq_len / dt, 'loss': loss,
                    'flops_per_token': model.flops_per_token(args.seq_len)}))


if __name__ == '__main__':
  main()
