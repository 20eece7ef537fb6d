#!/usr/bin/env bash
# ad25bc1: a micro-batch striped over several connections (moe.proto Stripe). The pre-striping
# moe-server and moe-service-bench ("old": build-d's pair from the end of the eighth session) and
# ad25bc1's pair, the latter unstriped (--stripe_bytes=0) and striped (default: 8 MiB, 4
# connections), alternating, two rounds; then striped over 8 connections once. A retaining
# trainer, sonic-7b's shape with 1 and 4 micro-batches in flight; torch on sonic-7b in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/spx/sp.tar.xz
C=.carry/sp
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
PYTHONUNBUFFERED=1 timeout 100 python3 $C/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
stamp torch done | tee -a "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
$C/old/moe-server --device=cuda --port=50300 --metrics_port=50301 > $OUT/server_old.log 2>&1 &
$C/moe-server --device=cuda --port=50310 --metrics_port=50311 > $OUT/server_new.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" $OUT/server_old.log && grep -q "gRPC on" $OUT/server_new.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name binary port round extra-flags...
  local name=$1 bin=$2 port=$3 round=$4; shift 4
  GLIBC_TUNABLES="$R" timeout 150 $bin --server=127.0.0.1:$port --metrics=127.0.0.1:$((port + 1)) \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=128 --top_k=8 \
    --cases=24576x1536x256x1,24576x1536x256x4 "$@" > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $name round $round rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$name.txt
  echo "== $name round $round rc=$rc"; grep -E "^\| 24576" /tmp/bench.txt | head -4 | cut -d'|' -f2-8,12
  grep -E "^\| 24576 \| 1536 \| 256 \| [14] \| train \| (Forward|Backward)" /tmp/bench.txt | cut -d'|' -f5,7-12
}
for round in 1 2; do
  run old $C/old/moe-service-bench 50300 $round
  run unstriped $C/moe-service-bench 50310 $round --stripe_bytes=0
  run striped $C/moe-service-bench 50310 $round
done
run striped8 $C/moe-service-bench 50310 1 --connections=8
curl -s 127.0.0.1:50311/metrics | grep -E "^moe_striped_micro_batches_total|^moe_requests_total" > $OUT/metrics_new.txt
kill %1 %2; wait
stamp all done | tee -a "$OUT/bench.log"
