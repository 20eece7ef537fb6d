set -e
cd /work/main
K=.carry/half
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
mk() { # name sed-expr...
  name=$1; shift
  d=$(mktemp -d); mkdir -p $d/kernels/cuda
  sed "$@" kernels/cuda/sm90_grouped_gemm.cuh > $d/kernels/cuda/sm90_grouped_gemm.cuh
  echo "$name: $(diff kernels/cuda/sm90_grouped_gemm.cuh $d/kernels/cuda/sm90_grouped_gemm.cuh | grep -c '^>') lines changed"
  cp kernels/cuda/sm90_expert_forward.cu kernels/cuda/sm90_expert_forward.h kernels/cuda/sm90_launch.cuh $d/kernels/cuda/
  $nv -I$d -I. -o $K/sm90_bench_$name bench/sm90_bench.cu $d/kernels/cuda/sm90_expert_forward.cu kernels/cpu/dispatch.cc -lcublas
}
A='1081s/for (int j = 0; j < 8; ++j) {/for (int j = 0; j < 4; ++j) {/'
B1='418s/if constexpr (kSwiGLU) TmaLoad3d(s_b + kN \* kBlockK, \&p.tmap_b1, bar, k0, n0, expert);/\/\/ half B/'
B2='s/MbarArriveExpectTx(bar, kN \* kBlockK \* 2 + more_bytes);/MbarArriveExpectTx(bar, (kSwiGLU ? kN * kBlockK : kN * kBlockK * 2) + more_bytes);/'
mk base -e 's/x/x/' &
mk halfA -e "$A" &
wait
mk halfB -e "$B1" -e "$B2" &
mk halfAB -e "$A" -e "$B1" -e "$B2" &
wait
cp /work/shared/bench/torch_moe_reference.py $K/
/work/shared/tools/device-bundle $K $K/sm90_bench_base $K/sm90_bench_halfA $K/sm90_bench_halfB $K/sm90_bench_halfAB
