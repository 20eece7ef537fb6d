"""The ScatterMoE baseline: ScatterMoE's Triton kernels on the presets of torch_moe_reference.py.

Why: users compare the layer with the two strongest MoE implementations that run on our GPU,
PyTorch's grouped GEMM (torch_moe_reference.py) and ScatterMoE's Triton kernels (this file).
scripts/bench runs both beside moe_bench in one call, so every ratio comes from one run.

What it times is ScatterMoE's own SwiGLU MLP, as its authors build it: one scatter2scatter
launch for the gate and up projections together (x gathered through the sorted index, output in
expert order), silu(gate) * up in PyTorch, one scatter2scatter for the down projection (input in
expert order, output scattered back and weighted by the routing weights), and the kernels'
own backward (group, groupXtY, scatter2scatter). Routing (torch.sort + ScatterMoE's padded block
indices) is inside the timed work, as the argsort is on the PyTorch side.

Everything else follows torch_moe_reference.py. Imported from it: the presets, the routing
for a seed, and the median of CUDA-event timings after warm-up. Drawn with its recipe, so the
same values for a seed (its `run` makes them inline, so they cannot be imported): the weights,
inputs and output gradient (make_inputs); the weights are stored in ScatterMoE's layout
(experts, in, out). Counted its way: the memory kept for the backward.

ScatterMoE is not on PyPI; scripts/fetch-scattermoe unpacks its kernels, unchanged, from the
fms-acceleration-moe wheel. Needs a GPU, PyTorch and Triton.

  python3 bench/scattermoe_reference.py --kernels build/scattermoe --torch-ref PATH \
      --preset sonic-7b olmoe
  python3 bench/scattermoe_reference.py --kernels DIR --torch-ref PATH --check  # correctness only

Every run first checks ScatterMoE's output and all five gradients against a float64
reference on small shapes, and exits 1 (timing nothing) if they disagree: a timing of the
wrong math is not a baseline.
"""
import argparse
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F

