"""RemoteMoE against TorchMoE, the contract in plain PyTorch: outputs, input gradients and the
weights after the server's optimizer steps, for client and server routing, micro-batch
accumulation, zero_grad, a sharded layer over two servers; the layer's state (state_dict,
optimizer state, checkpoints) and the shapes and modes a model uses it in."""

import os
import threading

import pytest
import torch

import moe_offload
from moe_offload import RemoteMoE, TorchMoE

from conftest import assert_close, random_routing

E, K, D, H = 4, 2, 16, 24


def make(target, name, **kw):
    args = dict(num_experts=E, top_k=K, d_model=D, d_hidden=H, seed=11, lr=1e-2)
    args.update(kw)
    return RemoteMoE(server=target, name=name, **args)


def adamw(ref, lr=1e-2, weight_decay=0.0):
    return torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                             weight_decay=weight_decay)


def grad_norm(module):
    return torch.sqrt(sum((p.grad.double() ** 2).sum() for p in module.parameters())).item()


def assert_same_state(layer, ref, what):
    state = layer.state_dict()
    assert set(state) == set(ref.state_dict()), what
    for name, t in ref.state_dict().items():
        assert_close(state[name], t, f"{what}: {name}")


class ClientBatch:
    """One micro-batch for both layers: the same x and weights, separate leaves."""

    def __init__(self, gen, tokens, num_experts=E, top_k=K, d=D):
        self.x = torch.randn(tokens, d, generator=gen)
        self.ids, self.w = random_routing(tokens, num_experts, top_k, gen)
        self.g = torch.randn(tokens, d, generator=gen)

    def leaves(self):
        return self.x.clone().requires_grad_(), self.w.clone().requires_grad_()

    def check(self, layer, ref, what):
        """Forward and backward through both layers; out, x.grad and weights.grad must agree."""
        x, w = self.leaves()
        out = layer(x, self.ids, w)
        (out * self.g).sum().backward()
        rx, rw = self.leaves()
        rout = ref(rx, self.ids, rw)
        (rout * self.g).sum().backward()
        assert_close(out, rout, f"{what} out")
        assert_close(x.grad, rx.grad, f"{what} x.grad")
        assert_close(w.grad, rw.grad, f"{what} weights.grad")


def test_client_routing_matches_the_reference(server, layer_name):
    layer = make(server.target, layer_name, weight_decay=0.1)
    ref = TorchMoE.like(layer)
    opt = adamw(ref, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        ClientBatch(gen, tokens=24).check(layer, ref, f"step {step}")
        info = layer.step()
        assert info["step"] == step
        assert info["grad_norm"] == pytest.approx(grad_norm(ref), rel=1e-5)
        assert sum(info["tokens_per_expert"]) == 24 * K
        opt.step()
        opt.zero_grad()
        assert_same_state(layer, ref, f"after step {step}")


@pytest.mark.parametrize("aux_weight, coefs", [(1.0, (0.01, 0.001)), (0.3, (0.5, 0.1)),
                                               (None, (0.5, 0.1))])
def test_server_routing_matches_the_reference(server, layer_name, aux_weight, coefs):
    """loss = task + w * aux trains the router's aux terms with weight w; a loss that leaves
    aux out (None) does not train them."""
    layer = make(server.target, layer_name, routing="server", aux_loss_coef=coefs[0],
                 z_loss_coef=coefs[1])
    ref = TorchMoE.like(layer)
    assert set(ref.state_dict()) == {"w1", "w3", "w2", "router"}
    opt = adamw(ref)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 3):
        x0 = torch.randn(32, D, generator=gen)
        g = torch.randn(32, D, generator=gen)
        x, rx = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        out, aux = layer(x)
        rout, raux = ref(rx)
        if aux_weight is None:
            (out * g).sum().backward()
            (rout * g).sum().backward()
        else:
            ((out * g).sum() + aux_weight * aux).backward()
            ((rout * g).sum() + aux_weight * raux).backward()
        assert_close(out, rout, f"step {step} out")
        assert aux.item() == pytest.approx(raux.item(), rel=1e-5)
        assert aux.item() > 0
        assert_close(x.grad, rx.grad, f"step {step} x.grad")
        info = layer.step()
        assert info["grad_norm"] == pytest.approx(grad_norm(ref), rel=1e-5)
        opt.step()
        opt.zero_grad()
        assert_same_state(layer, ref, f"after step {step}")


