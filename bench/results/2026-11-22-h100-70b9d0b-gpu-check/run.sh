#!/usr/bin/env bash
# gpu-check on the prebuilt test binaries of this commit (one PinnedHostBuffer for the CUDA engine's three pinned
# host stagings; host code only).
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/gcx/gc.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 280 scripts/gpu-check --prebuilt .carry/gc > $OUT/gpu-check.log 2>&1; echo "gpu-check rc=$?"
tail -n 1 $OUT/gpu-check.log; grep -E "^FAIL|FAILED" $OUT/gpu-check.log | head
