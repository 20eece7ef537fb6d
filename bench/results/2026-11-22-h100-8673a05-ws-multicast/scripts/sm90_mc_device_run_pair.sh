#!/usr/bin/env bash
# The third device call for the ws+multicast study, over the binaries of
# bench/sm90_mc_build_carry.sh in DIR: where does the multicast's loss come from?
#   sm90_mc_bench       (multicast)                 uniform routing, then --balanced
#   sm90_mc_bench_pair  (pairs, no multicast)       uniform routing, then --balanced
#   torch_moe_reference.py on PRESETS
# Each bench times default, ws, and its multicast_b candidates interleaved; ws is the common
# reference of the two binaries. Output: mc.jsonl (all four bench runs), torch.jsonl, torch.log,
# run.log. Usage: sm90_mc_device_run_pair.sh DIR PRESET...
set -uo pipefail
C=$1; shift
P="$*"
export LD_LIBRARY_PATH=$PWD/$C/lib:${LD_LIBRARY_PATH:-}
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*" | tee -a "$OUT/run.log"; }
gpu() { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$OUT/run.log"; }
stamp start; echo "commit $(cat $C/COMMIT)" | tee -a "$OUT/run.log"; gpu
for b in sm90_mc_bench sm90_mc_bench_pair; do
  for r in "" --balanced; do
    timeout 60 $C/$b --rounds ${ROUNDS:-60} $r $P >> "$OUT/mc.jsonl" 2>> "$OUT/run.log"
    echo "$b $r rc=$?" | tee -a "$OUT/run.log"; stamp $b $r done; gpu
  done
done
PYTHONUNBUFFERED=1 timeout 120 python3 $C/torch_moe_reference.py --preset $P \
  --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1
echo "torch rc=$?" | tee -a "$OUT/run.log"; stamp torch done
python3 - "$OUT/mc.jsonl" <<'PY' | tee -a "$OUT/run.log"
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r.get("kind") != "interleaved":
        print(l.strip()); continue
    if r["cand"] not in ("ws", "ws_mc") or r["block_n"] != 256: continue
    print(f"{r['variant'][:4]} {r['routing'][:4]} {r['preset']:10s} {r['proj']:4s} {r['cand']:6s} {r['config']:9s} {r['ms']:.4f} ms {r['tflops']:6.1f} TF x{r['vs_default']:.3f} {r['check']}")
PY
stamp all done