def test_micro_batches_accumulate_with_their_forwards_outstanding(server, layer_name):
    layer = make(server.target, layer_name)
    ref = TorchMoE.like(layer)
    opt = adamw(ref)
    gen = torch.Generator().manual_seed(3)
    batches = [ClientBatch(gen, tokens=t) for t in (7, 16, 5)]
    # Every forward first, then the backwards in reverse order: each context id stays in its
    # own graph until its backward.
    outs = []
    for b in batches:
        x, w = b.leaves()
        outs.append((x, w, layer(x, b.ids, w)))
    for b, (x, w, out) in reversed(list(zip(batches, outs))):
        (out * b.g).sum().backward()
        rx, rw = b.leaves()
        (ref(rx, b.ids, rw) * b.g).sum().backward()
        assert_close(x.grad, rx.grad, "x.grad")
        assert_close(w.grad, rw.grad, "weights.grad")
    info = layer.step()
    assert sum(info["tokens_per_expert"]) == (7 + 16 + 5) * K
    assert info["grad_norm"] == pytest.approx(grad_norm(ref), rel=1e-5)
    opt.step()
    assert_same_state(layer, ref, "after the accumulated step")


def test_zero_grad_drops_the_accumulated_gradients(server, layer_name):
    layer = make(server.target, layer_name)
    ref = TorchMoE.like(layer)
    opt = adamw(ref)
    gen = torch.Generator().manual_seed(4)
    dropped, kept = ClientBatch(gen, 12), ClientBatch(gen, 12)
    x, w = dropped.leaves()
    (layer(x, dropped.ids, w) * dropped.g).sum().backward()
    layer.zero_grad()
    kept.check(layer, ref, "kept batch")
    info = layer.step()
    assert sum(info["tokens_per_expert"]) == 12 * K  # the dropped batch is not counted
    opt.step()
    assert_same_state(layer, ref, "after zero_grad and one batch")


def test_state_dict_and_optimizer_state_round_trip(server, layer_name):
    layer = make(server.target, layer_name)
    gen = torch.Generator().manual_seed(5)

    def train_one_step():
        b = ClientBatch(gen, 10)
        x, w = b.leaves()
        (layer(x, b.ids, w) * b.g).sum().backward()
        layer.step()

    train_one_step()
    sd = layer.state_dict()
    opt_sd = layer.optimizer_state_dict()
    assert set(sd) == {"w1", "w3", "w2"}
    assert sd["w1"].shape == (E, H, D) and sd["w2"].shape == (E, D, H)
    assert {"w1.exp_avg", "w1.exp_avg_sq", "w2.exp_avg", "step"} <= set(opt_sd)
    assert opt_sd["step"].tolist() == [1]
    train_one_step()
    assert not torch.equal(layer.state_dict()["w1"], sd["w1"])
    layer.load_state_dict(sd)
    layer.load_optimizer_state_dict(opt_sd)
    for name, t in layer.state_dict().items():
        assert torch.equal(t, sd[name]), name
    for name, t in layer.optimizer_state_dict().items():
        assert torch.equal(t, opt_sd[name]), name

    # Another layer given the same weights computes the same outputs.
    other = make(server.target, layer_name + "_other", seed=99)
    other.load_state_dict(sd)
    b = ClientBatch(gen, 9)
    with torch.no_grad():
        assert torch.equal(layer(b.x, b.ids, b.w), other(b.x, b.ids, b.w))

    # Inside a model: keys get the module's prefix; missing and unexpected keys are reported
    # as torch's modules report them.
    model = torch.nn.ModuleDict({"moe": layer})
    assert set(model.state_dict()) == {"moe.w1", "moe.w3", "moe.w2"}
    partial = {"moe.w1": torch.zeros(E, H, D), "moe.w9": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="(?s)Missing key.*moe.w3.*Unexpected key.*moe.w9"):
        model.load_state_dict(partial)
    result = model.load_state_dict(partial, strict=False)
    assert sorted(result.missing_keys) == ["moe.w2", "moe.w3"]
    assert result.unexpected_keys == ["moe.w9"]
    assert torch.equal(layer.state_dict()["w1"], torch.zeros(E, H, D))
    assert torch.equal(layer.state_dict()["w2"], sd["w2"])


