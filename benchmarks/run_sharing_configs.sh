#!/usr/bin/env bash
# Trains every sharing config for its 200 steps, then prints the README table.
# Runtime: ~40 min on the 2-core CPU (run nothing else meanwhile: tokens/s is measured).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/sharing}
CONFIGS=${CONFIGS:-"untied universal cycle sequence middle_cycle_lora sandwich"}
dirs=()
for c in $CONFIGS; do
  rm -rf "$OUT/$c"
  /usr/bin/time -f "$c wall %e s" python train.py --config "configs/$c.py" --workdir "$OUT/$c" \
    --config.train.progress=False
  dirs+=("$OUT/$c")
done
python -m benchmarks.summarize_runs "${dirs[@]}" --json="$OUT/sharing_cpu.json"
