"""Depth study (issue 29 part 7): fixed-depth recursive vs sampled-depth recurrent (with and
without injection) vs MoR expert choice at equal training FLOPs; eval loss against test-time
depth, and decode tokens/s and KV bytes per token (vanilla, recursive, kv_sharing=first, MoR).

Base: middle_cycle with 5 applied layers (a unique prelude layer, one shared layer looped R = 3
times, a unique coda layer), width 64, byte-level, the embedded stdlib corpus. The variants
(sharenet/studies/depth_study.py VARIANTS) change only the recurrence / routing keys (vanilla:
the untied plan of the same 5 layers).

Command:   python -m sharenet.studies.depth_study --config configs/depth_study.py \
               --out runs/depth_study
           (docs/results/depth_study/ holds copies of OUT/depth_study.{json,md,png}; the runs'
           workdirs stay in OUT/runs; --config.study.variants=a,b runs a slice)
Runtime:   ~11 min wall pinned to one core of the shared 2-core CPU (`taskset -c 0`; measured
           2026-12-03: 8 min 55 s for the 10 runs of 400-500 steps of 8 x 64 bytes with their
           evaluations at 7 depths, then 1 min 56 s of round-robin greedy decoding of 8 prompts
           x 256 tokens by every model); the sampled_ode variant (loops as Euler steps) was
           added 2026-12-07 in a run of its own: 111 s.
Result:    docs/results/depth_study/README.md (tables and discussion), depth_study.png (eval
           loss against test-time depth), depth_study.json (raw rows), depth_study.md (the
           tables generated from it).
"""
import ml_collections

from configs import default


def get_config():
  c = default.get_config()
  m, t = c.model, c.train
  m.d_model, m.num_heads, m.mlp_dim = 64, 2, 256
  m.num_layers = 5                  # 1 + 3 x 1 + 1 applied layers
  m.sharing.scheme = 'middle_cycle'
  m.sharing.num_unique = 3          # prelude, the looped layer, coda
  m.remat = 'none'
  t.batch_size, t.seq_len = 8, 64
  t.warmup_steps = 10
  t.log_every = 10
  t.eval_batch_size = 32
  t.keep_checkpoints = 1
  c.data.eval_tokens = 16384        # the first 16 K validation tokens (every depth, every run)
  c.study = s = ml_collections.ConfigDict()
  s.variants = 'all'      # comma list of sharenet/studies/depth_study.py VARIANTS, or all
  s.seeds = '0,1'         # train.seed values (init and data order)
  s.base_steps = 400      # the fixed-depth recursive model's steps: every variant's FLOPs budget
  s.mean = 3              # trained mean depth (loops of the looped layer) of the looped variants
  s.backprop = 2          # sampled-depth variants: gradient through the last 2 loops only
  s.depths = '1,2,3,4,6,8,12'   # test-time depths: 1 .. 4 x the mean
  s.prompts = 8           # decoding: a fixed batch of this many prompts from the validation split
  s.prompt_len = 32       # bytes per prompt
  s.new_tokens = 256      # greedy tokens per prompt
  s.decode_repeats = 7    # timed calls after the warm-up call (the median is reported)
  return c
