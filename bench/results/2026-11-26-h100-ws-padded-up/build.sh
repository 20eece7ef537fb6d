#!/usr/bin/env bash
# Fourteenth session: builds into .carry/wu (then .carry/wux, xz) scripts/gpu-check's seven test
# binaries, moe_bench and moe_sm90_bench from the working tree (build/, as scripts/test
# configures it): Sm90ChooseConfig gives the up-projection the ws kernel at 10-20% padding.
set -euo pipefail
cd "$(dirname "$0")/../../.."
dir=.carry/wu
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
{ git rev-parse --short HEAD; git diff --stat; } > "$dir/COMMIT"
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir"/*_test "$dir/moe_bench" "$dir/moe_sm90_bench" > /dev/null
rm -rf .carry/wux && mkdir -p .carry/wux && tar -C .carry -cf - wu | xz -T2 -3 > .carry/wux/wu.tar.xz
ls -la .carry/wux
