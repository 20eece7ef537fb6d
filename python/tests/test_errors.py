"""Bad input and failed calls: ServerError with the gRPC code and a message naming the field,
local checks that catch what the wire cannot carry, and misuse of the autograd graph."""

import pickle

import pytest
import torch

from moe_offload import RemoteMoE, ServerError

E, K, D, H = 4, 2, 8, 16


def make(target, name, **kw):
    args = dict(num_experts=E, top_k=K, d_model=D, d_hidden=H)
    args.update(kw)
    return RemoteMoE(server=target, name=name, **args)


def routing(tokens):
    return torch.tensor([[0, 1]] * tokens), torch.full((tokens, K), 0.5)


def test_wrong_shape_is_invalid_argument_naming_x(server, layer_name):
    layer = make(server.target, layer_name)
    ids, w = routing(5)
    with pytest.raises(ServerError) as e:
        layer(torch.randn(5, D + 1), ids, w)
    assert e.value.code == "INVALID_ARGUMENT"
    assert e.value.message.startswith("x:"), e.value.message
    assert str(e.value).startswith("INVALID_ARGUMENT: x:")


def test_bad_routing_is_invalid_argument_naming_the_element(server, layer_name):
    layer = make(server.target, layer_name)
    with pytest.raises(ServerError) as e:
        layer(torch.randn(2, D), torch.tensor([[0, 1], [2, E]]), torch.ones(2, K))
    assert e.value.code == "INVALID_ARGUMENT"
    assert "expert_ids[1, 1]" in e.value.message
    with pytest.raises(ServerError) as e:
        layer(torch.randn(2, D), torch.tensor([[0, 1], [2, 3]]), torch.ones(3, K))
    assert e.value.code == "INVALID_ARGUMENT" and "weights" in e.value.message


def test_unknown_layer_is_not_found(server):
    with pytest.raises(ServerError) as e:
        RemoteMoE(server=server.target, name="no_such_layer", create=False)
    assert e.value.code == "NOT_FOUND"
    assert "no_such_layer" in e.value.message


def test_bad_config_is_invalid_argument_naming_the_field(server, layer_name):
    with pytest.raises(ServerError) as e:
        make(server.target, layer_name, top_k=E + 1)
    assert e.value.code == "INVALID_ARGUMENT" and "top_k" in e.value.message
    with pytest.raises(ValueError, match="routing"):
        make(server.target, layer_name, routing="sideways")
    with pytest.raises(TypeError, match="dtype"):
        make(server.target, layer_name, dtype=torch.float16)


def test_sharded_server_routing_is_refused(shard_servers, layer_name):
    with pytest.raises(ServerError) as e:
        RemoteMoE(servers=[s.target for s in shard_servers], name=layer_name, num_experts=E,
                  top_k=K, d_model=D, d_hidden=H, routing="server")
    assert e.value.code == "INVALID_ARGUMENT" and "routing" in e.value.message


def test_unreachable_server_is_unavailable():
    with pytest.raises(ServerError) as e:
        RemoteMoE(server="127.0.0.1:1", name="x", num_experts=E, top_k=K, d_model=D,
                  d_hidden=H, timeout=0.5)
    assert e.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_dtypes_the_wire_cannot_carry_are_refused_locally(server, layer_name):
    layer = make(server.target, layer_name)
    ids, w = routing(3)
    with pytest.raises(TypeError, match="x: dtype torch.float64"):
        layer(torch.randn(3, D, dtype=torch.float64), ids, w)
    with pytest.raises(TypeError, match="expert_ids"):
        layer(torch.randn(3, D), ids.float(), w)
    with pytest.raises(ValueError, match="int32 range"):
        layer(torch.randn(3, D), ids + (1 << 32), w)


def test_routing_arguments_must_match_the_mode(server, layer_name):
    client = make(server.target, layer_name)
    with pytest.raises(ValueError, match="layer\\(x, expert_ids, weights\\)"):
        client(torch.randn(3, D))
    routed = make(server.target, layer_name + "_s", routing="server")
    ids, w = routing(3)
    with pytest.raises(ValueError, match="layer\\(x\\)"):
        routed(torch.randn(3, D), ids, w)


