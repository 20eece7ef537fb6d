#!/usr/bin/env bash
# ClientOptions::connections and the chunk size, through one moe-server of d4546a1 (the commit
# that adds connections; server code of f132601): the same moe-service-bench with 1 connection,
# 4 connections, and 4 connections with 4 MiB messages, alternating, two rounds, a retaining
# trainer; sonic-7b's shape with 1, 2 and 4 micro-batches in flight; torch on sonic-7b in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/cnx/cn.tar.xz
H=.carry/cn
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONUNBUFFERED=1 timeout 100 python3 $H/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
export LD_LIBRARY_PATH=$H/lib
$H/moe-server --device=cuda --port=50310 --metrics_port=50311 > $OUT/server.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" $OUT/server.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name round flags...
  local name=$1 round=$2; shift 2
  GLIBC_TUNABLES="$R" timeout 150 $H/moe-service-bench --server=127.0.0.1:50310 --metrics=127.0.0.1:50311 \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 \
    --cases=24576x1536x256x1,24576x1536x256x2,24576x1536x256x4 "$@" > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $name round $round rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$name.txt
  echo "== $name round $round rc=$rc"; grep -E "^\| 24576" /tmp/bench.txt | head -6 | cut -d'|' -f2-8
}
for round in 1 2; do
  run c1 $round --connections=1
  run c4 $round --connections=4
  run c4-4m $round --connections=4 --chunk_bytes=4194304
done
kill %1; wait
