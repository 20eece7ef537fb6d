#!/usr/bin/env bash
# e069af6 (the lane's buffers reserved first, the serial order where the pool cannot give
# them): gpu-check on the prebuilt binaries; the lane test against the two broken engines
# again; the largest T (recompute and keep-H); scripts/bench on three presets (torch in the
# same call) as a check that the overlapped path is unchanged.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/fnx/fn.tar.xz && tar -C .carry -xJf .carry/mut2x/mut2.tar.xz
C=.carry/fn
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 200 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "FAILED|error|DIFFERS" "$OUT/gpu-check.log" | head -20
export LD_LIBRARY_PATH=$PWD/$C/lib
for m in no_start no_join; do
  timeout 60 .carry/mut2/$m --gtest_filter='*WeightGradOverlap*' > "$OUT/mutant.log" 2>&1
  echo "mutant $m rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/mutant.log" | head -2 | tr '\n' ' ' | cut -c1-80) failed cases: $(grep -cE '^\[  FAILED  \] Paths.*\(' "$OUT/mutant.log")" | tee -a "$OUT/bench.log"
done
rm -f "$OUT/mutant.log"
stamp max-t | tee -a "$OUT/bench.log"
{ timeout 130 $C/moe_bench --max-t --recompute --max-t-seconds 100; echo "rc=$?";
  timeout 60 $C/moe_bench --max-t --max-t-seconds 40; echo "rc=$?"; } > "$OUT/maxt.log" 2>&1
grep "largest T" "$OUT/maxt.log"
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 150 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 sonic-7b olmoe scale-8k >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
stamp all done | tee -a "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | grep -E "^(preset|sonic|olmoe|scale)" | cut -c1-150
