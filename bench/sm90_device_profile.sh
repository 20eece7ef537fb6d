#!/usr/bin/env bash
# A short call on the GPU machine: the correctness test (plus compute-sanitizer memcheck) and
# Nsight Compute's speed-of-light and warp-stall sections for the sonic-7b up- and
# down-projection kernels (heuristic tiles), to see where their time goes. Expects
# bench/sm90_build_carry.sh's binaries in .carry/e; writes logs to $OUT.
set -uo pipefail
dir=.carry/e
out=${OUT:-/tmp/sm90_out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$dir/lib:${LD_LIBRARY_PATH:-}
if [ -z "${SKIP_TEST:-}" ]; then  # SKIP_TEST=1: profile only
echo "== correctness"
timeout 300 "$dir/sm90_expert_forward_test" > "$out/test.log" 2>&1; echo "test rc=$?"
grep -vE "^PASS" "$out/test.log"; grep -c "^PASS" "$out/test.log" | sed 's/^/PASS lines: /'
grep "stacked=1" "$out/test.log" | head -4
timeout 200 compute-sanitizer --tool memcheck --print-limit 5 "$dir/sm90_expert_forward_test" \
  > "$out/memcheck.log" 2>&1; echo "memcheck rc=$?"
grep -E "ERROR SUMMARY" "$out/memcheck.log"
fi
# The bench launches the first config's up kernel 23 times (3 warm-up), then its down kernel.
sections="--section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis"
for which in up:3 down:26; do
  name=${which%%:*}; skip=${which##*:}
  timeout 200 ncu --clock-control none -k regex:sm90_grouped_gemm --launch-skip "$skip" \
    --launch-count 1 $sections "$dir/sm90_bench" sonic-7b > "$out/ncu_$name.log" 2>&1
  echo "== ncu $name rc=$?"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L1/TEX Cache Throughput|Stall|Warp Cycles Per Issued|Mem Busy|Max Bandwidth|L2 Hit" "$out/ncu_$name.log" | head -30
done
