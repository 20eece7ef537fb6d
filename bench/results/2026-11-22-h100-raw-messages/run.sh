#!/usr/bin/env bash
# Forward and Backward on raw buffers (f132601: tensors encoded by reference, decoded straight
# into the assembled tensors) against 23a99d3's server and client: each side's own moe-server and
# moe-service-bench, old/new alternating, two rounds, both trainers; torch on sonic-7b in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/abx/ab.tar.xz
H=.carry/ab
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONUNBUFFERED=1 timeout 100 python3 $H/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
export LD_LIBRARY_PATH=$H/lib
$H/old/moe-server --device=cuda --port=50300 --metrics_port=50301 > $OUT/server_old.log 2>&1 &
$H/new/moe-server --device=cuda --port=50310 --metrics_port=50311 > $OUT/server_new.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" $OUT/server_old.log && grep -q "gRPC on" $OUT/server_new.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # which port_base trainer round; each side's outputs go into one file
  local t=""; [[ $3 == retain ]] && t=$R
  GLIBC_TUNABLES="$t" timeout 110 $H/$1/moe-service-bench --server=127.0.0.1:$2 --metrics=127.0.0.1:$(($2 + 1)) \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 \
    --cases=24576x1536x256x1,24576x1536x256x2 > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $1 $3 round $4 rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$1.txt
  echo "== $1 $3 round $4 rc=$rc"; grep -E "^\| 24576" /tmp/bench.txt | head -4 | cut -d'|' -f2-8
}
for round in 1 2; do
  for trainer in retain default; do
    run old 50300 $trainer $round
    run new 50310 $trainer $round
  done
done
kill %1 %2; wait
