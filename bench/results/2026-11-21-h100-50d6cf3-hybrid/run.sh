#!/usr/bin/env bash
# Lead, hybrid backward check: engine tests (all paths against the CPU engine) and moe_bench with torch on the large-expert presets, same call.
set -uo pipefail
C=.carry/H1
export LD_LIBRARY_PATH=$PWD/$C/lib
S=$(date +%s)
{ echo "commit $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $OUT/run.log
timeout 200 $C/moe_engine_cuda_test --gtest_brief=1 > $OUT/engine_test.log 2>&1; echo "engine_test rc=$? +$(( $(date +%s)-S ))s" | tee -a $OUT/run.log
tail -3 $OUT/engine_test.log
timeout 20 $C/moe_fused_forward_decision_test --gtest_brief=1 > $OUT/decision_test.log 2>&1; echo "decision rc=$?" | tee -a $OUT/run.log
P="olmoe deepseek-v3 mixtral scale-32k"
timeout 200 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out $OUT $P > $OUT/bench.log 2>&1; echo "bench rc=$? +$(( $(date +%s)-S ))s" | tee -a $OUT/run.log
grep -E "^(preset|olmoe|deepseek|mixtral|scale)" $OUT/bench.log | head -12
