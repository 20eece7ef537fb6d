#!/usr/bin/env bash
# The server's Forward reserving x once an eighth has arrived (5980036) against 03794e9's server, side by
# side on the GPU, the 5980036 bench against each in turn (old, new, old, new), sonic-7b's shape.
set -uo pipefail
H=.carry/fx
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export LD_LIBRARY_PATH=$H/svc/lib
$H/svc/moe-server-03794e9 --device=cuda --port=50100 --metrics_port=50101 > $OUT/server_old.log 2>&1 &
$H/svc/moe-server --device=cuda --port=50200 --metrics_port=50201 > $OUT/server_new.log 2>&1 &
for i in $(seq 1 100); do grep -q "gRPC on" $OUT/server_old.log && grep -q "gRPC on" $OUT/server_new.log && break; sleep 0.2; done
for r in 1 2; do
  for p in 50100 50200; do
    echo "=== port $p run $r $(date -u +%H:%M:%S)"
    timeout 120 $H/svc/moe-service-bench --server=127.0.0.1:$p --metrics=127.0.0.1:$((p + 1)) \
      --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 \
      --cases=24576x1536x256x1 > $OUT/bench_${p}_$r.txt 2>&1
    echo "rc=$?"; grep "^| [0-9]" $OUT/bench_${p}_$r.txt
  done
done
kill %1 %2; wait
