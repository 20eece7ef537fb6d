"""Short table of a sm90_weight_grad_bench jsonl (+ torch jsonl): ms (acc ms) per impl."""
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    if r.get("kind") == "occupancy":
        print("occupancy", r)
cols = {}
for r in rows:
    if r.get("kind") != "wgrad":
        continue
    impl = r["impl"]
    if impl == "fused":
        impl = {(256, 0): "L256", (128, 0): "L128_2cta", (256, 1): "L256_pp"}.get(
            (r["block_n"], r["warp_specialized"]), "L?")
    key = (r["preset"], r["grad"])
    cols.setdefault(key, []).append((impl, r["ms"], r.get("accumulate_ms"), r["tflops"], r.get("check", "")))
for key, v in cols.items():
    print("%-10s %-5s " % key + " ".join(
        "%s=%.3f/%s%s" % (i, ms, ("%.3f" % a) if a else "-", "" if c in ("ok", "") else "!" + c)
        for i, ms, a, tf, c in v))
if len(sys.argv) > 2:
    try:
        for l in open(sys.argv[2]):
            t = json.loads(l)
            print("torch %-10s fwd %.3f fwdbwd %.3f ms" % (t["preset"], t["fwd_ms"], t["fwdbwd_ms"]))
    except OSError:
        print("no torch jsonl")
