#!/usr/bin/env bash
# An experiment, not merged code: 55344e7 plus http2-exp.patch (gRPC channel arguments read from
# MOE_EXP_* environment variables on both sides). One connection's rate with HTTP/2 frames of
# 16 MiB, a 64 MiB stream lookahead, a 64 MiB write buffer, and 256 KiB minimum TCP reads,
# each set on server and client, against the defaults; a server per variant, alternating, two
# rounds, a retaining trainer, sonic-7b's shape with one micro-batch in flight; torch in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/hxx/hx.tar.xz
H=.carry/hx
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONUNBUFFERED=1 timeout 100 python3 $H/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
export LD_LIBRARY_PATH=$H/lib
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name round env...
  local name=$1 round=$2; shift 2
  env "$@" $H/moe-server --device=cuda --port=50310 --metrics_port=50311 > $OUT/server.log 2>&1 &
  local pid=$!
  for i in $(seq 1 150); do grep -q "gRPC on" $OUT/server.log && break; sleep 0.2; done
  env "$@" GLIBC_TUNABLES="$R" timeout 150 $H/moe-service-bench --server=127.0.0.1:50310 --metrics=127.0.0.1:50311 \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 \
    --cases=24576x1536x256x1 > /tmp/bench.txt 2>&1
  local rc=$?
  kill $pid; wait $pid 2>/dev/null
  { echo "=== $name round $round rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench.txt
  echo "== $name round $round rc=$rc"; grep -E "^\| 24576" /tmp/bench.txt | head -2 | cut -d'|' -f6-8,12
  grep -E "^\| 24576 \| 1536 \| 256 \| 1 \| train \| Forward" /tmp/bench.txt | cut -d'|' -f7-11
}
for round in 1 2; do
  run default $round MOE_EXP_NONE=1
  run frame16m $round MOE_EXP_FRAME=16777215
  run lookahead64m $round MOE_EXP_LOOKAHEAD=67108864
  run wbuf64m $round MOE_EXP_WBUF=67108864
  run readchunk256k $round MOE_EXP_READCHUNK=262144
done
