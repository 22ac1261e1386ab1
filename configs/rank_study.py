"""Rank study (issue 31 item 5): eval loss of a recursive conversion against its depth-wise
LoRA rank, no uptraining (sharenet/studies/rank_study.py), on an imported Hugging Face model.

The source here is this repository's default model exported to the Hugging Face Llama format and
imported back (the import is exact: tests/interop/test_hf_interop.py), i.e. the pipeline a
downloaded checkpoint goes through, on a model trained on the embedded corpus (a random fixture
would only show noise):

Command:   python train.py --workdir runs/default
           python -m sharenet.interop.export_hf --workdir runs/default --out runs/default_hf
           python -m sharenet.interop.import_hf --model runs/default_hf --out runs/default_import
           python -m sharenet.studies.rank_study --config configs/rank_study.py \
               --out runs/rank_study --config.study.source=runs/default_import
Runtime:   2 min 16 s for the training, then 7 min 29 s on the 2-core CPU for the 10
           conversions and the 11 evaluations over the whole validation split (measured
           2026-12-04; --config.study.eval_tokens=N evaluates fewer bytes).
Result:    docs/results/rank_study/README.md (rank_study.md and .png copied from OUT).
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.study = s = ml_collections.ConfigDict()
  s.source = 'runs/default_import'   # an untied workdir (train.py, import_hf)
  s.scheme = 'cycle'                 # convert.py --config.scheme
  s.num_unique = 2                   # stored sets (the default model applies 4 layers)
  s.init = 'average'                 # stepwise | average | lower (RRT's initialisations)
  s.lora_targets = 'q,k,v,o,mlp_in,mlp_out'
  s.untie_norms = True               # norm gains per applied layer (exact at full rank)
  s.ranks = '0,1,2,4,8,16,32,64,128,256'   # 256 = d_model: every residual kept whole
  s.eval_tokens = 0                  # validation tokens (bytes) of the embedded corpus each
                                     # workdir is evaluated on; 0 = the whole split
  return c
