#!/usr/bin/env bash
# gpu-check on the prebuilt binaries of the final commit.
set -uo pipefail
C=.carry/L15
echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 3 "$OUT/gpu-check.log"; grep -E "FAIL|multicast_b without" "$OUT/gpu-check.log" | head -10
