#!/usr/bin/env python3
"""Per (routing, preset, kernel): the kernel's ms for each prefetch build, both rounds.

Reads kernels_*.jsonl from run.sh: a tag line {"round", "prefetch", "routing"} before each
build's records. Kernels: the forward's chosen up and down (sm90_bench's "fused" line), dA and
dX (sm90_backward_bench, the chosen configs), dW2 and dW13 (sm90_weight_grad_bench, block_n 256
with the slot-order operand by TMA, what the launchers choose at d <= 2048)."""
import json
import sys
from collections import defaultdict

times = defaultdict(lambda: defaultdict(list))  # (routing, preset, kernel) -> prefetch -> [ms]
for path in sys.argv[1:]:
    tag = None
    for line in open(path):
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        if "round" in j:
            tag = j
            continue
        if tag is None:
            continue
        key = lambda k: (tag["routing"], j["preset"], k)
        pf = tag["prefetch"]
        if j.get("kind") == "fused":
            times[key("up")][pf].append(j["up_ms"])
            times[key("down")][pf].append(j["down_ms"])
        elif j.get("kind") is None and "da_ms" in j:
            times[key("dA")][pf].append(j["da_ms"])
            times[key("dX")][pf].append(j["dx_ms"])
        elif j.get("kind") == "wgrad" and j.get("impl") == "fused" and j.get("block_n") == 256 \
                and j.get("tma") == 1:
            times[key(j["grad"])][pf].append(j["ms"])
order = ["up", "down", "dA", "dX", "dW2", "dW13"]
print(f"{'routing':16} {'preset':10} {'kernel':6} " +
      " ".join(f"{'p' + str(p) + ' (r1, r2)':>18}" for p in (0, 4, 8)) + "   p4/p0   p8/p0")
for (routing, preset, kernel) in sorted(times, key=lambda k: (k[0], k[1], order.index(k[2]))):
    per = times[(routing, preset, kernel)]
    cells, means = [], {}
    for p in (0, 4, 8):
        v = per.get(p, [])
        means[p] = sum(v) / len(v) if v else float("nan")
        cells.append(f"{', '.join(f'{x:.4f}' for x in v):>18}")
    print(f"{routing:16} {preset:10} {kernel:6} " + " ".join(cells) +
          f"   {means[4] / means[0]:.3f}   {means[8] / means[0]:.3f}")
