"""The one source of config defaults: the experiment config and the conversion options.

ModelConfig, parametrization.Settings, Transforms and the optimizer take their defaults from
here; a workdir written before a key existed is completed from here (`complete`, after
sharenet/config/migrations.py translates what was renamed or removed since).
"""
from __future__ import annotations

from typing import Any

import ml_collections

from sharenet.config.migrations import BEFORE_KEY, renamed


def default_config() -> ml_collections.ConfigDict:
  """The default experiment (configs/default.py); every config in configs/ starts from it.
  One commented assignment per key, so as long as the config (not split on purpose)."""
  c = ml_collections.ConfigDict()
  c.model = m = ml_collections.ConfigDict()
  m.vocab_size = 256          # byte-level tokens
  m.d_model = 256             # residual width
  m.num_layers = 4            # *applied* layers
  m.num_heads = 4             # must divide d_model
  m.num_kv_heads = 0          # 0 -> num_heads; fewer -> grouped-query attention
  m.mlp_dim = 768             # MLP hidden width
  m.mlp_tied = False          # the MLP's down projection is its nonlinear input projection
                              # transposed (CEM, arXiv:2605.07588: wo = wi_gate^T, gelu wi^T)
  m.mlp = 'swiglu'            # swiglu | geglu | gelu | selu (geglu: gelu(x W_gate) * x W_up,
                              # tanh GELU, Gemma's; selu: self-normalizing, with
                              # model.norm.kind=none)
  m.position = 'rope'         # rope | learned | none
  m.rope_base = 10000.0
  m.rope_scaling = rs = ml_collections.ConfigDict()   # RoPE for a longer context
  rs.kind = 'none'            # none | linear (every frequency / factor) | llama3 (Llama 3.1's:
                              # low frequencies / factor, high ones kept, smooth between)
  rs.factor = 1.0             # linear, llama3: the context stretch
  rs.low_freq_factor = 1.0    # llama3: wavelengths above original_max_len / this are divided
  rs.high_freq_factor = 4.0   # llama3: wavelengths below original_max_len / this are kept
  rs.original_max_len = 8192  # llama3: the context length the model was trained at
  m.max_len = 2048            # learned positions only
  m.attention_window = 0      # > 0: the model's sliding-window span (an imported Mistral /
                              # Gemma 2). Modelled within the window only, where it equals full
                              # attention: model.max_len and train.seq_len must be <= it
  m.attn_scale = 0.0          # 0 -> 1/sqrt(head_dim)
  m.attn_softcap = 0.0        # > 0: attention logits -> cap * tanh(logits / cap) (Gemma 2's
                              # attn_logit_softcapping); 0 = off
  m.logit_softcap = 0.0       # > 0: output logits -> cap * tanh(logits / cap) (Gemma 2's
                              # final_logit_softcapping); 0 = off
  m.tie_embeddings = False    # readout shares the embedding table
  m.embed_init_std = 1.0
  m.head_dim = 0              # 0 -> d_model // num_heads
  m.reader_bias = False       # biases on q/k/v, MLP-in and readout (written by conversions)
  m.proj_bias = 'none'        # none | qkv | all: biases on q, k, v (Qwen2), or on every block
                              # projection q, k, v, o, mlp_in, mlp_out (GPT-2); Hugging Face
                              # imports set it (docs/interop.md)
  m.embed_scale = 1.0         # multiplier on the embedded tokens, not on a tied readout
                              # (Gemma: sqrt(d_model))
  m.center_embedding = False  # subtract each embedded vector's mean (zero-mean writer, tied)
  m.embed_dim = 0             # > 0 (< d_model): factorized embeddings, a (vocab, embed_dim)
                              # table lifted to d_model (ALBERT, arXiv:1909.11942); 0 = off
  m.embed_projection = 'linear'   # with embed_dim: linear (ALBERT) | self_attentive
                              # (Subformer's SAFE, arXiv:2101.00234; models/embeddings.py)
  m.remat = 'dots'            # none | full | dots | dots_no_batch | save_names | offload_dots |
                              # except_attn
  m.scan_unroll = 1           # nn.scan unroll factor
  m.scan_layers = True        # False: Python loop over layers (benchmark baseline)
  m.scan_split_transpose = True  # weight grads of stacked sets as a map after the backward loop
  m.scan_lowering = 'nested'  # nested | flat: tied plans as nested scans, or one scan over
                              # gathered sets
  m.dtype = 'float32'         # compute dtype: float32 | bfloat16 (parameters, norm statistics,
                              # softmax, logits and loss stay float32; docs/scaling.md)
  m.kernels = 'auto'          # auto | xla | pallas: Pallas kernels (sharenet/kernels/) for the
                              # fused residual-add + norm and attention; auto = Pallas on GPU/TPU
                              # where the shapes allow, XLA otherwise; pallas on CPU = interpret
  m.attention = 'auto'        # auto | xla | chunked | cudnn | pallas: attention back-end; auto
                              # follows model.kernels on GPU/TPU and is chunked on CPU (causal
                              # query chunks: no upper-triangle logits); cudnn =
                              # jax.nn.dot_product_attention on cuDNN (GPU)
  m.dense_grad = 'auto'       # auto | xla | rows: how dense layers' weight gradients are formed;
                              # rows = one 2-D matmul x^T g over the flattened rows (what XLA:CPU
                              # runs without transposing the cotangent, docs/performance.md), xla =
                              # jax's own transpose rule; auto = rows on CPU, xla on GPU / TPU
  m.param_dtype = 'float32'
  m.attention_sharing = 'none'  # none | kv_shared | qk_shared | qkv_shared | cem: attention
                              # projections that are one (Q-K=V, arXiv:2606.04032): kv_shared
                              # the values are the keys (the KV cache holds K only), qk_shared
                              # the queries are the keys, qkv_shared one projection for all
                              # three (docs/sharing.md)
  m.loop_slices = ''          # SReT's sliced group attention (arXiv:2111.05297): group counts
                              # repeated over the loops of the looped segment, e.g. '4,1' (odd
                              # loops attend within 4 slices of train.seq_len, even loops over
                              # all); '' = off
  m.kv_sharing = 'none'       # none | first: later loops of the looped segment attend to the
                              # first loop's keys and values (Mixture-of-Recursions' recursive KV
                              # sharing, arXiv:2507.10524): its decode cache holds one loop's
                              # (docs/loops.md)
  m.masa = ma = ml_collections.ConfigDict()   # MASA, matrix atom sharing (arXiv:2508.04581)
  ma.atoms = 0                # S shared atoms per target kernel, W_l = sum_s c_ls D_s; 0 = off
  ma.targets = 'q,k,v,o'      # kernels built from atoms: any of q,k,v,o,mlp_in,mlp_out
  m.bank = bk = ml_collections.ConfigDict()   # parameter bank, Shapeshifter Networks
  bk.size = 0                 # > 0: the bank's parameters (a multiple of d_model); every target
                              # kernel generated from it (models/bank.py); 0 = off
  bk.targets = 'q,k,v,o,mlp_in,mlp_out'   # kernels generated from the bank
  m.mpo = mp = ml_collections.ConfigDict()   # MPO kernels, central tensor shared (MPOBERT)
  mp.cores = 0                # n > 1: each target kernel a chain of n local tensors whose
                              # central one every layer shares (models/mpo.py); 0 = off
  mp.bond = 0                 # the bond dimensions' cap; 0 = full (exact for any kernel)
  mp.targets = 'q,k,v,o,mlp_in,mlp_out'   # kernels built as MPOs
  m.sharing = s = ml_collections.ConfigDict()
  s.scheme = 'untied'         # untied | universal | cycle | sequence | middle_cycle |
                              # middle_sequence | sandwich | groups | explicit
  s.num_unique = 0            # stored sets (middle/sandwich count first and last); 0 -> from
                              # repeats
  s.repeats = 0               # applications of each shared set; 0 -> from num_unique
  s.pattern = ''              # explicit: comma-separated set index per applied layer
  s.untie_norms = False       # norm gains per applied layer (WideNet / Subformer)
  s.lora_rank = 0             # depth-wise LoRA rank (Relaxed Recursive Transformers); 0 = off
  s.lora_targets = 'q,v'      # any of q,k,v,o,mlp_in,mlp_out
  s.lora_scale = 1.0          # alpha / r
  s.lora_layers = 'shared'    # shared: LoRA on the applied layers of shared sets only (RRT: not
                              # on the unique first / last layers of middle schemes) | all
  s.lora_zero = 'b'           # factor that starts at zero: b (LoRA, RRT: B = 0, A ~ 1/sqrt(fan_in))
                              # | a (A = 0, B ~ 1/sqrt(r): x A starts at 0, like a zero-init
                              # readout, so a muP width coordinate check of x A has no init term)
  m.routing = rt = ml_collections.ConfigDict()   # Mixture-of-Recursions (docs/routing.md)
  rt.kind = 'none'            # none | expert_choice | token_choice: per-token recursion depth over
                              # the shared segment (sharing.scheme cycle | middle_cycle only)
  rt.capacity = ''            # expert_choice: comma list, fraction of the sequence each recursion
                              # keeps (non-increasing, in (0, 1]); '' -> (R - r) / R
  rt.router = 'linear'        # linear | mlp (2-layer GELU, hidden 2 * d_model)
  rt.alpha = 0.0              # gate scale; 0 -> the reference's: 0.1 expert_choice, 1.0
                              # token_choice
  rt.aux_loss = -1.0          # aux loss coefficient; -1 -> expert_choice BCE 0.001, token_choice
                              # balancing loss 0.1 (0 with balancing=bias); 0 = off (never added
                              # to eval_loss)
  rt.z_loss = -1.0            # router z-loss coefficient, mean logsumexp(logits)^2; -1 -> the
                              # reference configs': expert_choice 0, token_choice 1e-5; 0 = off
  rt.buckets = 0              # expert_choice scans: 0 -> one per recursion at its own k_r (fewest
                              # FLOPs, compile time grows with R); n -> n scans over contiguous
                              # groups, each padded to its first k (compile time flat in R)
  rt.balancing = 'loss'       # token_choice: loss (Switch-style aux loss) | bias (loss-free: a
                              # non-trainable bias on the exit scores, updated after every step)
  rt.bias_rate = 0.001        # balancing=bias: bias_i += bias_rate * sign(1/R - exit fraction_i)
  m.recurrence = rc = ml_collections.ConfigDict()   # recurrent depth (docs/loops.md)
  rc.depth = 'fixed'          # fixed | poisson_lognormal: loops of the looped segment per train
                              # step (poisson_lognormal: Geiping et al., arXiv:2502.05171)
  rc.mean = 0.0               # mean loops per step; 0 -> the plan's R (fixed: the loops, an int)
  rc.backprop = 0             # k: only the last k loops carry gradient (the rest run without
                              # storing activations); 0 -> every loop (fixed depth only)
  rc.injection = 'none'       # none | add | concat: the stream entering the looped segment
                              # re-enters every loop (concat: adapter on [state; injected])
  rc.init = 'embed'           # embed | zeros | normal: the state entering the first loop (embed:
                              # the stream itself, the only choice with injection none)
  rc.ode_step = False         # the loops as Euler steps of one ODE (neural-ODE acceleration of
                              # shared stacks): run at n loops, each branch is scaled by R / n,
                              # so fewer, larger steps span the trained depth (docs/loops.md)
  m.moe = mo = ml_collections.ConfigDict()   # experts inside the blocks (docs/experts.md)
  mo.kind = 'none'            # none | sigma_moe | switch: the feed-forward as experts; sigma_moe
                              # (MoEUT, arXiv:2405.16039): sigmoid-gated top-k of small ReLU
                              # experts; switch (arXiv:2101.03961): softmax top-1 with a capacity
  mo.num_experts = 8          # stored experts per block (tied with the block's set)
  mo.top_k = 0                # experts each token runs; 0 -> the kind's: switch 1, sigma_moe 2
  mo.expert_dim = 0           # hidden width of one expert; 0 -> mlp_dim // top_k (the executed
                              # hidden width of a dense MLP)
  mo.router_per_layer = False # the experts' selector per applied layer (the experts stay tied
                              # with their set), as the shared-expert Conformer (arXiv:2209.08326)
  mo.entropy_reg = 0.01       # sigma_moe: coefficient of the selection entropy regularizer
                              # (MoEUT's gamma); 0 = off (never added to eval_loss)
  mo.balance_loss = 0.01      # switch: coefficient of the load-balancing loss E sum_i f_i P_i
  mo.capacity_factor = 1.25   # switch: an expert takes ceil(factor * tokens / experts) tokens;
                              # the rest skip the feed-forward (the residual carries them)
  mo.dispatch = 'auto'        # auto | ragged_dot | reference: grouped matmul of the routed
                              # tokens; ragged_dot = jax.lax.ragged_dot, reference = sorted
                              # tokens in row blocks; auto = ragged_dot on GPU / TPU, reference
                              # on CPU (where ragged_dot expands to every expert)
  mo.attention = 'none'       # none | switchhead (MoEUT's expert value / output projections)
  mo.attention_experts = 8    # switchhead: experts per head
  mo.attention_top_k = 2      # switchhead: experts each token's head runs
  mo.attention_entropy_reg = 0.001  # switchhead: coefficient of the value / output selections'
                              # entropy regularizer (MoEUT's att_entropy_reg); 0 = off
  mo.lora_experts = 0         # Mixture of LoRAs (arXiv:2512.12880): routed LoRA experts on the
                              # shared feed-forward; 0 = off
  m.norm = n = ml_collections.ConfigDict()
  n.kind = 'rmsnorm'          # layernorm | rmsnorm | crmsnorm | scalenorm | dyt | none | lpnorm
                              # | powernorm | unified_norm | online_norm (running statistics:
                              # sharenet/models/norm_stats.py)
  n.placement = 'pre'         # pre | post | peri | moeut (MoEUT's peri-layernorm: norms only
                              # where a softmax / sigmoid reads: queries, keys, selectors)
  n.qk_norm = 'none'          # none | rms | l2 (l2: learned scalar replaces 1/sqrt(d_head))
  n.qk_scale_init = 0.0       # l2 QK-norm gain init; 0 -> log2(L^2 - L), L = qk_norm_len
  n.qk_norm_len = 0           # L of that init: the *training* sequence length (Henry et al.);
                              # 0 -> train.seq_len (ModelConfig.from_config fills it; a model
                              # section read without a train section: the default seq_len)
  n.dyt_alpha = 0.5           # DyT's initial alpha
  n.fixnorm = False           # FixNorm: unit-norm embedding rows x sqrt(d_model)
  n.pre_activation = 'none'   # none | layernorm | rmsnorm: norm on the MLP hidden
                              # pre-activations (gate and value of SwiGLU), NaP's part 1
  n.eps = 1e-6
  n.p = 1.0                   # lpnorm's order p > 0 (2 = layernorm; 1: Liao et al.'s L1)
  n.stats_momentum = 0.9      # powernorm / unified_norm: EMA of the running statistic (alpha_fwd,
                              # momentum)
  n.stats_grad_momentum = 0.9 # powernorm / online_norm: the backward's alpha_bkw
  n.stats_warmup = 10000      # steps on the batch statistic (warmup_iters: powernorm's 10,000;
                              # unified_norm's reference default is 4,000)
  n.groups = 1                # powernorm: channel groups of the group scaling (group_num)
  n.stats_window = 4          # unified_norm: window of batch statistics (window_size)
  n.outlier_filter = False    # unified_norm: outlier filtration (the reference's NLP default)
  n.online_ecm = 'ac'         # online_norm: error checking, ac (clamp to +-5) | ls (layer
                              # scaling) | none; its reference momenta: 0.999 / 0.99

  c.train = t = ml_collections.ConfigDict()
  t.steps = 120
  t.batch_size = 16
  t.seq_len = 256
  t.lr = 3e-3                 # peak learning rate
  t.schedule = 'wsd'          # wsd (warmup-stable-decay) | cosine | constant
  t.warmup_steps = 25
  t.decay_fraction = 0.3      # wsd: final fraction of steps spent decaying to min_lr
  t.min_lr_ratio = 0.0
  t.weight_decay = 0.1        # decoupled (AdamW)
  t.decay_roles = 'matrices'  # decayed roles: matrices, norm_in, norm_out, bias, scalar, reparam
  t.b1 = 0.9
  t.b2 = 0.95
  t.eps = 1e-8
  t.grad_clip = 1.0           # global-norm clipping; 0 = off
  t.optimizer = 'adamw'       # adamw | muon | shampoo | kfac: the optimizer of the matrix_roles
                              # kernels (kfac: reader, writer only);
                              # every other leaf stays on AdamW (sharenet/optim/matrix.py) |
                              # scion: every leaf by its role's LMO (sharenet/optim/scion.py)
  t.matrix_roles = 'reader,writer'  # muon / shampoo: kernel roles they take (reader, writer,
                              # readout, router, embedding, pos_embed, lora)
  t.muon = mu = ml_collections.ConfigDict()
  mu.momentum = 0.95          # Muon's Nesterov momentum (optax.contrib.scale_by_muon beta)
  mu.ns_steps = 5             # Newton-Schulz iterations
  mu.scale = 'shape'          # shape: optax's sqrt(max(1, fan_out/fan_in)) | rms: Moonlight's
                              # 0.2 sqrt(max(fan_in, fan_out)), AdamW's update RMS
  t.shampoo = sh = ml_collections.ConfigDict()
  sh.block_size = 128         # preconditioner blocks of at most block_size x block_size (>= 1)
  sh.update_every = 1         # recompute the inverse 4th roots every n steps
  sh.eps = 1e-6               # damping added to each statistic before its inverse root
  sh.graft = 'adam'           # adam: each block's step has Adam's size | none: vanilla Shampoo
                              # (the setting of its second-order muP; docs/optimizers.md)
  t.kfac = kf = ml_collections.ConfigDict()   # train.optimizer=kfac (sharenet/optim/kfac.py)
  kf.update_every = 1         # recompute the factors' inverses every n steps
  kf.damping = 1e-3           # rho added to each factor (A and G) before its inverse
  kf.decay = 0.95             # EMA decay of the Kronecker factors
  kf.graft = 'adam'           # adam: each stored set's step has Adam's size | none: K-FAC's own
                              # step (the setting of its second-order muP; docs/optimizers.md)
  t.scion = sc = ml_collections.ConfigDict()   # train.optimizer=scion (sharenet/optim/scion.py)
  sc.momentum = 0.1           # a: m <- (1 - a) m + a g (the reference's `momentum`; 1 = none)
  sc.radius = 50.0            # rho of every leaf but the readout (the reference's `scale`)
  sc.output_radius = 3000.0   # rho of the readout (its nanoGPT example: 60 x radius, lr 2^-12)
  sc.constrained = True       # W <- (1 - lr) W - lr rho lmo(m); False: W <- W - lr rho lmo(m)
                              # (constrained needs train.weight_decay=0: it decays by itself)
  sc.ns_steps = 5             # Newton-Schulz iterations of the spectral LMO
  t.lr_groups = ''            # 'GROUP:MULT,...': LR multipliers per layer group, any optimizer:
                              # embedding | hidden | readout | vector (sharenet/optim/chain.py)
  t.grad_accum = 1            # micro-batches per step (batch_size must divide)
  t.exit_loss = 'last'        # last | all | comma list of weights: the loss at the exit of every
                              # gradient loop of the looped segment through the coda and the
                              # shared head (all: their mean; weights: their weighted mean)
  t.seed = 0
  t.log_every = 10
  t.eval_every = 0            # 0 -> only at the end
  t.eval_batch_size = 32
  t.trainable = 'all'         # all | lora | adapters | role list | path regex: the rest frozen,
                              # without optimizer state (sharenet/optim/trainable.py)
  t.teacher = te = ml_collections.ConfigDict()   # distillation (sharenet/train/teacher.py)
  te.workdir = ''             # a workdir whose model the run distills from ('' : none)
  te.temperature = 1.0        # softmax temperature of the KL (scaled by T^2)
  te.weight = 1.0             # loss = (1 - weight) CE + weight KD; 1: distillation only
  te.match = ''               # hidden-state matching 'S:T,...': the student's stream after its
                              # applied layer S against the teacher's after layer T ('' : none)
  te.match_weight = 1.0       # adds match_weight * the mean squared difference of the streams
  te.match_norm = True        # each stream divided by its RMS over d_model first
  t.eval_tasks = ''           # lm-evaluation-harness tasks run at every eval, logged as
                              # task/<task>/<metric> (sharenet/tasks/, docs/evaluation.md)
  t.eval_task_dir = ''        # also the harness task definitions (YAML) under this directory
  t.eval_num_fewshot = -1     # shots per item; -1: each task's own
  t.eval_task_limit = 0       # the first n items of each task; 0: all
  t.checkpoint_every = 40
  t.keep_checkpoints = 3
  t.progress = True           # progress bar on stderr
  t.batch_ramp = ''           # 'BATCH:LAST_STEP,...': smaller batches first, then batch_size
                              # (sharenet/train/batch_ramp.py); '' : none
  t.skip_nonfinite = False    # skip a step whose gradient norm is not finite (parameters and
                              # optimizer state unchanged) instead of stopping
  t.spike_factor = 0.0        # > 1: also skip a step whose gradient norm exceeds this many times
                              # the median of the last spike_window accepted steps'; 0 = off
  t.spike_window = 100
  t.max_skips = 5             # steps skipped in a row before the run stops (one line naming it)
                              # (sharenet/optim/guard.py)
  t.ema = 0.0                 # decay of the weights' moving average (e.g. 0.999), kept in the
                              # optimizer state and evaluated beside the weights; 0 = off
                              # (sharenet/optim/ema.py; eval.py --ema)
  t.watch = False             # per role / stored set / applied layer RMS of parameters,
                              # gradients, updates and the residual stream in the log rows
                              # (sharenet/train/watch.py; computed at log steps only)
  t.profile = pr = ml_collections.ConfigDict()
  pr.steps = ''               # 'START:END': a jax profiler trace of those steps in DIR/profile
                              # (sharenet/train/profile.py); '' : none
  t.loggers = 'jsonl,tensorboard'   # + wandb (Weights & Biases); jsonl is always written
                              # (sharenet/train/metrics.py)
  t.wandb = wb = ml_collections.ConfigDict()   # train.loggers=...,wandb
  wb.project = 'sharenet'
  wb.entity = ''              # '' : the account's default
  wb.name = ''                # '' : the workdir's name
  wb.mode = ''                # online | offline | disabled; '' : WANDB_MODE, else online
  t.tying = ty = ml_collections.ConfigDict()   # dynamic layer tying (arXiv:2401.12819)
  ty.every = 0                # > 0: every this many steps a controller re-chooses the explicit
                              # plan (model.sharing.scheme=explicit; its pattern is the first):
                              # each layer trains its own weights or copies an earlier layer's
                              # and stays tied to it (sharenet/train/dynamic_tying.py); 0 = off
  ty.epsilon = 0.1            # the bandit's exploration: a layer's random choice, per decision
  ty.step_size = 0.5          # the weight of the newest reward in an arm's value (recency)
  ty.max_sets = 0             # the most stored sets a chosen plan may have; 0 = num_layers
  ty.eval_tokens = 8192       # validation tokens of the reward's loss; 0 = data.eval_tokens'
  t.restore = 'auto'          # auto: resume the whole saved state | params: when the saved state
                              # no longer fits the config, load its parameters (and data position)
                              # with a fresh optimizer state (sharenet/train/resume.py)

  c.data = d = ml_collections.ConfigDict()
  d.source = 'stdlib'         # stdlib | text | bin | arrayrecord | hf
  d.path = ''                 # glob of text files, a .bin token file, an arrayrecord directory,
                              # or (hf) a dataset NAME[:CONFIG] or local dataset directory
  d.text_field = 'text'       # hf: the column holding each document's text
  d.bin_dtype = 'uint16'      # bin token ids: uint16 (nanoGPT) | uint32
  d.seed = -1                 # shuffle seed; -1 -> train.seed
  d.num_workers = 0
  d.tokenizer = 'auto'        # auto | bytes | sentencepiece:PATH | hf:PATH: the data's tokenizer
                              # (sharenet/data/corpus.py for_data): auto = bytes for stdlib /
                              # text, the shards' own for arrayrecord, none for bin
  d.segment_mask = False      # arrayrecord: batches carry segment ids, attention stays within
                              # each packed document (sharenet/data/arrayrecord.py)
  d.shuffle_windows = 0       # arrayrecord: each batch row reads this many packed windows at a
                              # time and emits them shuffled (0: off; sharenet/data/arrayrecord.py)
  d.mixture = ''              # arrayrecord: 'DIR_A:0.8,DIR_B:0.2' draws batches from prepared
                              # directories by weight, in place of data.path
                              # (sharenet/data/mixture.py)
  d.mixture_schedule = ''     # 'STEP:W_A/W_B,...': the mixture's weights from each STEP on
  d.eval_tokens = 0           # evaluated validation tokens: 0 -> the whole split; n -> its
                              # first n predicted tokens (quick evals of a big split; the tests)

  c.transforms = tr = ml_collections.ConfigDict()   # sharenet/transforms
  tr.reparam = ''             # comma list, applied in order: zero_mean_writers, weight_std,
                              # weight_norm, sigma_reparam, scale_vectors, weight_conditioning,
                              # compander
  tr.reparam_paths = 'kernel$'  # regex over '/'-joined paths selecting kernels to reparametrize
  tr.reparam_roles = ''       # and/or kernel roles: reader, writer, readout ('' = any)
  tr.sigma_iters = 1          # sigma-reparam power iterations per step
  tr.compander_gamma = 0.5    # compander's initial exponent (learned; 1 = identity)
  tr.project = 'none'         # post-step projection: none | ngpt | nap (Normalize-and-Project;
                              # needs model.norm.pre_activation) | norm_project (matrices only)
  tr.updates = ''             # comma list: agc, adamp
  tr.agc_clip = 0.01          # AGC lambda
  tr.agc_eps = 1e-3
  tr.adamp_delta = 0.1
  tr.adamp_wd_ratio = 0.1

  c.parametrization = p = ml_collections.ConfigDict()
  p.kind = 'sp'               # sp | mup | mup_table3 | umup | completep
                              # (sharenet/parametrization/rules.py)
  p.base_d_model = 0          # width of the proxy model the multipliers are relative to;
                              # 0 -> d_model
  p.base_num_heads = 0        # heads of the proxy; 0 -> num_heads (head_dim scales with width)
  p.base_depth = 0            # completep: unique sets of the depth proxy; 0 -> same depth
  p.depth_alpha = 1.0         # completep: residual branch x m_L^-alpha
  p.loop_rule = 'none'        # none | inv_R | inv_sqrt_R: branch multiplier of a block applied
                              # R times
  p.wd_mode = 'auto'          # lr_coupled: decay lr(t)*wd*p per leaf | independent: (lr(t)/lr)*wd*p
                              # | auto: independent for umup (u-muP's default), else lr_coupled.
                              # independent decays wd per step at peak LR: the lr_coupled
                              # equivalent is wd = lr * train.weight_decay (0.1 -> 10%/step)
  p.residual_mult = 1.0       # umup tau rule: branch / embedding variance contribution
  p.residual_attn_ratio = 1.0 # umup tau rule: attention / MLP branch contribution
  p.readout_zero_init = False # readout kernel initialised at zero (TP5 D.2; any kind)
  p.query_zero_init = False   # query kernels initialised at zero (TP5 D.2; any kind)
  p.qk_lr = 1.0               # LR multiplier on the query and key kernels (any kind and optimizer;
                              # a parameter-dependent LR as an alternative to QK-norm)

  c.mesh = mh = ml_collections.ConfigDict()
  mh.data = -1                # data-parallel replicas; -1 -> the devices left by fsdp, tensor
  mh.fsdp = 1                 # params and optimizer state sharded over embed (ZeRO-3 style)
  mh.tensor = 1               # tensor parallel: attention heads, MLP hidden, vocab
  mh.expert = 1               # expert parallel: model.moe's experts (must divide num_experts)
  mh.distributed = False      # multi-host: jax.distributed.initialize()
                              # (or $SHARENET_DISTRIBUTED=1)
  # Logical axis -> mesh axes (first match wins; see sharenet/train/sharding.py). Scan
  # axes unsharded.
  mh.rules = (
      ('activation_batch', ('data', 'fsdp')), ('activation_length', None),
      ('activation_embed', None), ('activation_heads', 'tensor'),
      ('activation_mlp', 'tensor'), ('activation_vocab', 'tensor'),
      ('embed', 'fsdp'), ('heads', 'tensor'), ('kv_heads', 'tensor'), ('mlp', 'tensor'),
      ('vocab', 'tensor'), ('head_dim', None), ('length', None), ('lora', None),
      ('embed_factor', None), ('embed_factor_hidden', None), ('bank', 'tensor'),
      ('layers', None), ('repeats', None), ('atoms', None), ('experts', 'expert'),
  )

  c.dry_run = False           # print params' shardings and the step's memory, then exit
  return c