def test_save_and_load_a_checkpoint(server, layer_name):
    layer = make(server.target, layer_name)
    gen = torch.Generator().manual_seed(6)
    b = ClientBatch(gen, 10)
    x, w = b.leaves()
    (layer(x, b.ids, w) * b.g).sum().backward()
    layer.step()
    saved = layer.save(f"run1/{layer_name}.safetensors")
    assert len(saved) == 1 and saved[0]["step"] == 1 and saved[0]["bytes"] > 0
    assert os.path.isfile(os.path.join(server.checkpoint_dir, "run1", f"{layer_name}.safetensors"))
    sd = layer.state_dict()
    x, w = b.leaves()
    (layer(x, b.ids, w) * b.g).sum().backward()
    layer.step()
    layer.load(f"run1/{layer_name}.safetensors")
    for name, t in layer.state_dict().items():
        assert torch.equal(t, sd[name]), name
    assert layer.optimizer_state_dict()["step"].tolist() == [1]


def test_sharded_layer_matches_the_reference(shard_servers, layer_name):
    targets = [s.target for s in shard_servers]
    layer = RemoteMoE(servers=targets, name=layer_name, num_experts=5, top_k=K, d_model=D,
                      d_hidden=H, seed=12, lr=1e-2)
    ref = TorchMoE.like(layer)
    assert layer.state_dict()["w1"].shape == (5, H, D)
    opt = adamw(ref)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, 3):
        ClientBatch(gen, 20, num_experts=5).check(layer, ref, f"step {step}")
        info = layer.step()
        assert len(info["tokens_per_expert"]) == 5
        assert info["grad_norm"] == pytest.approx(grad_norm(ref), rel=1e-5)
        opt.step()
        opt.zero_grad()
        assert_same_state(layer, ref, f"after step {step}")

    # Each shard's checkpoint is written on its own server; loading restores both.
    sd = layer.state_dict()
    layer.save("ck/sharded.safetensors")
    for i, srv in enumerate(shard_servers):
        assert os.path.isfile(os.path.join(srv.checkpoint_dir, "ck",
                                           f"sharded.shard{i}-of-2.safetensors"))
    layer.load_state_dict({k: torch.zeros_like(v) for k, v in sd.items()})
    assert not layer.state_dict()["w2"].any()
    layer.load("ck/sharded.safetensors")
    for name, t in layer.state_dict().items():
        assert torch.equal(t, sd[name]), name


def test_batched_shapes_int64_ids_and_no_grad(server, layer_name):
    layer = make(server.target, layer_name)
    gen = torch.Generator().manual_seed(8)
    b = ClientBatch(gen, 12)
    x3, ids3, w3 = b.x.view(3, 4, D), b.ids.view(3, 4, K), b.w.view(3, 4, K)
    assert b.ids.dtype == torch.int64
    with torch.no_grad():
        out3 = layer(x3, ids3, w3)
        flat = layer(b.x, b.ids.int(), b.w)
    assert out3.shape == (3, 4, D) and out3.grad_fn is None
    assert torch.equal(out3.reshape(12, D), flat)


def test_weights_train_when_no_input_needs_a_gradient(server, layer_name):
    layer = make(server.target, layer_name)
    before = layer.state_dict()
    b = ClientBatch(torch.Generator().manual_seed(9), 10)
    out = layer(b.x, b.ids, b.w)  # neither x nor weights requires grad
    assert out.requires_grad
    (out * b.g).sum().backward()
    info = layer.step()
    assert sum(info["tokens_per_expert"]) == 10 * K
    assert not torch.equal(layer.state_dict()["w1"], before["w1"])


def test_bfloat16_layer_stays_near_the_float32_reference(server, layer_name):
    layer = make(server.target, layer_name, dtype=torch.bfloat16)
    assert layer.state_dict()["w1"].dtype == torch.bfloat16
    ref = TorchMoE.like(layer)
    b = ClientBatch(torch.Generator().manual_seed(10), 16)
    x = b.x.bfloat16().requires_grad_()
    out = layer(x, b.ids, b.w)
    assert out.dtype == torch.bfloat16
    (out.float() * b.g).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    rx = b.x.bfloat16().float().requires_grad_()
    rout = ref(rx, b.ids, b.w)
    (rout * b.g).sum().backward()
    assert_close(out, rout, "bf16 out", tol=2e-2)
    assert_close(x.grad, rx.grad, "bf16 x.grad", tol=2e-2)


