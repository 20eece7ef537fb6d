#!/usr/bin/env bash
# The client's Tensor&& overloads: the trainer hands its tensors over (moe-service-bench
# --hand_over: each rep's copies made before its clock starts) against lending views (the
# client copies them), same moe-server and bench binaries, alternating, two rounds, a retaining
# trainer whose process keeps pageable tensors, sonic-7b's shape with 1 and 4 micro-batches in
# flight; torch on sonic-7b in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ppx/pp.tar.xz
C=.carry/pp
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
PYTHONUNBUFFERED=1 timeout 100 python3 $C/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl >> $OUT/bench.log 2>&1; echo "torch rc=$?" | tee -a $OUT/bench.log; cat $OUT/torch.jsonl
$C/moe-server --device=cuda --port=50310 --metrics_port=50311 > /tmp/server.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" /tmp/server.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name round flags...
  local name=$1 round=$2; shift 2
  MOE_PINNED_TENSOR_BYTES=0 GLIBC_TUNABLES="$R" timeout 130 $C/moe-service-bench --server=127.0.0.1:50310 \
    --metrics=127.0.0.1:50311 --device=cuda --dtype=bfloat16 --timeout_seconds=100 \
    --experts=128 --top_k=8 --warmup=2 --cases=24576x1536x256x1,24576x1536x256x4 "$@" > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $name round $round rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$name.txt
  echo "== $name round $round rc=$rc"; grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [14] \| (train|infer) \| [0-9]" /tmp/bench.txt | head -4 | cut -d'|' -f2-8,12
  grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| 1 \| train \| (Forward|Backward)" /tmp/bench.txt | cut -d'|' -f5,7-12
}
run views 1; run handover 1 --hand_over
run handover 2 --hand_over; run views 2
kill %1; wait
cp /tmp/server.log $OUT/server.log
stamp all done | tee -a "$OUT/bench.log"
