#!/usr/bin/env bash
# gpu-check on the prebuilt binaries of the final commit.
set -uo pipefail
C=.carry/fc
echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "^\[  FAILED|HostStaging.*OK" "$OUT/gpu-check.log" | head -10
