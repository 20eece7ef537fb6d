#!/usr/bin/env bash
# gpu-check only, on the prebuilt binaries (carried xz-compressed), logs to $OUT.
set -uo pipefail
mkdir -p .carry/L11 && xz -dc .carry/L11z/bin.tar.xz | tar -C .carry/L11 -xf -
{ echo "commit $(cat .carry/L11/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/run.log"
S=$(date +%s)
timeout 280 scripts/gpu-check --prebuilt .carry/L11 > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$? +$(( $(date +%s) - S ))s" | tee -a "$OUT/run.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "^\[  FAILED|FAIL " "$OUT/gpu-check.log" | head
grep -E "^\[       OK \].*T256_E128" "$OUT/gpu-check.log" | head -3
