#!/usr/bin/env bash
# Throughput through the service with the CUDA engine: moe-server --device=cuda as its own
# process, moe-service-bench against it (in-process baseline: the same engine in the bench's
# process), bf16, on shapes of the kernel presets; then the sonic-7b shape again with the
# server's --retain_freed_memory=false.
set -uo pipefail
S=.carry/svc
export LD_LIBRARY_PATH=$S/lib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nproc
serve() {  # $1 port, rest: server flags
  local port=$1; shift
  $S/moe-server --device=cuda --port=$port --metrics_port=$((port + 1)) "$@" > $OUT/server_$port.log 2>&1 &
  for i in $(seq 1 100); do grep -q "gRPC on" $OUT/server_$port.log && break; sleep 0.2; done
  cat $OUT/server_$port.log
}
bench() {  # $1 port, $2 label, rest: bench flags
  local port=$1 label=$2; shift 2
  echo "=== $label $(date -u +%H:%M:%S)"
  timeout 240 $S/moe-service-bench --server=127.0.0.1:$port --metrics=127.0.0.1:$((port + 1)) \
    --device=cuda --dtype=bfloat16 --timeout_seconds=120 "$@" > $OUT/bench_$label.txt 2>&1
  echo "rc=$?"; grep -v "^$" $OUT/bench_$label.txt | head -40
}
serve 50100
bench 50100 sonic --experts=128 --top_k=8 --cases=24576x1536x256x1,24576x1536x256x2,4096x1536x256x1
bench 50100 olmoe --experts=64 --top_k=8 --cases=16384x2048x1024x1
bench 50100 server-routing --experts=128 --top_k=8 --routing=server --cases=24576x1536x256x1
kill %1; wait
serve 50200 --retain_freed_memory=false
bench 50200 sonic-noretain --experts=128 --top_k=8 --cases=24576x1536x256x1
kill %1; wait
