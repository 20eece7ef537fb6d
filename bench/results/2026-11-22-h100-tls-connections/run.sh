#!/usr/bin/env bash
# TLS through the service over more connections (ClientOptions::connections): the servers and
# bench of bench/results/2026-11-22-h100-tls (same build, test PKI), sonic-7b's shape with 1 and
# 4 micro-batches in flight, TLS over 8, 32, 16 and again 32 connections, then plaintext over 8
# for reference; torch on sonic-7b in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/tlx/tl.tar.xz
C=.carry/tl
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
PYTHONUNBUFFERED=1 timeout 100 python3 $C/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl >> $OUT/bench.log 2>&1; echo "torch rc=$?" | tee -a $OUT/bench.log; cat $OUT/torch.jsonl
P=tests/testdata/tls
$C/moe-server --device=cuda --port=50310 --metrics_port=50311 > /tmp/plain.log 2>&1 &
$C/moe-server --device=cuda --port=50320 --metrics_port=50321 --tls_cert_file=$P/server.pem --tls_key_file=$P/server-key.pem > /tmp/tls.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" /tmp/plain.log && grep -q "gRPC on" /tmp/tls.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name port flags...
  local name=$1 port=$2; shift 2
  MOE_PINNED_TENSOR_BYTES=0 GLIBC_TUNABLES="$R" timeout 130 $C/moe-service-bench --server=127.0.0.1:$port \
    --metrics=127.0.0.1:$((port + 1)) --device=cuda --dtype=bfloat16 --timeout_seconds=100 \
    --experts=128 --top_k=8 --warmup=2 --cases=24576x1536x256x1,24576x1536x256x4 "$@" > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $name rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_runs.txt
  echo "== $name rc=$rc"; grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [14] \| (train|infer) \| [0-9]" /tmp/bench.txt | head -4 | cut -d'|' -f2-8,10,12
}
T="--tls_ca_file=$P/ca.pem"
run tls-8 50320 $T --connections=8; run tls-32 50320 $T --connections=32
run tls-16 50320 $T --connections=16; run tls-32b 50320 $T --connections=32
run plain-8 50310 --connections=8
kill %1 %2; wait
stamp all done | tee -a "$OUT/bench.log"
