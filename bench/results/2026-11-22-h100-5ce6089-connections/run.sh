#!/usr/bin/env bash
# 5ce6089 (server and bench code of 69ac089): striped micro-batches over 4 connections (the
# default) against 8, one moe-server, its bench's own process with pageable tensors
# (MOE_PINNED_TENSOR_BYTES=0, as a trainer without a CUDA engine), alternating, two rounds,
# a retaining trainer, sonic-7b's shape with 1, 2 and 4 micro-batches in flight; torch on
# sonic-7b in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ppx/pp.tar.xz
C=.carry/pp
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit 5ce6089 (binaries of $(cat $C/COMMIT))"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
PYTHONUNBUFFERED=1 timeout 100 python3 $C/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl >> $OUT/bench.log 2>&1; echo "torch rc=$?" | tee -a $OUT/bench.log; cat $OUT/torch.jsonl
$C/moe-server --device=cuda --port=50310 --metrics_port=50311 > /tmp/server.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" /tmp/server.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name round connections
  local name=$1 round=$2 conns=$3
  MOE_PINNED_TENSOR_BYTES=0 GLIBC_TUNABLES="$R" timeout 130 $C/moe-service-bench --server=127.0.0.1:50310 \
    --metrics=127.0.0.1:50311 --device=cuda --dtype=bfloat16 --timeout_seconds=100 \
    --experts=128 --top_k=8 --warmup=2 --connections=$conns \
    --cases=24576x1536x256x1,24576x1536x256x2,24576x1536x256x4 > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $name round $round rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$name.txt
  echo "== $name round $round rc=$rc"; grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [124] \| (train|infer) \| [0-9]" /tmp/bench.txt | head -6 | cut -d'|' -f2-8,12
  grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| 1 \| train \| (Forward|Backward)" /tmp/bench.txt | cut -d'|' -f5,7-12
}
for round in 1 2; do
  run c4 $round 4
  run c8 $round 8
done
kill %1; wait
cp /tmp/server.log $OUT/server.log
stamp all done | tee -a "$OUT/bench.log"
