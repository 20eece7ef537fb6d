#!/usr/bin/env bash
# The ws kernel's TMA-store epilogue: tests (with a broken-swizzle build that must fail),
# memcheck, forward and backward kernel benches (interleaved), torch on the same presets.
set -uo pipefail
B=.carry/ts
export LD_LIBRARY_PATH=$B/lib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 $B/sm90_expert_forward_test > $OUT/fwd_test.log 2>&1; echo "fwd test rc=$? PASS=$(grep -c ^PASS $OUT/fwd_test.log) ts=1 PASS=$(grep ^PASS $OUT/fwd_test.log | grep -c 'ts=1')"; grep -v "^PASS" $OUT/fwd_test.log | head -5
timeout 200 $B/sm90_expert_backward_test > $OUT/bwd_test.log 2>&1; echo "bwd test rc=$? PASS=$(grep -c ^PASS $OUT/bwd_test.log) ts=1 PASS=$(grep ^PASS $OUT/bwd_test.log | grep -c 'ts=1')"; grep -v "^PASS" $OUT/bwd_test.log | head -5
timeout 100 $B/sm90_expert_backward_test_tsbroken > $OUT/bwd_tsbroken.log 2>&1; echo "tsbroken rc=$? (want 1) ts=1 FAIL=$(grep ^FAIL $OUT/bwd_tsbroken.log | grep -c 'ts=1') ts=0 FAIL=$(grep ^FAIL $OUT/bwd_tsbroken.log | grep -c 'ts=0')"
timeout 120 compute-sanitizer --tool memcheck --print-limit 5 $B/sm90_expert_backward_test medium > $OUT/bwd_memcheck.log 2>&1; echo "bwd memcheck rc=$?"; grep "ERROR SUMMARY" $OUT/bwd_memcheck.log
timeout 120 compute-sanitizer --tool memcheck --print-limit 5 $B/sm90_expert_forward_test ragged > $OUT/fwd_memcheck.log 2>&1; echo "fwd memcheck rc=$?"; grep "ERROR SUMMARY" $OUT/fwd_memcheck.log
for p in sonic-7b qwen3-a3b scale-8k olmoe; do
  timeout 120 $B/sm90_bench $p > $OUT/fwd_bench_$p.jsonl 2>&1; grep '"tma_store"' $OUT/fwd_bench_$p.jsonl
done
timeout 300 $B/sm90_backward_bench > $OUT/bwd_bench.jsonl 2> $OUT/bwd_bench.err; echo "bwd bench rc=$?"; grep '"tma_store"' $OUT/bwd_bench.jsonl
PYTHONUNBUFFERED=1 timeout 200 python3 $B/torch_moe_reference.py --preset sonic-7b olmoe qwen3-a3b scale-8k deepseek-v3 --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
