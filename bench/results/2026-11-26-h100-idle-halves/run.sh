#!/usr/bin/env bash
# Fourteenth session, on the GPU machine: the padding halves and k16 steps skipped (working
# tree) against HEAD's kernels. gpu-check on the prebuilt binaries; the mutant tests (must
# fail); the three kernel benches, base and skip in turn, twice; then scripts/bench over the
# working tree's moe_bench beside torch_moe_reference.py.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/skx/sk.tar.xz
C=.carry/sk
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(head -1 $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/run.log"
timeout 240 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log" | tee -a "$OUT/run.log"; grep -E "FAILED|DIFFERS" "$OUT/gpu-check.log" | head -10
stamp gpu-check done | tee -a "$OUT/run.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
for c in ragged odd tail-k; do timeout 60 $C/mutant/sm90_expert_forward_test $c >> "$OUT/mutant.log" 2>&1; echo "forward mutant $c rc=$?" >> "$OUT/run.log"; done
timeout 120 $C/mutant/sm90_weight_grad_test >> "$OUT/mutant.log" 2>&1; echo "weight-grad mutant rc=$?" >> "$OUT/run.log"
echo "mutant: $(grep -c '^FAIL' $OUT/mutant.log) FAIL lines, $(grep -c '^PASS' $OUT/mutant.log) PASS lines" >> "$OUT/run.log"
stamp mutants done | tee -a "$OUT/run.log"
P="sonic-7b olmoe qwen3-a3b scale-8k deepseek-v3"
for round in 1 2; do
  for v in base skip; do
    timeout 200 $C/$v/sm90_bench --json "$OUT/$v.jsonl" $P > /dev/null 2>> "$OUT/run.log"; echo "$v fwd bench round $round rc=$?" >> "$OUT/run.log"
    for p in $P; do timeout 90 $C/$v/sm90_backward_bench $p >> "$OUT/$v.jsonl" 2>> "$OUT/run.log"; done
    timeout 200 $C/$v/sm90_weight_grad_bench $P >> "$OUT/$v.jsonl" 2>> "$OUT/run.log"; echo "$v wgrad bench round $round rc=$?" >> "$OUT/run.log"
  done
done
stamp kernel benches done | tee -a "$OUT/run.log"
MOE_COMMIT=$(head -1 $C/COMMIT) PYTHONUNBUFFERED=1 timeout 240 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out /tmp/b --cool-to 50 --cool-timeout 5 $P >> "$OUT/run.log" 2>&1; echo "bench rc=$?" >> "$OUT/run.log"
cp /tmp/b/ours.jsonl /tmp/b/torch.jsonl "$OUT/"
stamp all done | tee -a "$OUT/run.log"
grep -E "rc=|mutant:" "$OUT/run.log"
grep -v "^{" "$OUT/run.log" | grep -E "^(preset|sonic|olmoe|qwen|scale|deepseek)" | cut -c1-150
python3 - "$OUT/base.jsonl" "$OUT/skip.jsonl" <<'PY'
import json, sys, collections
def load(f):
    t = collections.defaultdict(list)
    for l in open(f):
        try: d = json.loads(l)
        except Exception: continue
        if d.get("kind") == "fused":
            t[(d["preset"], "up")].append(d["up_ms"]); t[(d["preset"], "down")].append(d["down_ms"])
        elif "da_ws_ms" in d:
            t[(d["preset"], "dA")].append(d["da_ms"]); t[(d["preset"], "dX")].append(d["dx_ms"])
        elif d.get("kind") == "wgrad" and d.get("impl") == "fused" and d.get("tma") == 1:
            t[(d["preset"], d["grad"])].append(d["ms"])
    return t
b, s = load(sys.argv[1]), load(sys.argv[2])
for k in sorted(b):
    print("%-11s %-5s base %s skip %s" % (k[0], k[1], " ".join("%.4f" % x for x in b[k]), " ".join("%.4f" % x for x in s.get(k, []))))
PY
