"""Experts study (issue 30 part 7): a MoEUT model (sigma-MoE feed-forward, SwitchHead attention,
MoEUT's norms, groups G=2) vs a sigma-MoE-only G=2 model vs a dense G=2 model vs the untied
baseline, at equal stored parameters and at equal training FLOPs.

Base: untied, 6 applied layers, d_model 64, 2 heads, SwiGLU 256, RoPE, pre-RMSNorm, byte-level,
the embedded stdlib corpus, batch 8 x 64 bytes, AdamW at the default LR and WSD schedule. The
variants (sharenet/studies/moe_study.py VARIANTS) change the sharing plan, the feed-forward and
(moeut) the attention and norm placement: dense_universal, moeut and moeut_ffn use MoEUT's
grouping (arXiv:2405.16039: G=2 stored layers applied A B A B A B) and are sized to the untied
model's stored parameters, dense_universal by its mlp_dim, the MoE models by their expert count
at expert_dim 32 and top_k 8 (k x expert_dim = 256 = the base mlp_dim, as MoEUT's 44M model
runs k x d_expert = 12 x 128 = 1536 ~ 3.7 d_model); moeut adds SwitchHead (4 experts per head,
2 active) and model.norm.placement=moeut; dense_universal_small is the same G=2 plan at the
base mlp_dim (the untied FLOPs per token).

Command:   taskset -c 1 python -m sharenet.studies.moe_study --config configs/moe_study.py \
               --out runs/moe_study
           (docs/results/moe_study/ holds copies of OUT/{results.json,table.md,plot.png}; the
           runs' workdirs stay in OUT/runs; --config.study.variants=a,b runs a slice)
Runtime:   ~18 min pinned to one core of the 2-core CPU (`taskset -c 1`), measured in two
           parts: 713 s on 2026-12-03 for the 10 runs of the other variants (107-370 steps of
           8 x 64 bytes with their evaluations, plus ~10 s of start-up) and 356 s on 2026-12-04
           for moeut's 4 runs (300 and 321 steps); the MoE runs take 77-96 s each, the untied
           ones 24-45 s.
Result:    docs/results/moe_study/README.md (tables and the reading against the paper's claim),
           table.md (generated from results.json by python -m sharenet.studies.results_tables),
           plot.png (eval loss against training FLOPs).
"""
import ml_collections

from configs import default


def get_config():
  c = default.get_config()
  m, t = c.model, c.train
  m.d_model, m.num_heads, m.mlp_dim = 64, 2, 256
  m.num_layers = 6                  # applied layers; G=2 variants: 2 stored sets x 3 repeats
  m.remat = 'none'
  t.batch_size, t.seq_len = 8, 64
  t.warmup_steps = 10
  t.log_every = 25
  t.eval_batch_size = 32
  t.keep_checkpoints = 1
  c.data.eval_tokens = 16384        # the first 16 K validation tokens (every run)
  c.study = s = ml_collections.ConfigDict()
  s.variants = 'all'      # comma list of sharenet/studies/moe_study.py VARIANTS, or all
  s.seeds = '0,1'         # train.seed values (init and data order)
  s.base_steps = 300      # steps of the equal-params comparison; x untied FLOPs = the budget
  s.groups = 2            # G: stored layer sets of the grouped (MoEUT) plan
  s.expert_dim = 32       # moeut: hidden width of one sigma-MoE expert
  s.top_k = 8             # moeut: experts each token runs
  s.entropy_reg = 0.01    # moeut: MoEUT's selection-entropy coefficient (its gamma)
  s.attention_experts = 4   # moeut: SwitchHead experts per head (MoEUT's 44M model: 8)
  s.attention_top_k = 2     # moeut: SwitchHead experts each head runs (MoEUT's: 2)
  s.attention_entropy_reg = 0.001   # moeut: SwitchHead selection entropy (MoEUT's default)
  return c
