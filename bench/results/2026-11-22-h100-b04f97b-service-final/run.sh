#!/usr/bin/env bash
# The service at b04f97b (tensors by reference, 4 connections, the client's 8-thread copy):
# one moe-server, moe-service-bench with both trainers, sonic-7b's and olmoe's shapes with 1 and
# 4 micro-batches in flight; torch on both presets in the same call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/finx/fin.tar.xz
H=.carry/fin
echo "commit $(cat $H/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for p in sonic-7b olmoe; do
  PYTHONUNBUFFERED=1 timeout 100 python3 $H/torch_moe_reference.py --preset $p --json $OUT/torch.jsonl >> $OUT/torch.log 2>&1; echo "torch $p rc=$?"
done
cat $OUT/torch.jsonl
export LD_LIBRARY_PATH=$H/lib
$H/moe-server --device=cuda --port=50310 --metrics_port=50311 > $OUT/server.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" $OUT/server.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # shape trainer experts cases
  local t=""; [[ $2 == retain ]] && t=$R
  GLIBC_TUNABLES="$t" timeout 150 $H/moe-service-bench --server=127.0.0.1:50310 --metrics=127.0.0.1:50311 \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=$3 --top_k=8 --cases=$4 > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $1 $2 rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench.txt
  echo "== $1 $2 rc=$rc"; grep -E "^\| [0-9]" /tmp/bench.txt | head -4 | cut -d'|' -f2-8,12
}
for trainer in retain default; do
  run sonic-7b $trainer 128 24576x1536x256x1,24576x1536x256x4
  run olmoe $trainer 64 16384x2048x1024x1,16384x2048x1024x4
done
kill %1; wait
