"""Joins one run's fused-kernel lines (sm90_bench) with torch_moe_reference.py's lines.

Both files must come from the same call on the same GPU: every ratio printed here is between
numbers measured in that one run. Usage: sm90_compare.py FUSED.jsonl TORCH.jsonl
"""
import json
import sys


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def main():
    fused, torch = load(sys.argv[1]), load(sys.argv[2])
    ceil = next(r for r in fused if r.get("kind") == "ceilings")
    ref = {r["preset"]: r for r in torch if "preset" in r}
    print(f"cuBLAS dense bf16 {ceil['cublas_bf16_tflops']:.0f} TFLOP/s, "
          f"copy {ceil['copy_tbs']:.2f} TB/s (read+write), same run")
    print(f"{'preset':12} {'up ms':>7} {'down ms':>7} {'comb ms':>7} {'fwd ms':>7} "
          f"{'TFLOP/s':>7} {'%cuBLAS':>7} {'floor ms':>8} {'torch ms':>8} {'speedup':>7}")
    for r in fused:
        if r.get("kind") != "fused":
            continue
        t = ref.get(r["preset"], {})
        tms = t.get("fwd_ms")
        floor = max(r["flop_floor_ms"], r["byte_floor_ms"])
        print(f"{r['preset']:12} {r['up_ms']:7.3f} {r['down_ms']:7.3f} {r['combine_ms']:7.3f} "
              f"{r['fwd_ms']:7.3f} {r['fwd_tflops']:7.0f} "
              f"{100 * r['fwd_tflops'] / ceil['cublas_bf16_tflops']:6.0f}% {floor:8.3f} "
              f"{tms if tms else float('nan'):8.3f} "
              f"{(tms / r['fwd_ms']) if tms else float('nan'):6.2f}x")


if __name__ == "__main__":
    main()
