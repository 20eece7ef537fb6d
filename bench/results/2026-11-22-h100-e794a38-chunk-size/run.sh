#!/usr/bin/env bash
# Chunk size through the service with the CUDA engine: the e794a38 bench against one e794a38
# server, client chunk_bytes (and with it the response chunk) 1, 4, 16 MiB, twice, alternating.
set -uo pipefail
H=.carry/cs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export LD_LIBRARY_PATH=$H/svc/lib
$H/svc/moe-server --device=cuda --port=50200 --metrics_port=50201 > $OUT/server.log 2>&1 &
for i in $(seq 1 100); do grep -q "gRPC on" $OUT/server.log && break; sleep 0.2; done
cat $OUT/server.log
for r in 1 2; do
  for c in 1048576 4194304 16777216; do
    echo "=== chunk $c run $r $(date -u +%H:%M:%S)"
    timeout 120 $H/svc/moe-service-bench --server=127.0.0.1:50200 --metrics=127.0.0.1:50201 \
      --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 \
      --cases=24576x1536x256x1 --chunk_bytes=$c > $OUT/bench_${c}_$r.txt 2>&1
    echo "rc=$?"; grep "^| [0-9]" $OUT/bench_${c}_$r.txt
  done
done
kill %1; wait
