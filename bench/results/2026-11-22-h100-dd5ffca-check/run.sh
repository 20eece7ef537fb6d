#!/usr/bin/env bash
# dd5ffca: ParallelMemcpy moved from engine/cuda/host_staging to engine/host_memory (the CUDA
# engine's pinned staging calls the same code) and used by the client for its copy of a
# caller's tensors. gpu-check on the prebuilt binaries; then the client's copy A/B through one
# dd5ffca moe-server: moe-service-bench of d4546a1 (one-thread copy, "old") against dd5ffca's
# ("new"), alternating, two rounds, a retaining trainer; torch on sonic-7b in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/pmx/pm.tar.xz
C=.carry/pm
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 240 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "FAILED|error|DIFFERS" "$OUT/gpu-check.log" | head -20
stamp gpu-check done | tee -a "$OUT/bench.log"
PYTHONUNBUFFERED=1 timeout 100 python3 $C/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
export LD_LIBRARY_PATH=$PWD/$C/lib
$C/moe-server --device=cuda --port=50310 --metrics_port=50311 > $OUT/server.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" $OUT/server.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name binary round
  GLIBC_TUNABLES="$R" timeout 150 $2 --server=127.0.0.1:50310 --metrics=127.0.0.1:50311 \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 --connections=4 \
    --cases=24576x1536x256x1,24576x1536x256x4 > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $1 round $3 rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$1.txt
  echo "== $1 round $3 rc=$rc"; grep -E "^\| 24576" /tmp/bench.txt | head -4 | cut -d'|' -f2-8,12
}
for round in 1 2; do
  run old $C/old/moe-service-bench $round
  run new $C/moe-service-bench $round
done
kill %1; wait
stamp all done | tee -a "$OUT/bench.log"
