#!/usr/bin/env bash
# Builds the streaming-store experiment into .carry/cs: the three kernel benches over the
# kernels as they are ("base") and over kernels whose epilogues store with st.global.cs
# ("cs": evict-first in L2, so the outputs written by a GEMM do not push out the operand lines
# it still reuses), every global store of StoreTile, StoreSwiGLUBackwardTile and StoreWgradTile.
set -euo pipefail
cd /work/main
dir=.carry/cs
rm -rf "$dir"; mkdir -p "$dir"
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
shadow=$(mktemp -d)
trap 'rm -rf "$shadow"' EXIT
mkdir -p "$shadow/cs/kernels/cuda"
python3 - "$shadow/cs/kernels/cuda" <<'PY'
import sys, re
out = sys.argv[1]
g = open('kernels/cuda/sm90_grouped_gemm.cuh').read()
subs = [
  ('*reinterpret_cast<uint4*>(dst + col) = v;', '__stcs(reinterpret_cast<uint4*>(dst + col), v);'),
  ('*reinterpret_cast<uint4*>(p.out0 + static_cast<int64_t>(rows.dst[j]) * p.n_dim + col) = v;',
   '__stcs(reinterpret_cast<uint4*>(p.out0 + static_cast<int64_t>(rows.dst[j]) * p.n_dim + col), v);'),
  ('*reinterpret_cast<uint2*>(dh_row) = out_dg;', '__stcs(reinterpret_cast<uint2*>(dh_row), out_dg);'),
  ('*reinterpret_cast<uint2*>(dh_row + h) = out_du;', '__stcs(reinterpret_cast<uint2*>(dh_row + h), out_du);'),
  ('*reinterpret_cast<uint2*>(p.out1 + slot * h + col) = out_pa;',
   '__stcs(reinterpret_cast<uint2*>(p.out1 + slot * h + col), out_pa);'),
]
for a, b in subs:
    assert g.count(a) == 1, a
    g = g.replace(a, b)
open(out + '/sm90_grouped_gemm.cuh', 'w').write(g)
w = open('kernels/cuda/sm90_weight_grad.cuh').read()
pat = re.compile(r'\*reinterpret_cast<float2\*>\(crow \+ col\) =\s*make_float2\(acc\[4 \* i \+ 2 \* hr\], acc\[4 \* i \+ 2 \* hr \+ 1\]\);')
assert len(pat.findall(w)) == 1
w = pat.sub('__stcs(reinterpret_cast<float2*>(crow + col), make_float2(acc[4 * i + 2 * hr], acc[4 * i + 2 * hr + 1]));', w)
open(out + '/sm90_weight_grad.cuh', 'w').write(w)
print('patched', len(subs) + 1, 'stores')
PY
$nv -I. -c kernels/cpu/dispatch.cc -o "$shadow/dispatch.o"
$nv -I. -c kernels/cuda/expert_backward.cu -o "$shadow/act_bwd.o"
for v in base cs; do
  o="$shadow/$v"; mkdir -p "$o"
  if [ "$v" = base ]; then inc="-I."; else inc="-I$shadow/cs -I."; fi
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