# Small shapes for the correctness check: ragged experts, K > 1, an expert left empty (E large
# against T*K), and widths that are not multiples of ScatterMoE's 128-wide blocks.
CHECK_SHAPES = [
    dict(T=256, d=256, h=128, E=8, K=2),
    dict(T=96, d=192, h=320, E=64, K=4),
    dict(T=1000, d=128, h=64, E=16, K=8),
]
# Relative Frobenius error allowed against float64 for bf16 inputs and bf16 outputs.
CHECK_TOLERANCE = 2e-2


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        sys.exit(f"scattermoe_reference: --torch-ref: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_scattermoe(kernels_dir):
    """Imports ScatterMoE's `khd` package from the folder scripts/fetch-scattermoe filled."""
    if not os.path.isfile(os.path.join(kernels_dir, "khd", "kernels", "ops", "__init__.py")):
        sys.exit(f"scattermoe_reference: --kernels: no khd/kernels/ops in {kernels_dir} "
                 "(run scripts/fetch-scattermoe)")
    sys.path.insert(0, os.path.abspath(kernels_dir))
    import khd.kernels.ops as ops  # noqa: E402  (the path is only known at run time)
    return ops


def scattermoe_layer(ops, x, p, idx, w13, w2):
    """ScatterMoE's SwiGLU MLP. w13: (E, d, 2h), gate columns then up; w2: (E, h, d)."""
    E, h, K = w13.shape[0], w2.shape[1], idx.shape[1]
    with torch.no_grad():
        sorted_expert, sorted_slot = torch.sort(idx.flatten())
        padded_blocks, expert_ends = ops.padded_block_indices(sorted_expert, E)
    gate_up = ops.scattered_experts(x, w13, K, sorted_expert, sorted_slot, padded_blocks,
                                    expert_ends, grouped_out=True)
    a = F.silu(gate_up[:, :h]) * gate_up[:, h:]
    return ops.scattered_experts(a, w2, 1, sorted_expert, sorted_slot, padded_blocks,
                                 expert_ends, gates=p, grouped_in=True)


def float64_layer(x, p, idx, w13, w2):
    """The contract in float64, one (token, k) pair at a time per expert. w13: (E, 2h, d)."""
    E, h = w13.shape[0], w2.shape[-1]
    out = torch.zeros_like(x)
    for e in range(E):
        tokens, ks = (idx == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w13[e].t()
        a = F.silu(gate_up[:, :h]) * gate_up[:, h:]
        out = out.index_add(0, tokens, (a @ w2[e].t()) * p[tokens, ks][:, None])
    return out


def make_inputs(ref, T, d, h, E, K, seed):
    """torch_moe_reference.py's inputs for a seed, in its layout: w13 (E, 2h, d), w2 (E, d, h)."""
    bf = torch.bfloat16
    torch.manual_seed(seed)
    w13 = (torch.randn(E, 2 * h, d, device="cuda") * d ** -0.5).to(bf)
    w2 = (torch.randn(E, d, h, device="cuda") * h ** -0.5).to(bf)
    x = torch.randn(T, d, device="cuda").to(bf)
    p, idx = ref.routing(T, E, K, seed + 1)
    dy = torch.randn(T, d, device="cuda").to(bf)
    return x, p, idx, w13, w2, dy


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def check(ops, ref):
    """Output and gradients of x, p, W13 and W2 against float64; returns the worst error."""
    worst = 0.0
    for i, shape in enumerate(CHECK_SHAPES):
        x, p, idx, w13, w2, dy = make_inputs(ref, seed=100 + i, **shape)
        x1, p1, w13s, w2s = leaves(x, p, w13.transpose(1, 2).contiguous(),
                                   w2.transpose(1, 2).contiguous())
        y1 = scattermoe_layer(ops, x1, p1, idx, w13s, w2s)
        got = [y1] + list(torch.autograd.grad(y1, [x1, p1, w13s, w2s], dy))
        got[3], got[4] = got[3].transpose(1, 2), got[4].transpose(1, 2)
        x2, p2, w13d, w2d = leaves(*(t.double() for t in (x, p, w13, w2)))
        y2 = float64_layer(x2, p2, idx, w13d, w2d)
        want = [y2] + list(torch.autograd.grad(y2, [x2, p2, w13d, w2d], dy.double()))
        errors = {}
        for name, g, w in zip(("out", "dx", "dp", "dw13", "dw2"), got, want):
            errors[name] = ((g.double() - w).norm() / w.norm().clamp_min(1e-30)).item()
        worst = max(worst, *errors.values())
        print(json.dumps(dict(impl="scattermoe-check", **shape,
                              rel_error={k: float(f"{v:.3g}") for k, v in errors.items()},
                              ok=max(errors.values()) <= CHECK_TOLERANCE)), flush=True)
    return worst


def run(ops, ref, name, T, d, h, E, K, seed=0):
    res = dict(preset=name, T=T, d=d, h=h, E=E, K=K, impl="scattermoe-triton")
    try:
        x, p, idx, w13, w2, dy = make_inputs(ref, T, d, h, E, K, seed)
        w13 = w13.transpose(1, 2).contiguous().requires_grad_()
        w2 = w2.transpose(1, 2).contiguous().requires_grad_()
        x, p = x.requires_grad_(), p.requires_grad_()
        params = [x, p, w13, w2]

        def fwd():
            with torch.no_grad():
                scattermoe_layer(ops, x, p, idx, w13, w2)

        def fwd_bwd():
            torch.autograd.grad(scattermoe_layer(ops, x, p, idx, w13, w2), params, dy)

        res["fwd_ms"] = ref.median_ms(fwd)
        res["fwdbwd_ms"] = ref.median_ms(fwd_bwd)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = scattermoe_layer(ops, x, p, idx, w13, w2)
        torch.cuda.synchronize()
        res["saved_MiB"] = (torch.cuda.memory_allocated() - base - y.numel() * y.element_size()) / 2**20
        del y
        flop = 6.0 * T * K * d * h
        res["fwd_tflops"] = flop / res["fwd_ms"] / 1e9
        res["fwdbwd_tflops"] = 3 * flop / res["fwdbwd_ms"] / 1e9
    except torch.OutOfMemoryError as exc:
        res["error"] = "OOM: " + str(exc).splitlines()[0][:120]
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", required=True, help="the folder scripts/fetch-scattermoe filled")
    ap.add_argument("--torch-ref", default=os.environ.get("MOE_TORCH_REFERENCE"),
                    help="torch_moe_reference.py (not part of this repository; default: "
                    "$MOE_TORCH_REFERENCE)")
    ap.add_argument("--preset", nargs="*", default=[])
    ap.add_argument("--all", action="store_true", help="every preset")
    ap.add_argument("--check", action="store_true", help="only the correctness check")
    ap.add_argument("--json", help="also append the results, one JSON object a line, to this file")
    a = ap.parse_args()
    if not a.torch_ref:
        sys.exit("scattermoe_reference: name torch_moe_reference.py with --torch-ref PATH or "
                 "MOE_TORCH_REFERENCE=PATH")
    ref = load_module("torch_moe_reference", a.torch_ref)
    unknown = [n for n in a.preset if n not in ref.PRESETS]
    if unknown:
        sys.exit(f"scattermoe_reference: --preset: unknown {', '.join(unknown)}")
    ops = load_scattermoe(a.kernels)
    import triton
    print(f"# ScatterMoE kernels from {a.kernels}, triton {triton.__version__}, torch "
          f"{torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    worst = check(ops, ref)
    if worst > CHECK_TOLERANCE:
        sys.exit(f"scattermoe_reference: ScatterMoE disagrees with float64 (relative error "
                 f"{worst:.3g} > {CHECK_TOLERANCE}); nothing timed")
    if a.check:
        return
    for name in sorted(ref.PRESETS) if a.all else a.preset:
        line = json.dumps(run(ops, ref, name, **ref.PRESETS[name]))
        print(line, flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
