#!/usr/bin/env bash
# gpu-check of e794a38 (pinned staging in the CUDA engine), then through-the-service A/B of the
# server before (5e42b98) and after (e794a38), alternating, with the new bench; then the old
# bench (its in-process column: the old engine) against the new server.
set -uo pipefail
H=.carry/hs
echo "commit $(cat $H/gc/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 scripts/gpu-check --prebuilt $H/gc > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "^\[  FAILED|HostStaging" "$OUT/gpu-check.log" | head -10
export LD_LIBRARY_PATH=$H/svc/lib
$H/svc/moe-server-5e42b98 --device=cuda --port=50100 --metrics_port=50101 > $OUT/server_old.log 2>&1 &
$H/svc/moe-server --device=cuda --port=50200 --metrics_port=50201 > $OUT/server_new.log 2>&1 &
for i in $(seq 1 100); do grep -q "gRPC on" $OUT/server_old.log && grep -q "gRPC on" $OUT/server_new.log && break; sleep 0.2; done
cat $OUT/server_old.log $OUT/server_new.log
bench() {  # $1 bench binary, $2 port, $3 label
  echo "=== $3 $(date -u +%H:%M:%S)"
  timeout 120 $H/svc/$1 --server=127.0.0.1:$2 --metrics=127.0.0.1:$(($2 + 1)) --device=cuda \
    --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 --cases=24576x1536x256x1 \
    > $OUT/bench_$3.txt 2>&1
  echo "rc=$?"; grep "^| [0-9]" $OUT/bench_$3.txt
}
bench moe-service-bench 50100 server-old-1
bench moe-service-bench 50200 server-new-1
bench moe-service-bench 50100 server-old-2
bench moe-service-bench 50200 server-new-2
bench moe-service-bench-5e42b98 50200 bench-old-server-new
kill %1 %2; wait
