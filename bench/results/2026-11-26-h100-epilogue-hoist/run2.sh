#!/usr/bin/env bash
# Fifteenth session, second call (the same build, .carry/ehx): the forward's kernels
# (moe_sm90_bench: the configuration Sm90ChooseConfig picks) before and after the change,
# alternated, twice, on sonic-7b, olmoe and scale-8k; then moe_bench before and after on the same
# presets, each beside torch_moe_reference.py (scripts/bench), twice, alternated.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ehx/eh.tar.xz
C=.carry/eh
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader; } | tee "$OUT/ab.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
for round in 1 2; do for v in base new; do
  b=$C/moe_sm90_bench; [ $v = base ] && b=$C/base_moe_sm90_bench
  timeout 40 $b sonic-7b olmoe scale-8k 2>/dev/null | grep '"kind":"fused"' | sed "s/^/$round $v /" >> "$OUT/kernels.txt"
done; done
stamp kernels done | tee -a "$OUT/ab.log"
for round in 1 2; do for v in base new; do
  b=$C/moe_bench; [ $v = base ] && b=$C/base_moe_bench
  MOE_COMMIT=$v PYTHONUNBUFFERED=1 timeout 100 scripts/bench --bin $b --torch $C/torch_moe_reference.py --out /tmp/ab_$v$round sonic-7b olmoe scale-8k > /tmp/ab_$v$round.log 2>&1; echo "ab $v round $round rc=$?" >> "$OUT/ab.log"
  cat /tmp/ab_$v$round.log >> "$OUT/ab_runs.log"; cat /tmp/ab_$v$round/ours.jsonl >> "$OUT/ab_ours.jsonl"; cat /tmp/ab_$v$round/torch.jsonl >> "$OUT/ab_torch.jsonl"
  stamp ab $v $round | tee -a "$OUT/ab.log"
done; done
grep -E "rc=" "$OUT/ab.log"
python3 - "$OUT/kernels.txt" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r, v, j = l.split(" ", 2)
    d = json.loads(j)
    print(r, v, d["preset"], "up %.4f down %.4f fwd %.4f" % (d["up_ms"], d["down_ms"], d["fwd_ms"]))
PY
for v in base new; do for round in 1 2; do echo "== $v $round"; grep -E "^(sonic|olmoe|scale)" /tmp/ab_$v$round.log | cut -c1-150; done; done