def test_a_second_backward_is_refused(server, layer_name):
    layer = make(server.target, layer_name)
    ids, w = routing(4)
    x = torch.randn(4, D, requires_grad=True)
    out = layer(x, ids, w)
    out.sum().backward(retain_graph=True)
    # The Function path says so itself; the custom op path (torch >= 2.4) gets NOT_FOUND for
    # the consumed context from the server.
    with pytest.raises(RuntimeError, match="already (backpropagated|consumed)"):
        out.sum().backward()


def test_a_non_finite_aux_weight_is_refused_and_keeps_the_context(server, layer_name):
    layer = make(server.target, layer_name, routing="server", aux_loss_coef=0.01)
    x = torch.randn(6, D, requires_grad=True)
    out, aux = layer(x)
    with pytest.raises(ServerError) as e:
        (out.sum() + float("inf") * aux).backward(retain_graph=True)
    assert e.value.code == "INVALID_ARGUMENT" and "aux_loss_grad" in e.value.message
    # Without router losses the aux output may be left out of the loss.
    plain = make(server.target, layer_name + "_plain", routing="server")
    out, _ = plain(x)
    out.sum().backward()
    assert x.grad is not None


def test_a_bad_transport_is_a_value_error_naming_it(server, layer_name):
    with pytest.raises(ValueError, match="transport: 'udp'"):
        make(server.target, layer_name, transport="udp")
    with pytest.raises(ValueError, match="transport"):
        make(server.target, layer_name, transport=None)


def test_a_bad_device_transport_is_a_value_error_naming_it(server, layer_name):
    with pytest.raises(ValueError, match="device_transport: 'ipc'"):
        make(server.target, layer_name, device_transport="ipc")


def test_the_device_transport_option_reaches_the_client_options():
    from moe_offload import _core
    options = _core.ClientOptions()
    assert options.device_transport == "auto"
    options.device_transport = "nccl"
    assert options.device_transport == "nccl"
    with pytest.raises(ValueError, match="device_transport"):
        options.device_transport = "sometimes"


def test_the_transport_says_what_the_connection_took(server, layer_name):
    tcp = make(server.target, layer_name + "_tcp", transport="tcp")
    assert tcp.transport["host"] == "tcp" and tcp.transport["reason"] == "requested"
    # The server is on loopback: "auto" and "shm" take shared memory.
    auto = make(server.target, layer_name + "_auto")
    assert auto.transport["host"] == "shm", auto.transport
    assert "this host" in auto.transport["reason"]
    shm = make(server.target, layer_name + "_shm", transport="shm")
    assert shm.transport["host"] == "shm" and shm.transport["reason"] == "requested"
    with pytest.raises(AttributeError):
        shm.transport = "tcp"
    # A client without CUDA has no device transport; with CUDA, "auto" decides at the first
    # CUDA call and "tcp" stages through host memory.
    device = {tcp.transport["device"], auto.transport["device"], shm.transport["device"]}
    assert device <= {"unavailable", "undecided", "staged", "cuda ipc"}
    if "unavailable" not in device:
        assert tcp.transport["device"] == "staged"
        assert auto.transport["device"] == "undecided"
    ids, w = routing(3)
    for layer in (tcp, auto, shm):
        x = torch.randn(3, D)
        assert torch.equal(layer(x, ids, w), tcp(x, ids, w))


def test_bad_state_is_refused_and_changes_nothing(server, layer_name):
    layer = make(server.target, layer_name)
    sd = layer.state_dict()
    bad = dict(sd, w2=torch.zeros(E, D, H + 1))
    bad["w1"] = torch.zeros_like(sd["w1"])
    with pytest.raises(ServerError) as e:
        layer.load_state_dict(bad)
    assert e.value.code == "INVALID_ARGUMENT" and 'state["w2"]' in e.value.message
    assert torch.equal(layer.state_dict()["w1"], sd["w1"])
    with pytest.raises(ValueError, match="weights"):
        layer.load_optimizer_state_dict({"w1": sd["w1"]})


def test_missing_checkpoint_is_an_error(server, layer_name):
    layer = make(server.target, layer_name)
    with pytest.raises(ServerError) as e:
        layer.load("nowhere/none.safetensors")
    assert e.value.code in ("NOT_FOUND", "INVALID_ARGUMENT", "FAILED_PRECONDITION")
    assert "none.safetensors" in e.value.message


def test_server_error_pickles():
    e = pickle.loads(pickle.dumps(ServerError("NOT_FOUND", "layer x")))
    assert (e.code, e.message, str(e)) == ("NOT_FOUND", "layer x", "NOT_FOUND: layer x")
