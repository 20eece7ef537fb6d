#!/usr/bin/env bash
# a3054f7: the pinned staging's host copies and DMAs overlap in 2 MiB pieces. gpu-check on the
# prebuilt binaries; then b04f97b's moe-server and moe-service-bench ("old") against a3054f7's
# ("new"), each side its own pair, alternating, two rounds, a retaining trainer, sonic-7b's shape
# with 1 and 4 micro-batches in flight; torch on sonic-7b in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/stx/st.tar.xz
C=.carry/st
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 240 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "FAILED|error|DIFFERS" "$OUT/gpu-check.log" | head -20
stamp gpu-check done | tee -a "$OUT/bench.log"
PYTHONUNBUFFERED=1 timeout 100 python3 $C/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
export LD_LIBRARY_PATH=$PWD/$C/lib
$C/old/moe-server --device=cuda --port=50300 --metrics_port=50301 > $OUT/server_old.log 2>&1 &
$C/moe-server --device=cuda --port=50310 --metrics_port=50311 > $OUT/server_new.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" $OUT/server_old.log && grep -q "gRPC on" $OUT/server_new.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name binary port round
  GLIBC_TUNABLES="$R" timeout 150 $2 --server=127.0.0.1:$3 --metrics=127.0.0.1:$(($3 + 1)) \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 \
    --cases=24576x1536x256x1,24576x1536x256x4 > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $1 round $4 rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$1.txt
  echo "== $1 round $4 rc=$rc"; grep -E "^\| 24576" /tmp/bench.txt | head -4 | cut -d'|' -f2-8,12
  grep -E "^\| 24576 \| 1536 \| 256 \| [14] \| train \| (Forward|Backward)" /tmp/bench.txt | cut -d'|' -f5,7-12
}
for round in 1 2; do
  run old $C/old/moe-service-bench 50300 $round
  run new $C/moe-service-bench 50310 $round
done
kill %1 %2; wait
stamp all done | tee -a "$OUT/bench.log"