def test_attach_takes_the_servers_config(server, layer_name):
    layer = make(server.target, layer_name, routing="server")
    attached = RemoteMoE(server=server.target, name=layer_name, create=False, num_experts=999)
    assert (attached.num_experts, attached.top_k, attached.routing) == (E, K, "server")
    x = torch.randn(6, D)
    with torch.no_grad():
        assert torch.equal(layer(x)[0], attached(x)[0])


def test_calls_from_several_threads(server, layer_name):
    layer = make(server.target, layer_name)
    ref = TorchMoE.like(layer)
    gen = torch.Generator().manual_seed(13)
    batches = [ClientBatch(gen, 64) for _ in range(4)]
    results = [None] * len(batches)

    def run(i):
        b = batches[i]
        x, w = b.leaves()
        (layer(x, b.ids, w) * b.g).sum().backward()
        results[i] = x.grad

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b, dx in zip(batches, results):
        rx, rw = b.leaves()
        (ref(rx, b.ids, rw) * b.g).sum().backward()
        assert_close(dx, rx.grad, "x.grad from a thread")
    assert sum(layer.step()["tokens_per_expert"]) == 4 * 64 * K


@pytest.mark.skipif(not moe_offload._autograd.HAVE_CUSTOM_OP,
                    reason="torch.library.custom_op needs torch >= 2.4")
def test_torch_compile_traces_the_custom_op(server, layer_name):
    layer = make(server.target, layer_name)
    ref = TorchMoE.like(layer)
    b = ClientBatch(torch.Generator().manual_seed(14), 16)

    def f(x, ids, w):
        return layer(x * 2, ids, w).relu()

    x, w = b.leaves()
    out = torch.compile(f, fullgraph=True)(x, b.ids, w)
    (out * b.g).sum().backward()
    rx, rw = b.leaves()
    (ref(rx * 2, b.ids, rw).relu() * b.g).sum().backward()
    assert_close(x.grad, rx.grad, "compiled x.grad")
    assert_close(w.grad, rw.grad, "compiled weights.grad")


@pytest.mark.parametrize("routing", ["client", "server"])
def test_the_binding_writes_into_destinations_as_the_cuda_path_does(server, layer_name, routing):
    """forward_into / backward_into, the calls CUDA tensors take, here with host destinations:
    the same bits as the calls that return their results, for both routings."""
    from moe_offload import _tensors

    layer = make(server.target, layer_name, routing=routing,
                 aux_loss_coef=0.0 if routing == "client" else 0.1)
    gen = torch.Generator().manual_seed(17)
    b = ClientBatch(gen, tokens=20)
    client = routing == "client"

    def spec(t):
        return _tensors.spec(t, _tensors.core_dtype(t.dtype, "t"))

    core = layer._core
    ids = b.ids.to(torch.int32)
    args = (spec(b.x), spec(ids), spec(b.w)) if client else (spec(b.x), None, None)
    context, returned, _, _, aux, z = core.forward(*args, True)
    out = torch.full_like(b.x, float("nan"))
    context_into, aux_into, z_into = core.forward_into(*args, spec(out), 0, True)
    assert torch.equal(out, _tensors.from_core(returned)) and (aux_into, z_into) == (aux, z)

    dx_ret, dw_ret = core.backward(context, spec(b.g), 0.3)
    dx = torch.full_like(b.g, float("nan"))
    dw = torch.full((20, K), float("nan")) if client else None
    core.backward_into(context_into, spec(b.g), spec(dx), None if dw is None else spec(dw), 0,
                       0.3)
    assert torch.equal(dx, _tensors.from_core(dx_ret))
    if client:
        assert torch.equal(dw, _tensors.from_core(dw_ret))
    with pytest.raises(ValueError, match="tensor spec"):
        core.forward_into(spec(b.x)[:4], None, None, spec(out), 0, False)
