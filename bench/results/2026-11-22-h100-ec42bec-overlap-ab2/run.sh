#!/usr/bin/env bash
# Two checks of the weight-gradient lane (ec42bec):
# 1. the bitwise serial-vs-overlapped test against two broken builds of the engine: one whose
#    lane does not wait for the SwiGLU backward pass (no_start), one whose layer stream does
#    not wait for the lane (no_join); each must fail it;
# 2. the A/B again (moe_bench's bwd_ser / bwd_ovl) on the presets where the first run's
#    difference was small or the other way, with torch_moe_reference.py in the same call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ovx/ov.tar.xz && tar -C .carry -xJf .carry/mutx/mut.tar.xz
C=.carry/ov
export LD_LIBRARY_PATH=$PWD/$C/lib
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
for m in no_start no_join; do
  for i in 1 2 3; do
    timeout 60 .carry/mut/$m --gtest_filter='*WeightGradOverlap*' > "$OUT/mutant-$m-$i.log" 2>&1
    echo "mutant $m run $i rc=$? $(grep -c DIFFERS "$OUT/mutant-$m-$i.log") tensors differ; $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/mutant-$m-$i.log" | tr '\n' ' ')" | tee -a "$OUT/bench.log"
  done
done
timeout 60 $C/moe_engine_cuda_test --gtest_filter='*WeightGradOverlap*' > "$OUT/unmutated.log" 2>&1; echo "unmutated rc=$? $(tail -n 1 "$OUT/unmutated.log")" | tee -a "$OUT/bench.log"
stamp mutants done | tee -a "$OUT/bench.log"
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 330 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 sonic-7b olmoe qwen3-a3b mixtral scale-128k scale-8k >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
stamp all done | tee -a "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | grep -E "^(preset|sonic|olmoe|qwen|mixtral|deepseek|scale)" | cut -c1-150
