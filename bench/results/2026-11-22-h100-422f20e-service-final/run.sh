#!/usr/bin/env bash
# The service's final rates (422f20e binaries; code unchanged since) for sonic-7b's and olmoe's
# shapes, untuned trainer then retaining trainer, with torch_moe_reference.py on the same
# presets in the same call.
set -uo pipefail
H=.carry/fin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONUNBUFFERED=1 timeout 200 python3 $H/torch_moe_reference.py --preset sonic-7b olmoe --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
export LD_LIBRARY_PATH=$H/svc/lib
$H/svc/moe-server --device=cuda --port=50200 --metrics_port=50201 > $OUT/server.log 2>&1 &
for i in $(seq 1 100); do grep -q "gRPC on" $OUT/server.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
for k in default retain; do
  t=""; [[ $k == retain ]] && t=$R
  echo "=== sonic $k $(date -u +%H:%M:%S)"
  GLIBC_TUNABLES="$t" timeout 120 $H/svc/moe-service-bench --server=127.0.0.1:50200 --metrics=127.0.0.1:50201 \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 \
    --cases=24576x1536x256x1 > $OUT/bench_sonic_$k.txt 2>&1; echo "rc=$?"; grep "^| [0-9]" $OUT/bench_sonic_$k.txt | head -2
  echo "=== olmoe $k $(date -u +%H:%M:%S)"
  GLIBC_TUNABLES="$t" timeout 120 $H/svc/moe-service-bench --server=127.0.0.1:50200 --metrics=127.0.0.1:50201 \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=64 --top_k=8 \
    --cases=16384x2048x1024x1 > $OUT/bench_olmoe_$k.txt 2>&1; echo "rc=$?"; grep "^| [0-9]" $OUT/bench_olmoe_$k.txt | head -2
done
kill %1; wait
