#!/usr/bin/env bash
# The second device call for the ws+multicast study, over the binaries of
# bench/sm90_mc_build_carry.sh in DIR: is the multicast's loss the cluster grid's fewer SMs?
#   1. sm90_mc_bench on PRESETS as built (a repeat of the first call's timing)   -> mc.jsonl
#   2. sm90_mc_bench_capped with MOE_SM90_CTA_CAP = the multicast grid's CTA count (from 1's
#      "clusters" line): default, ws and ws+mc then all run on that many CTAs -> mc_capped.jsonl
#   3. torch_moe_reference.py on PRESETS                             -> torch.jsonl, torch.log
# Usage: sm90_mc_device_run_cap.sh DIR PRESET...
set -uo pipefail
C=$1; shift
P="$*"
export LD_LIBRARY_PATH=$PWD/$C/lib:${LD_LIBRARY_PATH:-}
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*" | tee -a "$OUT/run.log"; }
gpu() { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$OUT/run.log"; }
stamp start; echo "commit $(cat $C/COMMIT)" | tee -a "$OUT/run.log"; gpu
timeout 90 $C/sm90_mc_bench --rounds ${ROUNDS:-60} $P > "$OUT/mc.jsonl" 2>> "$OUT/run.log"
echo "mc bench rc=$?" | tee -a "$OUT/run.log"; stamp mc bench done; gpu
cap=$(python3 -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1]) if '\"clusters\"' in l][0]['mc_grid_ctas'])" "$OUT/mc.jsonl")
echo "cap=$cap" | tee -a "$OUT/run.log"
MOE_SM90_CTA_CAP=$cap timeout 90 $C/sm90_mc_bench_capped --rounds ${ROUNDS:-60} $P > "$OUT/mc_capped.jsonl" 2>> "$OUT/run.log"
echo "mc bench capped rc=$?" | tee -a "$OUT/run.log"; stamp mc capped done; gpu
PYTHONUNBUFFERED=1 timeout 120 python3 $C/torch_moe_reference.py --preset $P \
  --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1
echo "torch rc=$?" | tee -a "$OUT/run.log"; stamp torch done
python3 - "$OUT/mc.jsonl" "$OUT/mc_capped.jsonl" <<'PY' | tee -a "$OUT/run.log"
import json, sys
for f in sys.argv[1:]:
    print("==", f.split("/")[-1])
    for l in open(f):
        r = json.loads(l)
        if r.get("kind") != "interleaved":
            print(l.strip()); continue
        print(f"{r['preset']:10s} {r['proj']:4s} {r['cand']:8s} {r['config']:10s} {r['ms']:.4f} ms {r['tflops']:6.1f} TF x{r['vs_default']:.3f} {r['check']}")
PY
stamp all done
