#!/usr/bin/env bash
# The final device call of the weight-grad overlap work: the test (and the two broken layouts,
# which must FAIL), the bench (old vs new kernels vs per-expert cuBLAS) and the PyTorch
# reference on the same presets, deepseek-v3 (bench and torch), Nsight Compute on two
# kernels and compute-sanitizer memcheck on the test. At most 8 files come back, hence the concatenated logs.
set -uo pipefail
C=${C:-.carry/wg4}
P="sonic-7b scale-8k qwen3-a3b olmoe"
export LD_LIBRARY_PATH=$PWD/$C/lib
t0=$(date +%s)
el() { echo "$1 at +$(( $(date +%s) - t0 )) s" | tee -a "$OUT/info.log"; }
{ echo "commit $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; } | tee "$OUT/info.log"
: > "$OUT/tests.log"
# The TMA-slot variants (never run before this call) go in processes of their own
# (WGRAD_ONLY=tma), so a hang there costs only them.
for t in test test_swapped_offsets test_no_swizzle test_tma; do
  echo "===== sm90_weight_grad_$t" >> "$OUT/tests.log"
  if [ $t = test_tma ]; then
    WGRAD_ONLY=tma timeout 40 $C/sm90_weight_grad_test > /tmp/$t.log 2>&1; rc=$?
  else
    WGRAD_SKIP=tma timeout 50 $C/sm90_weight_grad_$t > /tmp/$t.log 2>&1; rc=$?
  fi
  cat /tmp/$t.log >> "$OUT/tests.log"; echo "rc=$rc" >> "$OUT/tests.log"
  echo "$t: $(grep -c ^PASS /tmp/$t.log) PASS $(grep -c ^FAIL /tmp/$t.log) FAIL rc=$rc; $(tail -n1 /tmp/$t.log)" | tee -a "$OUT/info.log"
done
el "tests done"
WGRAD_SKIP=tma timeout 100 $C/sm90_weight_grad_bench $P > "$OUT/bench.jsonl" 2> "$OUT/other.log"; echo "bench rc=$?" | tee -a "$OUT/info.log"
el "bench done"
# The TMA-slot variants (never run before this call) in their own process, so a hang costs only them.
WGRAD_ONLY=tma timeout 40 $C/sm90_weight_grad_bench $P > /tmp/tma.jsonl 2>> "$OUT/other.log"; echo "bench tma rc=$?" | tee -a "$OUT/info.log"
grep '"impl":"[a-z0-9_]*tma' /tmp/tma.jsonl >> "$OUT/bench.jsonl"
el "bench tma done"
PYTHONUNBUFFERED=1 timeout 150 python3 $C/torch_moe_reference.py --preset $P --json "$OUT/torch.jsonl" >> "$OUT/other.log" 2>&1; echo "torch rc=$?" | tee -a "$OUT/info.log"
el "torch done"
python3 $C/summarize.py "$OUT/bench.jsonl" "$OUT/torch.jsonl" > "$OUT/summary.txt"
WGRAD_SKIP=tma timeout 60 $C/sm90_weight_grad_bench deepseek-v3 >> "$OUT/bench.jsonl" 2>> "$OUT/other.log"; echo "bench deepseek-v3 rc=$?" | tee -a "$OUT/info.log"
el "bench deepseek-v3 done"
PYTHONUNBUFFERED=1 timeout 60 python3 $C/torch_moe_reference.py --preset deepseek-v3 --json "$OUT/torch.jsonl" >> "$OUT/other.log" 2>&1; echo "torch deepseek-v3 rc=$?" | tee -a "$OUT/info.log"
el "torch deepseek-v3 done"
python3 $C/summarize.py "$OUT/bench.jsonl" "$OUT/torch.jsonl" | tee "$OUT/summary.txt"
# Nsight Compute on scale-8k dW13 (no accumulate, the first launch of each): one CTA of
# 128 x 256 vs two CTAs of 128 x 128 an SM.
for k in 'sm90_weight_grad_kernelILi256ELi64ELb0ELb0ELi1E' 'sm90_weight_grad_kernelILi128ELi64ELb0ELb1ELi2E'; do
  echo "===== $k" >> "$OUT/ncu.txt"
  timeout 45 ncu --clock-control none --kernel-name-base mangled -k "regex:$k" -c 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    $C/sm90_weight_grad_bench scale-8k 2>&1 | grep -v '^{' >> "$OUT/ncu.txt"; echo "ncu rc=$?" >> "$OUT/ncu.txt"
  el "ncu $k done"
done
# Last, as it may not finish inside the call: compute-sanitizer memcheck on the test.
timeout 120 compute-sanitizer --tool memcheck --print-limit 5 $C/sm90_weight_grad_test > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?" | tee -a "$OUT/info.log"
tail -n 2 "$OUT/memcheck.log"
el "memcheck done"
