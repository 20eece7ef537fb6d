#!/usr/bin/env bash
# Fifteenth session, third to fifth calls (build.sh rerun after each test change, .carry/ehx): gpu-check on
# the prebuilt binaries, then the CUDA engine's CPU-comparing tests again and again (fresh seeds
# each time; 15 rounds in the third call, 100 in the fourth and fifth) to look for the AdamW sign flip that
# failed the first call's recompute case.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ehx/eh.tar.xz
C=.carry/eh
{ date -u +%FT%TZ; echo "commit $(head -1 $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader; } | tee "$OUT/check.log"
timeout 220 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log" | tee -a "$OUT/check.log"; grep -E "FAILED|DIFFERS" "$OUT/gpu-check.log" | head -10
export LD_LIBRARY_PATH=$PWD/$C/lib
timeout 200 $C/moe_engine_cuda_test --gtest_filter='Shapes/CudaRecomputeTest.*:*CudaEngine*' --gtest_repeat=${REPEAT:-100} > "$OUT/repeat.log" 2>&1; echo "repeat rc=$?" | tee -a "$OUT/check.log"
grep -c "^\[       OK \]" "$OUT/repeat.log" | sed 's/^/OK lines: /' | tee -a "$OUT/check.log"
grep -c "^\[  FAILED  \]" "$OUT/repeat.log" | sed 's/^/FAILED lines: /' | tee -a "$OUT/check.log"
grep -E "Failure|err .* \(tol" "$OUT/repeat.log" | awk '$0 ~ /Failure/ {print}' | head -5
