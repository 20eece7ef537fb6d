#!/usr/bin/env bash
# gpu-check of 422f20e (outputs left unset before their device copy), then moe-server at 5980036
# (port 50100) and at 422f20e (port 50200) side by side on the GPU, the 422f20e bench (with the
# trainer-side retained-memory tunables, to quiet the client's share) against each in turn,
# twice; sonic-7b's shape.
set -uo pipefail
H=.carry/z
echo "commit $(cat $H/gc/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 scripts/gpu-check --prebuilt $H/gc > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "^\[  FAILED" "$OUT/gpu-check.log" | head -5
export LD_LIBRARY_PATH=$H/svc/lib
$H/svc/moe-server-5980036 --device=cuda --port=50100 --metrics_port=50101 > $OUT/server_old.log 2>&1 &
$H/svc/moe-server --device=cuda --port=50200 --metrics_port=50201 > $OUT/server_new.log 2>&1 &
for i in $(seq 1 100); do grep -q "gRPC on" $OUT/server_old.log && grep -q "gRPC on" $OUT/server_new.log && break; sleep 0.2; done
for r in 1 2; do
  for p in 50100 50200; do
    echo "=== port $p run $r $(date -u +%H:%M:%S)"
    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1 \
      timeout 120 $H/svc/moe-service-bench --server=127.0.0.1:$p --metrics=127.0.0.1:$((p + 1)) \
      --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 \
      --cases=24576x1536x256x1 > $OUT/bench_${p}_$r.txt 2>&1
    echo "rc=$?"; grep "^| [0-9]" $OUT/bench_${p}_$r.txt
  done
done
kill %1 %2; wait
