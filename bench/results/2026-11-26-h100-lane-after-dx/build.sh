#!/usr/bin/env bash
# Fourteenth session: builds into .carry/la (then .carry/lax, xz) scripts/gpu-check's seven test
# binaries and moe_bench from the working tree (build/, as scripts/test configures it), whose
# A/B times the service's backward with its weight gradients serial, beside dXg (the default),
# after dXg at the greatest stream priority (ExpertShape::weight_grads_after_data_grad) and
# beside dXg again.
set -euo pipefail
cd "$(dirname "$0")/../../.."
dir=.carry/la
rm -rf "$dir"; mkdir -p "$dir"
cmake --build build --target moe_kernels_cuda_test moe_cuda_discovery_test \
  moe_fused_forward_decision_test moe_engine_cuda_test sm90_expert_forward_test \
  sm90_expert_backward_test sm90_weight_grad_test moe_bench > /dev/null
for t in moe_kernels_cuda_test sm90_expert_forward_test sm90_expert_backward_test \
         sm90_weight_grad_test; do cp build/tests/kernels/cuda/$t "$dir/"; done
for t in moe_cuda_discovery_test moe_fused_forward_decision_test moe_engine_cuda_test; do
  cp build/tests/engine/cuda/$t "$dir/"
done
cp build/bench/moe_bench "$dir/"
{ git rev-parse --short HEAD; git diff --stat; } > "$dir/COMMIT"
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir"/*_test "$dir/moe_bench" > /dev/null
rm -rf .carry/lax && mkdir -p .carry/lax && tar -C .carry -cf - la | xz -T2 -3 > .carry/lax/la.tar.xz
ls -la .carry/lax
