#!/usr/bin/env bash
# The bitwise serial-vs-overlapped test (with GPU waits at the lane's two meeting points)
# against two broken builds of the engine: no_start (the lane does not wait for the layer's
# stream) and no_join (the layer's stream does not wait for the lane). Each broken build must
# fail; the unmutated build must pass. Three runs each.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ovx/ov.tar.xz && tar -C .carry -xJf .carry/mutx/mut.tar.xz
export LD_LIBRARY_PATH=$PWD/.carry/ov/lib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.log"
for m in unmutated no_start no_join; do
  for i in 1 2 3; do
    timeout 60 .carry/mut/$m --gtest_filter='*WeightGradOverlap*' > "$OUT/run.log" 2>&1
    echo "$m run $i rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/run.log" | head -2 | tr '\n' ' ') $(grep -E '^\[ +(OK|FAILED) +\] Paths' "$OUT/run.log" | sed -E 's/.*SameBitsAsOnTheLayersStream\/([0-9]+).*\(([0-9]+ ms)\).*/\1:\2/' | tr '\n' ' ')" | tee -a "$OUT/summary.log"
    [[ $i == 1 ]] && cp "$OUT/run.log" "$OUT/$m-1.log"
  done
done
