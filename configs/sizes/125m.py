"""The 125M size preset (configs/sizes/presets.py):
d_model 768, 12 layers, 12 heads (12 kv), SwiGLU 2048.

Command:   python train.py --config configs/sizes/125m.py[:cycle|:middle_cycle_lora] --workdir DIR
           (on the preset's slice; elsewhere set --config.mesh.fsdp and --config.train.batch_size)
Runtime:   a pod run. Its dry run on the 2-core CPU, simulated devices:
           XLA_FLAGS=--xla_force_host_platform_device_count=N python train.py \
               --config configs/sizes/125m.py --config.dry_run=True
Result:    docs/scaling.md, "Size presets": parameters, FLOPs per token, the slices its dry run
           fits (state and step peak per device) and the roofline's step time.
"""
from configs.sizes import presets


def get_config(plan: str = 'untied'):
  return presets.config('125m', plan)
