#!/usr/bin/env bash
# scripts/bench with the GPU's clock and temperature recorded on both sides and every timed
# series started at or below 50 C (waiting at most 5 s), for the presets given as arguments.
set -uo pipefail
C=.carry/mb
export LD_LIBRARY_PATH=$PWD/$C/lib
nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,clocks.max.sm,power.limit --format=csv,noheader
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 560 scripts/bench --bin $C/moe_bench \
  --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 "$@" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v "^{" "$OUT/bench.log" | tail -n 30
