"""RemoteMoE on a GPU: a training step's forward + backward (no optimizer step) through the
package, against the same calls on the binding and against PyTorch in process.

Starts moe-server (--server_bin) on cuda:0 in a child process, creates a client-routed bf16
SwiGLU RemoteMoE at each preset's shape (moe_bench's presets), puts x, the routing (top-K of
random logits, renormalised, as bench/moe_bench_layer.cc) and dout on cuda:0, and times, wall
clock with torch.cuda.synchronize() ending each rep, the median over --reps after --warmup:

  (a) autograd  out = layer(x, ids, w); out.backward(dout)   (RemoteMoE through autograd)
  (b) binding   forward_into + backward_into on the layer's _core, destinations allocated once
                (what the C++ client does, minus Python's autograd)
  (c) torch     PyTorch in process: --torch_ref's run() for the preset (its fwdbwd_ms, timed
                with CUDA events; torch._grouped_mm experts)

Prints one table and the transport the layer took; --json writes the results. Needs the
moe_offload package importable (PYTHONPATH) with an extension built with CUDA, and torch with
CUDA:

  PYTHONPATH=... python3 python/benchmarks/remote_moe_bench.py \\
      --server_bin build-cuda/server/moe-server \\
      --torch_ref ../shared/bench/torch_moe_reference.py --json out.json
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time

import torch

from moe_offload import RemoteMoE
from moe_offload import _tensors
from moe_offload.local_server import LocalServer

PRESETS = {
    "sonic-7b": dict(T=24576, d=1536, h=256, E=128, K=8),
    "olmoe": dict(T=16384, d=2048, h=1024, E=64, K=8),
}
DEVICE = "cuda:0"


def median_ms(fn, warmup, reps):
    """Median wall time of ``fn`` in ms, each rep ending with the device synchronised."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def inputs(T, d, E, K, seed):
    """x, dout (bf16), expert ids (int32) and weights (float32): the top-K of random logits'
    softmax, renormalised."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, d, device=DEVICE, generator=g).to(torch.bfloat16)
    dout = torch.randn(T, d, device=DEVICE, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, device=DEVICE, generator=g)
    p, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
    return x, dout, ids.to(torch.int32), p / p.sum(-1, keepdim=True)


def autograd_step(layer, x, ids, w, dout):
    def step():
        xl = x.detach().requires_grad_()
        wl = w.detach().requires_grad_()
        layer(xl, ids, wl).backward(dout)
    return step


def binding_step(layer, x, ids, w, dout):
    """The two calls RemoteMoE makes, on the binding, destinations allocated once."""
    core, stream = layer._core, torch.cuda.current_stream(DEVICE)
    out, dx = torch.empty_like(x), torch.empty_like(dout)
    dw = torch.empty(w.shape, dtype=torch.float32, device=DEVICE)
    tensors = (x, ids, w, out, dout, dx, dw)
    xs, ids_s, ws, outs, douts, dxs, dws = (
        _tensors.spec(t, _tensors.core_dtype(t.dtype, "t")) for t in tensors)

    def step(_holds=tensors):  # the specs are raw pointers into these tensors
        context, _, _ = core.forward_into(xs, ids_s, ws, outs, stream.cuda_stream, True)
        core.backward_into(context, douts, dxs, dws, stream.cuda_stream, 1.0)
    return step


def torch_reference(path, name, cfg):
    """The reference's own result dict for the preset (fwdbwd_ms; "error" when it failed)."""
    spec = importlib.util.spec_from_file_location("torch_moe_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.run(name, **cfg)
    except Exception as e:  # an older torch without _grouped_mm, say: reported, not fatal
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server_bin", required=True, help="the moe-server binary (a CUDA build)")
    ap.add_argument("--preset", nargs="*", default=sorted(PRESETS), choices=sorted(PRESETS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--transport", default="auto", choices=["auto", "tcp", "shm"])
    ap.add_argument("--torch_ref", help="torch_moe_reference.py; without it (c) is not run")
    ap.add_argument("--server_flags", nargs="*", default=[],
                    help="extra moe-server flags, e.g. --server_flags=--memory_fraction=0.9")
    ap.add_argument("--json", help="write the results here (a JSON list, one object a preset)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("remote_moe_bench: needs a CUDA device")

    results = []
    with LocalServer(binary=a.server_bin, device=DEVICE, extra_flags=a.server_flags) as srv:
        for name in a.preset:
            cfg = PRESETS[name]
            T, d, h, E, K = (cfg[k] for k in "TdhEK")
            layer = RemoteMoE(server=srv.target, name=name, num_experts=E, top_k=K, d_model=d,
                              d_hidden=h, routing="client", dtype=torch.bfloat16,
                              activation="swiglu", optimizer="sgd", transport=a.transport,
                              timeout=600.0)
            x, dout, ids, w = inputs(T, d, E, K, seed=1)
            r = dict(preset=name, **cfg, dtype="bfloat16", routing="client",
                     gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
            r["autograd_ms"] = median_ms(autograd_step(layer, x, ids, w, dout), a.warmup, a.reps)
            r["binding_ms"] = median_ms(binding_step(layer, x, ids, w, dout), a.warmup, a.reps)
            r["transport"] = layer.transport
            layer.zero_grad()
            del layer, x, dout, ids, w
            torch.cuda.empty_cache()
            if a.torch_ref:
                ref = torch_reference(a.torch_ref, name, cfg)
                r["torch_ms"] = ref.get("fwdbwd_ms")
                r["torch_impl"] = ref.get("impl")
                if "error" in ref:
                    r["torch_error"] = ref["error"]
            results.append(r)

    print(f"# RemoteMoE forward+backward, bf16 client routing, SwiGLU; {results[0]['gpu']}, "
          f"torch {torch.__version__}; median of {a.reps} after {a.warmup} warm-up (ms; (a) and "
          "(b) wall clock to a synchronised device, (c) the reference's CUDA-event time)")
    print("| preset | T | d | h | E | K | (a) autograd | (b) binding | (c) torch in process |"
          " (a)/(c) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        torch_ms = r.get("torch_ms")
        ratio = f"{r['autograd_ms'] / torch_ms:.2f}" if torch_ms else "-"
        print(f"| {r['preset']} | {r['T']} | {r['d']} | {r['h']} | {r['E']} | {r['K']} | "
              f"{r['autograd_ms']:.2f} | {r['binding_ms']:.2f} | "
              f"{f'{torch_ms:.2f}' if torch_ms else r.get('torch_error', '-')} | {ratio} |")
    for r in results:
        t = r["transport"]
        print(f"# {r['preset']}: host tensors over {t['host']} ({t['reason']}); device tensors: "
              f"{t['device']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
