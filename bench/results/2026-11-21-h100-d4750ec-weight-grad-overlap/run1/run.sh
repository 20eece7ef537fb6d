#!/usr/bin/env bash
# One device call: the weight-grad test (+ the two broken layouts, which must FAIL), the bench
# (old vs new configs vs per-expert cuBLAS) and the PyTorch reference on the same presets.
set -uo pipefail
C=${C:-.carry/wg1}
P="sonic-7b scale-8k qwen3-a3b olmoe ${EXTRA_PRESETS:-}"
export LD_LIBRARY_PATH=$PWD/$C/lib
t0=$(date +%s)
{ echo "commit $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; } | tee "$OUT/info.log"
timeout 60 $C/sm90_weight_grad_test > "$OUT/test.log" 2>&1; echo "test rc=$?" >> "$OUT/test.log"
for b in swapped_offsets no_swizzle; do
  timeout 40 $C/sm90_weight_grad_test_$b > "$OUT/test_$b.log" 2>&1; echo "test_$b rc=$? (expect 1)" >> "$OUT/test_$b.log"
done
for f in test test_swapped_offsets test_no_swizzle; do echo "$f: $(grep -c ^PASS $OUT/$f.log) PASS $(grep -c ^FAIL $OUT/$f.log) FAIL; $(tail -n1 $OUT/$f.log)"; done | tee -a "$OUT/info.log"
echo "tests done at +$(( $(date +%s) - t0 )) s" | tee -a "$OUT/info.log"
timeout 100 $C/sm90_weight_grad_bench $P > "$OUT/bench.jsonl" 2> "$OUT/bench.err"; echo "bench rc=$?" | tee -a "$OUT/info.log"
echo "bench done at +$(( $(date +%s) - t0 )) s" | tee -a "$OUT/info.log"
PYTHONUNBUFFERED=1 timeout 150 python3 $C/torch_moe_reference.py --preset $P --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" | tee -a "$OUT/info.log"
echo "torch done at +$(( $(date +%s) - t0 )) s" | tee -a "$OUT/info.log"
python3 $C/summarize.py "$OUT/bench.jsonl" "$OUT/torch.jsonl" | tee "$OUT/summary.txt"
