#!/usr/bin/env bash
# What a trainer's process gains from glibc tunables (no code change): the dc452e4 bench (the
# trainer's side: moe::client) under default malloc, with retained memory
# (mmap_max=0:trim_threshold=2147483647:arena_max=1) and with transparent huge pages for its
# large blocks (hugetlb=1), in turn, twice, against one dc452e4 server; sonic-7b's shape.
set -uo pipefail
H=.carry/ct
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cat /sys/kernel/mm/transparent_hugepage/enabled
export LD_LIBRARY_PATH=$H/svc/lib
$H/svc/moe-server --device=cuda --port=50200 --metrics_port=50201 > $OUT/server.log 2>&1 &
for i in $(seq 1 100); do grep -q "gRPC on" $OUT/server.log && break; sleep 0.2; done
declare -A T=([default]="" [retain]="glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1" [hugetlb]="glibc.malloc.hugetlb=1")
for r in 1 2; do
  for k in default retain hugetlb; do
    echo "=== $k run $r $(date -u +%H:%M:%S)"
    GLIBC_TUNABLES="${T[$k]}" timeout 120 $H/svc/moe-service-bench --server=127.0.0.1:50200 \
      --metrics=127.0.0.1:50201 --device=cuda --dtype=bfloat16 --timeout_seconds=100 \
      --experts=128 --top_k=8 --cases=24576x1536x256x1 > $OUT/bench_${k}_$r.txt 2>&1
    echo "rc=$?"; grep "^| [0-9]\|memcpy warm" $OUT/bench_${k}_$r.txt
  done
done
kill %1; wait
