#!/usr/bin/env bash
# Builds, on a machine with nvcc but no GPU, what one device call needs to check and time the
# ping-pong grouped GEMM (sm90_grouped_gemm_pp_kernel), into DIR (default .carry/pp, git-ignored):
#   sm90_expert_forward_test, sm90_expert_backward_test   the tests, every config incl. ping-pong
#   *_adesc    the same tests over a ping-pong kernel whose 128-row consumer tile reads rows
#              0..63 of A for BOTH halves (second-half A descriptor offset dropped): the 128x128
#              ping-pong checks must FAIL
#   *_noorder  the same tests over a ping-pong kernel without the math ordering barrier (neither
#              the wait nor the signal): consumers may then wait on `full` a phase ahead and read
#              a slot's previous tile; timing-dependent, recorded as seen
#   *_mchalf   the same tests over a multicast ping-pong kernel whose CTAs both load the FIRST
#              half of a K-major weight tile (kPlain: the down-projection): its multicast checks
#              of Y must FAIL
#   sm90_bench, sm90_backward_bench   the tile sweeps (forward; dA/dX, --dh), ping-pong included
# plus torch_moe_reference.py, bundled libraries and COMMIT. Usage: sm90_pp_build_carry.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.carry/pp}
mkdir -p "$dir"
obj=$(mktemp -d)
trap 'rm -rf "$obj"' EXIT
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
hdr=kernels/cuda/sm90_grouped_gemm.cuh

# Broken kernel headers, each in a shadow include root searched first; each must change the
# source in exactly the intended places.
mkdir -p "$obj/adesc/kernels/cuda" "$obj/noorder/kernels/cuda" "$obj/mchalf/kernels/cuda"
sed 's/MakeSmemDesc(s_a + hf \* 64 \* 128)/MakeSmemDesc(s_a)/' $hdr \
  > "$obj/adesc/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff $hdr "$obj/adesc/kernels/cuda/sm90_grouped_gemm.cuh" | grep -c '^>')" = 1 ] ||
  { echo "adesc variant did not change the descriptor" >&2; exit 1; }
sed -e 's/if (j > 0) asm volatile("bar.sync %0, 256;\\n" ::"r"(3 + cw) : "memory");/\/\/ no wait/' \
    -e 's/asm volatile("bar.arrive %0, 256;\\n" ::"r"(4 - cw) : "memory");/\/\/ no signal/' \
  $hdr > "$obj/noorder/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff $hdr "$obj/noorder/kernels/cuda/sm90_grouped_gemm.cuh" | grep -c '^>')" = 2 ] ||
  { echo "noorder variant did not drop both barrier halves" >&2; exit 1; }
sed 's/bar, k0, n0 + rank \* kN \/ 2, expert,/bar, k0, n0, expert,/' $hdr \
  > "$obj/mchalf/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff $hdr "$obj/mchalf/kernels/cuda/sm90_grouped_gemm.cuh" | grep -c '^>')" = 1 ] ||
  { echo "mchalf variant did not change the multicast row offset" >&2; exit 1; }

$nv -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd.o" &
$nv -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd.o" &
wait
$nv -I"$obj/adesc" -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd_adesc.o" &
$nv -I"$obj/adesc" -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd_adesc.o" &
wait
$nv -I"$obj/noorder" -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd_noorder.o" &
$nv -I"$obj/noorder" -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd_noorder.o" &
wait
$nv -I"$obj/mchalf" -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd_mchalf.o" &
$nv -I. -c kernels/cpu/dispatch.cc -o "$obj/dispatch.o" &
wait
$nv -I. -c kernels/cuda/expert_backward.cu -o "$obj/act_bwd.o" &
$nv -I. -c tests/kernels/cuda/sm90_expert_forward_test.cc -o "$obj/fwd_test.o" &
wait
$nv -I. -c tests/kernels/cuda/sm90_expert_backward_test.cc -o "$obj/bwd_test.o" &
$nv -I. -c bench/sm90_bench.cu -o "$obj/bench.o" &
wait
$nv -I. -c bench/sm90_backward_bench.cu -o "$obj/bbench.o"
for v in "" _adesc _noorder; do
  $nv -o "$dir/sm90_expert_forward_test$v" "$obj/fwd_test.o" "$obj/fwd$v.o" "$obj/dispatch.o"
  $nv -o "$dir/sm90_expert_backward_test$v" "$obj/bwd_test.o" "$obj/bwd$v.o" "$obj/fwd$v.o" \
    "$obj/dispatch.o"
done
$nv -o "$dir/sm90_expert_forward_test_mchalf" "$obj/fwd_test.o" "$obj/fwd_mchalf.o" \
  "$obj/dispatch.o"
$nv -o "$dir/sm90_bench" "$obj/bench.o" "$obj/fwd.o" "$obj/dispatch.o" -lcublas
$nv -o "$dir/sm90_backward_bench" "$obj/bbench.o" "$obj/bwd.o" "$obj/fwd.o" "$obj/act_bwd.o" \
  "$obj/dispatch.o" -lcublas
cp /work/shared/bench/torch_moe_reference.py "$dir/"
git rev-parse --short HEAD > "$dir/COMMIT"
git diff --quiet HEAD -- kernels tests bench || echo "(with uncommitted changes)" >> "$dir/COMMIT"
/work/shared/tools/device-bundle "$dir" "$dir"/sm90_expert_*_test* "$dir/sm90_bench" \
  "$dir/sm90_backward_bench"
ls -la "$dir"
