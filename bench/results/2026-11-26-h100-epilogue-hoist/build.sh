#!/usr/bin/env bash
# Fifteenth session: builds into .carry/eh (then .carry/ehx, xz) scripts/gpu-check's seven test
# binaries, moe_bench and moe_sm90_bench from the working tree (build/, as scripts/test
# configures it): StoreTile's per-thread store addresses worked out once a tile instead of in
# every column chunk. The base (the kernels of aad9bfe, the same as HEAD's before the change)
# comes from the fourteenth session's .carry/wu as base_moe_bench and base_moe_sm90_bench.
set -euo pipefail
cd "$(dirname "$0")/../../.."
dir=.carry/eh
rm -rf "$dir"; mkdir -p "$dir"
cmake --build build --target moe_kernels_cuda_test moe_cuda_discovery_test \
  moe_fused_forward_decision_test moe_engine_cuda_test sm90_expert_forward_test \
  sm90_expert_backward_test sm90_weight_grad_test moe_bench moe_sm90_bench > /dev/null
for t in moe_kernels_cuda_test sm90_expert_forward_test sm90_expert_backward_test \
         sm90_weight_grad_test; do cp build/tests/kernels/cuda/$t "$dir/"; done
for t in moe_cuda_discovery_test moe_fused_forward_decision_test moe_engine_cuda_test; do
  cp build/tests/engine/cuda/$t "$dir/"
done
cp build/bench/moe_bench "$dir/"
cp "$(find build -name moe_sm90_bench -type f | head -1)" "$dir/"
cp .carry/wu/moe_bench "$dir/base_moe_bench"
cp .carry/wu/moe_sm90_bench "$dir/base_moe_sm90_bench"
{ git rev-parse --short HEAD; git diff --stat; } > "$dir/COMMIT"
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir"/*_test "$dir"/*moe_bench "$dir"/*moe_sm90_bench > /dev/null
rm -rf .carry/ehx && mkdir -p .carry/ehx && tar -C .carry -cf - eh | xz -T2 -3 > .carry/ehx/eh.tar.xz
ls -la .carry/ehx
