#!/usr/bin/env bash
# The bitwise serial-vs-overlapped test with its large cases (test source of this commit's
# working tree), against two broken builds of the engine: no_start (the lane does not wait for
# the SwiGLU backward pass) and no_join (the layer's stream does not wait for the lane). Each
# broken build must fail; the unmutated build must pass. Three runs each.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ovx/ov.tar.xz && tar -C .carry -xJf .carry/mutx/mut.tar.xz
export LD_LIBRARY_PATH=$PWD/.carry/ov/lib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.log"
for m in unmutated no_start no_join; do
  for i in 1 2 3; do
    timeout 100 .carry/mut/$m --gtest_filter='*WeightGradOverlap*' > "$OUT/$m-$i.log" 2>&1
    echo "$m run $i rc=$? $(grep -c DIFFERS "$OUT/$m-$i.log") tensor comparisons differ; $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/$m-$i.log" | tr '\n' ' ')" | tee -a "$OUT/summary.log"
  done
done
grep -h "^\[  FAILED  \] Paths" "$OUT"/no_*-1.log | sort | uniq -c | tee -a "$OUT/summary.log"
grep -h "OK \]" "$OUT/unmutated-1.log" | tee -a "$OUT/summary.log"
