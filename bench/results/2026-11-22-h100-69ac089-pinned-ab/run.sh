#!/usr/bin/env bash
# 69ac089: page-locked large tensors in moe-server (engine/cuda/pinned_pool.h; kept blocks reused
# up to half as large again). gpu-check on the prebuilt binaries; then 937c78e's moe-server
# ("prev") against 69ac089's ("new"), both driven by 69ac089's moe-service-bench with its own
# process's pinned tensors off (MOE_PINNED_TENSOR_BYTES=0: the trainer's side as before), in the
# order prev new | new prev | prev new, two warm-up steps, a retaining trainer, sonic-7b's shape
# with 1 and 4 micro-batches in flight; olmoe's shape with one if time is left. torch on
# sonic-7b and olmoe in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ppx/pp.tar.xz
C=.carry/pp
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
timeout 200 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "FAILED|error|DIFFERS" "$OUT/gpu-check.log" | head -20
stamp gpu-check done | tee -a "$OUT/bench.log"
PYTHONUNBUFFERED=1 timeout 100 python3 $C/torch_moe_reference.py --preset sonic-7b olmoe --json $OUT/torch.jsonl >> $OUT/bench.log 2>&1; echo "torch rc=$?" | tee -a $OUT/bench.log; cat $OUT/torch.jsonl
$C/prev/moe-server --device=cuda --port=50300 --metrics_port=50301 > /tmp/server_prev.log 2>&1 &
$C/moe-server --device=cuda --port=50310 --metrics_port=50311 > /tmp/server_new.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" /tmp/server_prev.log && grep -q "gRPC on" /tmp/server_new.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name port round cases experts
  local name=$1 port=$2 round=$3 cases=$4 experts=$5
  MOE_PINNED_TENSOR_BYTES=0 GLIBC_TUNABLES="$R" timeout 110 $C/moe-service-bench --server=127.0.0.1:$port \
    --metrics=127.0.0.1:$((port + 1)) --device=cuda --dtype=bfloat16 --timeout_seconds=100 \
    --experts=$experts --top_k=8 --warmup=2 --cases=$cases > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $name round $round rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$name.txt
  echo "== $name round $round rc=$rc"; grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [14] \| (train|infer) \| [0-9]" /tmp/bench.txt | head -4 | cut -d'|' -f2-8,12
  grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [14] \| train \| (Forward|Backward)" /tmp/bench.txt | cut -d'|' -f5,7-12
}
SONIC=24576x1536x256x1,24576x1536x256x4
run prev 50300 1 $SONIC 128; run new 50310 1 $SONIC 128
run new 50310 2 $SONIC 128; run prev 50300 2 $SONIC 128
run prev 50300 3 $SONIC 128; run new 50310 3 $SONIC 128
if [ $(( $(date +%s) - S )) -lt 480 ]; then
  run new 50310 olmoe 16384x2048x1024x1 64; run prev 50300 olmoe 16384x2048x1024x1 64
fi
kill %1 %2; wait
{ echo "--- prev server"; cat /tmp/server_prev.log; echo "--- new server"; cat /tmp/server_new.log; } > $OUT/servers.log
stamp all done | tee -a "$OUT/bench.log"