def conversion_config() -> ml_collections.ConfigDict:
  """Options of convert.py (sharenet.main.convert_workdir.convert_workdir)."""
  c = ml_collections.ConfigDict()
  c.to = ''                   # rmsnorm | crmsnorm | recursive | head_shared |
                              # merge_lora_experts | fold_unified_norm | wider | mpo
  c.scheme = 'cycle'          # recursive: universal | cycle | sequence | middle_cycle |
                              # middle_sequence
  c.num_unique = 0            # recursive: stored sets (middle schemes count first and last), >= 1
  c.init = 'stepwise'         # recursive: stepwise | average | lower, or with scheme=explicit
                              # similar (contiguous groups by output similarity, FoldGPT) |
                              # replace (FlexiGPT: low-influence blocks take a donor's weights) |
                              # extend (tied copies inserted); sharenet/transforms/block_select.py
  c.remove_rate = 0.0         # recursive: fraction of blocks removed first (FoldGPT), 0 = none
  c.importance = 'gates'      # remove_rate's ranking: gates (FoldGPT's learned block gates) |
                              # influence (Block Influence, 1 - cos(stream in, stream out))
  c.gate_steps = 100          # importance=gates: Adam steps on the calibration batch
  c.gate_lr = 0.02
  c.gate_l1 = 0.01            # the gates' L1 penalty beside the next-token loss
  c.replace_rate = 0.0        # init=replace: fraction of blocks pruned and replaced
  c.insert_after = ''         # init=extend: comma list of layers each followed by a tied copy
  c.calibration = ''          # init=similar / replace, remove_rate: a text file for the
                              # calibration batch, encoded with the workdir's tokenizer; '' = its
                              # data's validation split
  c.calibration_windows = 8   # windows of train.seq_len tokens in the calibration batch
  c.lora_rank = 0             # recursive: depth-wise LoRA rank; 0 = off
  c.lora_init = 'zero'        # zero | svd (truncated SVD of each layer's residual)
  c.lora_layers = 'shared'    # recursive: shared (LoRA on shared layers only, RRT) | all
  c.lora_targets = ''         # comma list of q,k,v,o,mlp_in,mlp_out; '' -> the source's
  c.untie_norms = False       # recursive: norm gains per applied layer
  c.share_rate = 0.3          # head_shared: fraction of all heads replaced by their best match
                              # in an earlier layer (DirectShare, arXiv:2402.11819)
  c.post_train_steps = 0      # head_shared: PostShare's post-training first (Adam steps on the
                              # calibration batch with the weight-similarity constraint), then
                              # the sharing; 0 = DirectShare
  c.post_train_lr = 1e-4
  c.similarity_weight = 0.5   # PostShare's loss: (1 - w) next-token loss + w similarity term
  c.mpo_cores = 0             # mpo: local tensors per kernel (>= 2; MPOBERT's n, e.g. 5)
  c.mpo_bond = 0              # mpo: the bonds' cap; 0 = full (exact for stored set 0)
  c.mpo_targets = ''          # mpo: comma list of q,k,v,o,mlp_in,mlp_out; '' -> every kernel
                              # the source stores
  c.d_model = 0               # wider: the new d_model (row-column growth,
                              # sharenet/transforms/widen.py)
  c.mlp_dim = 0               # wider: the new mlp_dim; 0 = scaled with d_model
  c.num_heads = 0             # wider: the new heads; 0 = d_model / the source's head_dim
  c.seed = 0                  # wider: the draw of the new units beyond whole copies
  c.expert_weights = ''       # merge_lora_experts: comma list of model.moe.lora_experts weights
                              # (one-hot e: exact where every token picks e; docs/experts.md)
  return c


def _merge(base: dict[str, Any], over: Any) -> dict[str, Any]:
  over = over.to_dict() if hasattr(over, 'to_dict') else over
  for k, v in over.items():
    v = v.to_dict() if hasattr(v, 'to_dict') else v
    base[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
  return base


def complete(raw: Any) -> ml_collections.ConfigDict:
  """`raw` (a config or a config.json's dict, maybe older than some keys) over the defaults."""
  raw = renamed(raw)
  for (*groups, key), old in BEFORE_KEY.items():
    node = raw
    for g in groups:
      node = node.get(g) if isinstance(node, dict) else None
    if isinstance(node, dict) and key not in node:
      node[key] = old
  return ml_collections.ConfigDict(_merge(default_config().to_dict(), raw))


def fill(group: str, partial: Any = None) -> ml_collections.ConfigDict:
  """The default config's `group` with the keys `partial` (dict, ConfigDict or None) sets."""
  return complete({group: partial or {}})[group]
