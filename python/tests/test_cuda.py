"""RemoteMoE on CUDA tensors (needs a GPU; skipped without one): against a moe-server on cuda:0,
the device path (CUDA IPC with "auto", staged by the client with "tcp") gives the same bits as
the host path on the same layer (out, x.grad, weights.grad) for float32 and bfloat16, client
and server routing, with two micro-batches outstanding and a non-contiguous input, and so does
a layer sharded over two such servers (split and summed on the GPU); and Python adds no wait for
the GPU.

The extension must be built with CUDA (MOE_ENABLE_CUDA=ON): one built without it stages CUDA
tensors in Python, which the transport checks report as a failure.
"""

import pytest
import torch

from moe_offload import RemoteMoE
from moe_offload.local_server import LocalServer

from conftest import random_routing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

E, K, D, H, T = 8, 2, 256, 128, 48
DEVICE = "cuda:0"


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    srv = LocalServer(checkpoint_dir=str(tmp_path_factory.mktemp("gpu")), device=DEVICE)
    yield srv
    srv.stop()


def make(target, name, routing, dtype, transport="auto"):
    # Router losses exist only with server routing (a client-routed layer refuses them).
    losses = dict(aux_loss_coef=0.05, z_loss_coef=0.01) if routing == "server" else {}
    return RemoteMoE(server=target, name=name, num_experts=E, top_k=K, d_model=D, d_hidden=H,
                     routing=routing, dtype=dtype, seed=5, transport=transport, **losses)


def micro_batches(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(2):
        ids, w = random_routing(T, E, K, gen)
        batches.append(dict(x=torch.randn(T, D, generator=gen).to(dtype), ids=ids, w=w,
                            g=torch.randn(T, D, generator=gen)))
    return batches


def run(layer, batches, device):
    """Both forwards first (two contexts outstanding on the server), then both backwards, the
    second micro-batch's first. -> [(out, x.grad, weights.grad or None)] per micro-batch."""
    leaves, outs, losses = [], [], []
    for i, b in enumerate(batches):
        x = b["x"].to(device)
        if device != "cpu" and i == 1:
            x = x.t().contiguous().t()  # the same values, column-major
            assert not x.is_contiguous()
        x = x.detach().requires_grad_()
        g = b["g"].to(device)
        if layer.routing == "client":
            w = b["w"].to(device).detach().requires_grad_()
            out = layer(x, b["ids"].to(device), w)
            loss = (out.float() * g).sum()
        else:
            w = None
            out, aux = layer(x)
            assert aux.device == x.device
            loss = (out.float() * g).sum() + 0.3 * aux
        leaves.append((x, w))
        outs.append(out)
        losses.append(loss)
    for loss in reversed(losses):
        loss.backward()
    return [(out.detach().cpu(), x.grad.cpu(), None if w is None else w.grad.cpu())
            for out, (x, w) in zip(outs, leaves)]


def bits(t):
    t = t.contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("routing", ["client", "server"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_tensors_give_the_host_paths_bits(gpu_server, transport, routing, dtype):
    layer = make(gpu_server.target, f"cuda_{transport}_{routing}_{dtype}".replace(".", "_"),
                 routing, dtype, transport)
    batches = micro_batches(dtype, seed=len(transport) + len(routing))
    host = run(layer, batches, "cpu")
    device = run(layer, batches, DEVICE)
    for i, (h, d) in enumerate(zip(host, device)):
        for name, a, b in zip(("out", "x.grad", "weights.grad"), d, h):
            if b is None:
                assert a is None
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, f"micro-batch {i} {name}"
            assert torch.equal(bits(a), bits(b)), (
                f"micro-batch {i} {name}: {transport} {routing} {dtype} differs from the host "
                f"path by up to {(a.float() - b.float()).abs().max().item():g}")
    expected = "cuda ipc" if transport == "auto" else "staged"
    assert layer.transport["device"] == expected, layer.transport


@pytest.fixture(scope="module")
def gpu_shard_servers(tmp_path_factory):
    servers = [LocalServer(checkpoint_dir=str(tmp_path_factory.mktemp(f"gpu_shard{i}")),
                           device=DEVICE) for i in range(2)]
    yield servers
    for srv in servers:
        srv.stop()


def test_a_sharded_layer_on_cuda_tensors_gives_the_host_paths_bits(gpu_shard_servers):
    layer = RemoteMoE(servers=[s.target for s in gpu_shard_servers], name="cuda_sharded",
                      num_experts=E, top_k=K, d_model=D, d_hidden=H, routing="client",
                      dtype=torch.float32, seed=5)
    batches = micro_batches(torch.float32, seed=3)
    host = run(layer, batches, "cpu")
    device = run(layer, batches, DEVICE)
    for i, (h, d) in enumerate(zip(host, device)):
        for name, a, b in zip(("out", "x.grad", "weights.grad"), d, h):
            assert a.dtype == b.dtype and a.shape == b.shape, f"micro-batch {i} {name}"
            assert torch.equal(bits(a), bits(b)), (
                f"micro-batch {i} {name}: the sharded layer's device path differs from its host "
                f"path by up to {(a.float() - b.float()).abs().max().item():g}")
    assert layer.transport["device"] == "cuda ipc", layer.transport


@pytest.mark.parametrize("routing", ["client", "server"])
def test_python_adds_no_synchronisation(gpu_server, routing):
    """Forward and backward on CUDA tensors make no torch call that waits for the GPU (torch's
    sync debug mode raises on one). Server routing without router losses: with them, the
    backward reads grad_aux on the host, which waits by design."""
    layer = RemoteMoE(server=gpu_server.target, name=f"cuda_no_sync_{routing}", num_experts=E,
                      top_k=K, d_model=D, d_hidden=H, routing=routing, dtype=torch.bfloat16)
    b = micro_batches(torch.bfloat16, seed=9)[0]
    x = b["x"].to(DEVICE).requires_grad_()
    w = b["w"].to(DEVICE).requires_grad_()
    ids = b["ids"].to(DEVICE)  # int64, as topk gives them

    def step():
        if routing == "client":
            layer(x, ids, w).float().sum().backward()
        else:
            out, aux = layer(x)
            (out.float().sum() + aux).backward()

    step()  # the first call decides the device transport
    torch.cuda.synchronize()
    assert layer.transport["device"] == "cuda ipc", layer.transport
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad.float()).all()
