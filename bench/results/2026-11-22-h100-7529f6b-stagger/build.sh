#!/usr/bin/env bash
# Builds the start-stagger experiment into .carry/st: the three kernel benches over the kernels
# as they are ("base") and over kernels whose CTAs wait (blockIdx.x / 2) % G times C cycles
# before starting ("gGcC"), so that groups of SMs reach their tiles' epilogues at different
# times instead of all at once (every tile of a forward or data-gradient GEMM has the same
# reduction length, so the persistent CTAs otherwise store their tiles in lockstep). Cluster
# pairs (the ping-pong kernel's multicast) get the same delay.
set -euo pipefail
cd /work/main
dir=.carry/st
rm -rf "$dir"; mkdir -p "$dir"
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
shadow=$(mktemp -d)
trap 'rm -rf "$shadow"' EXIT
mkdir -p "$shadow/st/kernels/cuda"
python3 - "$shadow/st/kernels/cuda" <<'PY'
import sys, re
out = sys.argv[1]
g = open('kernels/cuda/sm90_grouped_gemm.cuh').read()
hook = '''
#ifndef MOE_STAGGER_CYCLES
#define MOE_STAGGER_CYCLES 0
#define MOE_STAGGER_GROUPS 1
#endif
__device__ __forceinline__ void MoeStaggerStart() {
  const long long wait =
      static_cast<long long>((blockIdx.x >> 1) % MOE_STAGGER_GROUPS) * MOE_STAGGER_CYCLES;
  const long long t0 = clock64();
  while (clock64() - t0 < wait) {
  }
}
'''
anchor = 'namespace moe::kernels::sm90 {\n'
assert g.count(anchor) == 1
g = g.replace(anchor, anchor + hook)
n = 0
for k in ['sm90_grouped_gemm_kernel', 'sm90_grouped_gemm_ws_kernel', 'sm90_grouped_gemm_pp_kernel']:
    sig = '    %s(const __grid_constant__ GemmParams p) {\n' % k
    assert g.count(sig) == 1, k
    g = g.replace(sig, sig + '  MoeStaggerStart();\n'); n += 1
open(out + '/sm90_grouped_gemm.cuh', 'w').write(g)
w = open('kernels/cuda/sm90_weight_grad.cuh').read()
sig = '    sm90_weight_grad_kernel(const __grid_constant__ WeightGradParams p) {\n'
assert w.count(sig) == 1
w = w.replace(sig, sig + '  MoeStaggerStart();\n')
open(out + '/sm90_weight_grad.cuh', 'w').write(w)
print('hooks', n + 1)
PY
$nv -I. -c kernels/cpu/dispatch.cc -o "$shadow/dispatch.o"
$nv -I. -c kernels/cuda/expert_backward.cu -o "$shadow/act_bwd.o"
for v in base g2c6000 g2c16000 g2c30000 g4c8000; do
  o="$shadow/$v"; mkdir -p "$o"
  if [ "$v" = base ]; then inc="-I."; else
    G=${v#g}; G=${G%%c*}; C=${v##*c}
    inc="-I$shadow/st -I. -DMOE_STAGGER_GROUPS=$G -DMOE_STAGGER_CYCLES=$C"
  fi
  $nv $inc -c kernels/cuda/sm90_expert_forward.cu -o "$o/fwd.o" &
  $nv $inc -c kernels/cuda/sm90_expert_backward.cu -o "$o/bwd.o" &
  wait
  $nv $inc -c kernels/cuda/sm90_weight_grad.cu -o "$o/wg.o" &
  $nv $inc -c bench/sm90_bench.cu -o "$o/fb.o" &
  wait
  $nv $inc -c bench/sm90_backward_bench.cu -o "$o/bb.o" &
  $nv $inc -c bench/sm90_weight_grad_bench.cu -o "$o/wb.o" &
  wait
  $nv -o "$dir/sm90_bench_$v" "$o/fb.o" "$o/fwd.o" "$shadow/dispatch.o" -lcublas
  $nv -o "$dir/sm90_backward_bench_$v" "$o/bb.o" "$o/bwd.o" "$o/fwd.o" "$shadow/act_bwd.o" \
    "$shadow/dispatch.o" -lcublas
  $nv -o "$dir/sm90_weight_grad_bench_$v" "$o/wb.o" "$o/wg.o" "$o/fwd.o" "$shadow/dispatch.o" -lcublas
done
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir"/sm90_*bench_*
ls -la "$dir"
