"""RemoteMoE: a torch.nn.Module whose MoE layer (experts, router, gradients, optimizer state)
lives on one moe-server, or is sharded by experts over several.

The module holds no parameters: the weights stay on the server, which accumulates their
gradients over every backward and applies the layer's own optimizer on ``step()``. Everything a
trainer does with a module's weights goes through the server: ``state_dict`` /
``load_state_dict`` export and import them, ``optimizer_state_dict`` /
``load_optimizer_state_dict`` the optimizer state, ``save`` / ``load`` write and read
safetensors checkpoints on the server (relative to its --checkpoint_dir).
"""

import os
from typing import Dict, List, Optional, Sequence

import torch

from . import _autograd, _core, _tensors

_ACTIVATIONS = {
    "swiglu": _core.Activation.SWIGLU,
    "silu": _core.Activation.SILU,
    "gelu_tanh": _core.Activation.GELU_TANH,
    "relu": _core.Activation.RELU,
}
_ROUTINGS = {"client": _core.RoutingMode.CLIENT, "server": _core.RoutingMode.SERVER}
_OPTIMIZERS = {"adamw": _core.OptimizerKind.ADAMW, "sgd": _core.OptimizerKind.SGD}
# ClientOptions.transport: how Forward and Backward move their tensors.
_TRANSPORTS = ("auto", "tcp", "shm")
# ClientOptions.device_transport: whether CUDA tensors may travel over an NCCL channel.
_DEVICE_TRANSPORTS = ("auto", "nccl", "never")
# Tensors split by expert over shards (dimension 0), with their optimizer state.
_EXPERT_TENSORS = ("w1", "w3", "w2")


def _choice(table, value, field):
    try:
        return table[value]
    except KeyError:
        raise ValueError(f"{field}: {value!r} is not one of {sorted(table)}") from None


def _name_of(table, value):
    return next(k for k, v in table.items() if v == value)


def shard_path(path: str, shard: int, num_shards: int) -> str:
    """Where shard ``shard`` of a sharded layer's checkpoint ``path`` lives on its server:
    ``run1/moe0.safetensors`` -> ``run1/moe0.shard1-of-2.safetensors``."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.shard{shard}-of-{num_shards}{ext}"


class RemoteMoE(torch.nn.Module):
    """An MoE layer run by moe-server.

    Client routing: ``out = layer(x, expert_ids, weights)`` with x [..., d_model], expert_ids
    [..., top_k] (global expert ids) and weights [..., top_k]; gradients flow to x and weights.
    Server routing: ``out, aux = layer(x)``; the router is part of the layer, and ``aux`` (a
    scalar: load-balancing plus z loss, already times their coefficients) is trained with the
    weight the loss gives it (``loss = task + 0.3 * aux`` trains it with 0.3; left out of the
    loss, not at all).

    CUDA tensors stay on their device: with the server on this host (``transport`` "auto" or
    "shm") the server reads and writes them in place by CUDA IPC, ordered on the current CUDA
    stream; otherwise the client copies them through host memory. ``layer.transport`` says
    which, and why.

    ``create=True`` creates the layer, or attaches to one of that name with an identical
    config; ``create=False`` attaches to an existing one and takes its config from the server
    (the size arguments are then ignored). ``servers=[...]`` shards the experts over several
    servers in contiguous ranges (client routing and float32 only; CUDA tensors are split per
    server and summed on their GPU, each server's share moved as its connection moves device
    tensors); ``server`` is then unused. ``transport``: "auto" (shared
    memory and CUDA IPC when the server is on this host, else TCP), "tcp", or "shm" (fails to
    connect unless the server registers shared memory). ``device_transport``: "auto" (CUDA
    tensors over an NCCL channel, GPU to GPU, when the server is on another host), "nccl" (also
    for a server on another GPU of this host, where it beats CUDA IPC), or "never"; a server
    that cannot open a channel falls back as ``transport`` decides, and ``layer.transport``
    says so.

    Call ``step()`` after the backward passes of a batch (it applies the server's optimizer and
    clears the accumulated gradients) and ``zero_grad()`` to drop gradients without stepping;
    a model's ``zero_grad()`` and a torch optimizer do not reach the server.
    """

    def __init__(self, server: str = "localhost:50051", name: str = "moe0",
                 num_experts: int = 8, top_k: int = 2, d_model: int = 1024,
                 d_hidden: int = 4096, routing: str = "client",
                 dtype: torch.dtype = torch.float32, create: bool = True,
                 optimizer: str = "adamw", lr: float = 1e-3, *,
                 servers: Optional[Sequence[str]] = None, activation: str = "swiglu",
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, max_grad_norm: float = 0.0, seed: int = 0,
                 init_scale: float = 1.0, renormalize: bool = True,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 recompute_h: bool = False, shared_with: Sequence[str] = (),
                 timeout: float = 30.0, token: Optional[str] = None,
                 token_file: Optional[str] = None, tls_ca_file: Optional[str] = None,
                 tls_cert_file: Optional[str] = None, tls_key_file: Optional[str] = None,
                 tls_server_name: Optional[str] = None, connections: Optional[int] = None,
                 chunk_bytes: Optional[int] = None, stripe_bytes: Optional[int] = None,
                 max_receive_bytes: Optional[int] = None, transport: str = "auto",
                 device_transport: str = "auto"):
        super().__init__()
        if dtype not in _tensors.LAYER_DTYPES:
            raise TypeError(f"dtype: {dtype} is not a layer dtype (torch.float32, torch.bfloat16)")
        config = _core.LayerConfig()
        config.num_experts = num_experts
        config.top_k = top_k
        config.d_model = d_model
        config.d_hidden = d_hidden
        config.activation = _choice(_ACTIVATIONS, activation, "activation")
        config.dtype = _tensors.core_dtype(dtype, "dtype")
        config.routing = _choice(_ROUTINGS, routing, "routing")
        config.seed = seed
        config.init_scale = init_scale
        config.renormalize = renormalize
        config.aux_loss_coef = aux_loss_coef
        config.z_loss_coef = z_loss_coef
        config.recompute_h = recompute_h
        opt = config.optimizer
        opt.kind = _choice(_OPTIMIZERS, optimizer, "optimizer")
        opt.learning_rate = lr
        opt.beta1, opt.beta2 = betas
        opt.epsilon = eps
        opt.weight_decay = weight_decay
        opt.momentum = momentum
        opt.max_grad_norm = max_grad_norm
        config.optimizer = opt

        options = _core.ClientOptions()
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport: {transport!r} is not one of {list(_TRANSPORTS)}")
        options.transport = transport
        if device_transport not in _DEVICE_TRANSPORTS:
            raise ValueError(f"device_transport: {device_transport!r} is not one of "
                             f"{list(_DEVICE_TRANSPORTS)}")
        options.device_transport = device_transport
        options.timeout_seconds = timeout
        for field, value in (("connections", connections), ("chunk_bytes", chunk_bytes),
                             ("stripe_bytes", stripe_bytes),
                             ("max_receive_bytes", max_receive_bytes)):
            if value is not None:
                setattr(options, field, value)
        if token_file is not None:
            token = _core.read_token_file(token_file)
        if token is not None:
            options.token = token
        if any(v is not None for v in (tls_ca_file, tls_cert_file, tls_key_file,
                                       tls_server_name)):
            options.set_tls(tls_ca_file or "", tls_cert_file or "", tls_key_file or "",
                            tls_server_name or "")

        targets = list(servers) if servers is not None else [server]
        self._core = _core.CoreLayer.open(targets, len(targets) > 1, name, config, create,
                                          options, list(shared_with))
        self.name = name
        self.servers = targets
        c = self._core.config
        self.num_experts = c.num_experts
        self.top_k = c.top_k
        self.d_model = c.d_model
        self.d_hidden = c.d_hidden
        self.activation = _name_of(_ACTIVATIONS, c.activation)
        self.routing = _name_of(_ROUTINGS, c.routing)
        self.dtype = _tensors.torch_dtype(c.dtype)
        self.aux_loss_coef = c.aux_loss_coef
        self.z_loss_coef = c.z_loss_coef
        self.renormalize = bool(c.renormalize)
        # CUDA tensors go to the client as they are in a client built with CUDA (a sharded
        # layer splits and sums them on their GPU).
        self._device_calls = self._core.transport(0)["device"] != "unavailable"
        self._handle = _autograd.register(self)

    @property
    def transport(self) -> Dict[str, str]:
        """How the layer's connection moves tensors: {"host": "tcp" | "shm", "reason": why,
        "device": "cuda ipc" | "staged" | "undecided" (until the first CUDA call of "auto") |
        "unavailable" (a client built without CUDA: Python stages CUDA tensors)}. A sharded
        layer reports its first server's connection."""
        return self._core.transport(0)

    def release_idle_device_regions(self) -> None:
        """Unregisters the CUDA allocations the server has mapped that no call uses. The
        connection keeps them mapped for reuse; call this after freeing device memory for good
        (``torch.cuda.empty_cache()``), so the server lets go of it too."""
        self._core.release_idle_device_regions()

    def extra_repr(self) -> str:
        where = self.servers[0] if len(self.servers) == 1 else self.servers
        return (f"name={self.name!r}, server={where!r}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, d_model={self.d_model}, d_hidden={self.d_hidden}, "
                f"routing={self.routing!r}, dtype={self.dtype}")

    # Forward ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, expert_ids: Optional[torch.Tensor] = None,
                weights: Optional[torch.Tensor] = None):
        client = self.routing == "client"
        if client and (expert_ids is None or weights is None):
            raise ValueError(f"RemoteMoE '{self.name}' routes on the client: "
                             "call layer(x, expert_ids, weights)")
        if not client and (expert_ids is not None or weights is not None):
            raise ValueError(f"RemoteMoE '{self.name}' routes on the server: call layer(x)")
        lead = x.shape[:-1]
        if x.dim() > 2:  # [..., d] -> [T, d]; the last dimension goes to the server as it is
            x = x.reshape(-1, x.shape[-1])
            if client:
                expert_ids = expert_ids.reshape(-1, expert_ids.shape[-1])
                weights = weights.reshape(-1, weights.shape[-1])
        training = torch.is_grad_enabled()
        if training and not x.requires_grad and not (client and weights.requires_grad):
            # The server's weights need their gradients even when no input does: make the
            # output part of the graph so that its backward runs.
            x = x.detach().requires_grad_()
        if client:
            if _autograd.HAVE_CUSTOM_OP:
                out, _, _ = _autograd.forward_op(x, expert_ids, weights, self._handle, training)
            else:
                out = _autograd.ClientRouted.apply(self, training, x, expert_ids, weights)
            return out.reshape(*lead, out.shape[-1]) if len(lead) > 1 else out
        if _autograd.HAVE_CUSTOM_OP:
            out, aux, _ = _autograd.forward_op(x, None, None, self._handle, training)
        else:
            out, aux = _autograd.ServerRouted.apply(self, training, x)
        return (out.reshape(*lead, out.shape[-1]) if len(lead) > 1 else out), aux

    def _on_device(self, t: torch.Tensor) -> bool:
        """Whether the client takes ``t`` where it is (a CUDA tensor, a client built with
        CUDA, one server); else it goes through host memory."""
        return self._device_calls and t.device.type == "cuda"

    def _run_forward(self, x, expert_ids, weights, training):
        """One Forward call: (out, context id or 0, aux + z as a 0-d float32 tensor)."""
        if self._on_device(x):
            return self._run_forward_device(x, expert_ids, weights, training)
        device = x.device
        x_host, x_spec = _tensors.host_spec(x, "x")
        ids_host = ids_spec = w_host = w_spec = None
        if expert_ids is not None:
            ids_host, ids_spec = _tensors.host_spec(self._wire_ids(expert_ids), "expert_ids")
        if weights is not None:
            w_host, w_spec = _tensors.host_spec(self._wire_weights(weights), "weights")
        context_id, out, _, _, aux_loss, z_loss = self._core.forward(x_spec, ids_spec, w_spec,
                                                                     training)
        del x_host, ids_host, w_host
        out = _tensors.unstage(_tensors.from_core(out), device)
        aux = torch.full((), aux_loss + z_loss, dtype=torch.float32, device=device)
        return out, context_id, aux

    def _run_forward_device(self, x, expert_ids, weights, training):
        """_run_forward for CUDA tensors: out is written in place on x's device, ordered on the
        current stream; nothing waits for the GPU."""
        device = x.device
        stream = torch.cuda.current_stream(device)
        # Every tensor a spec points into (x's, ids' and weights' converted copies among them) is
        # held until the call returns: freed before, its memory could go to `out` meanwhile.
        # Once it returns, the stream is ordered after the server's reads and writes, so they
        # may go (see README, "CUDA tensors").
        x, x_spec = _tensors.device_input(x, "x", stream)
        ids = ids_spec = w = w_spec = None
        if expert_ids is not None:
            ids, ids_spec = _tensors.device_input(
                self._wire_ids(expert_ids.to(device)), "expert_ids", stream)
        if weights is not None:
            w, w_spec = _tensors.device_input(self._wire_weights(weights.to(device)), "weights",
                                              stream)
        out = torch.empty_like(x)
        context_id, aux_loss, z_loss = self._core.forward_into(
            x_spec, ids_spec, w_spec, _tensors.device_output(out, stream), stream.cuda_stream,
            training)
        del x, ids, w
        # A fill kernel with the value as its argument: no copy, so no wait for the stream.
        aux = torch.full((), aux_loss + z_loss, dtype=torch.float32, device=device)
        return out, context_id, aux

    def _run_backward(self, context_id: int, grad_out: torch.Tensor, aux_loss_grad: float = 1.0):
        """One Backward call: (dx, dweights as float32; no elements with server routing).
        ``aux_loss_grad``: d loss / d aux (server routing)."""
        if self._on_device(grad_out):
            return self._run_backward_device(context_id, grad_out, aux_loss_grad)
        device = grad_out.device
        g_host, g_spec = _tensors.host_spec(grad_out, "dout")
        dx, dweights = self._core.backward(context_id, g_spec, aux_loss_grad)
        del g_host
        return (_tensors.unstage(_tensors.from_core(dx), device),
                _tensors.unstage(_tensors.from_core(dweights), device))

    def _run_backward_device(self, context_id, grad_out, aux_loss_grad):
        """_run_backward for a CUDA grad_out: dx (and dweights) written in place on its device,
        ordered on the current stream."""
        device = grad_out.device
        stream = torch.cuda.current_stream(device)
        dout, dout_spec = _tensors.device_input(grad_out, "dout", stream)
        dx = torch.empty_like(dout)
        if self.routing == "client":
            dweights = torch.empty((dout.shape[0], self.top_k), dtype=torch.float32,
                                   device=device)
            dw_spec = _tensors.device_output(dweights, stream)
        else:
            dweights = torch.empty((0,), dtype=torch.float32, device=device)
            dw_spec = None
        self._core.backward_into(context_id, dout_spec, _tensors.device_output(dx, stream),
                                 dw_spec, stream.cuda_stream, aux_loss_grad)
        return dx, dweights

    @staticmethod
    def _wire_ids(ids: torch.Tensor) -> torch.Tensor:
        """expert_ids as int32 (what the server takes), refusing values int32 cannot hold
        rather than wrapping them into valid-looking ids. On a device they are not read on the
        host (that would wait for the stream): such values become -1 or 2^31 - 1, ids the server
        refuses as out of range."""
        if ids.dtype == torch.int32:
            return ids
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"expert_ids: dtype {ids.dtype}, must be an integer dtype")
        if ids.device.type != "cpu":
            return ids.clamp(-1, (1 << 31) - 1).to(torch.int32)
        if ids.numel() and (int(ids.min()) < -(1 << 31) or int(ids.max()) >= (1 << 31)):
            raise ValueError("expert_ids: values outside the int32 range")
        return ids.to(torch.int32)

    def _wire_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """Routing weights go as float32 or the layer dtype (the server takes either)."""
        if weights.dtype in (torch.float32, self.dtype):
            return weights
        if not weights.dtype.is_floating_point:
            raise TypeError(f"weights: dtype {weights.dtype}, must be a floating dtype")
        return weights.to(torch.float32)

    # Optimizer ----------------------------------------------------------------------------

    def step(self) -> Dict:
        """Applies the layer's optimizer to the gradients accumulated since the last step (or
        zero_grad) and clears them. Returns {"step", "grad_norm", "tokens_per_expert"}."""
        return self._core.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the server's accumulated gradients without stepping."""
        super().zero_grad(set_to_none=set_to_none)
        for i in range(self._core.num_shards):
            self._core.zero_grad(i)

    # State --------------------------------------------------------------------------------

    def _weight_names(self) -> List[str]:
        names = ["w1", "w3", "w2"] if self.activation == "swiglu" else ["w1", "w2"]
        return names + (["router"] if self.routing == "server" else [])

    def _export(self, include_optimizer: bool) -> Dict[str, torch.Tensor]:
        """The layer's state by name, shards' expert tensors concatenated along experts."""
        parts = [{k: _tensors.from_core(v)
                  for k, v in self._core.export_state(i, include_optimizer).items()}
                 for i in range(self._core.num_shards)]
        if len(parts) == 1:
            return parts[0]
        return {name: (torch.cat([p[name] for p in parts]) if _is_expert_tensor(name)
                       else parts[0][name])
                for name in parts[0]}

    def _import(self, state: Dict[str, torch.Tensor]) -> None:
        n = self._core.num_shards
        for i in range(n):
            c = self._core.shard_config(i)
            first, count = c.expert_first, c.local_experts()
            keep = []  # host copies the specs point into, held until the call returns
            specs = {}
            for name, t in state.items():
                if n > 1 and _is_expert_tensor(name):
                    t = t[first:first + count]
                host, specs[name] = _tensors.host_spec(t, f'state["{name}"]')
                keep.append(host)
            self._core.import_state(i, specs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, t in self._export(include_optimizer=False).items():
            destination[prefix + name] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        expected = self._weight_names()
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        missing = [prefix + n for n in expected if n not in mine]
        unexpected = [prefix + n for n in mine if n not in expected]
        missing_keys.extend(missing)
        unexpected_keys.extend(unexpected)
        # As torch's own modules: the names present are loaded, and load_state_dict(strict=True)
        # raises afterwards for the missing and unexpected ones (it passes strict=True here
        # whatever the caller asked).
        self._import({n: mine[n] for n in expected if n in mine})

    def optimizer_state_dict(self) -> Dict[str, torch.Tensor]:
        """The server-side optimizer state: "<weight>.exp_avg", "<weight>.exp_avg_sq" (AdamW)
        or "<weight>.momentum" (SGD), "<weight>.master" (bf16 layers), and "step"."""
        weights = set(self._weight_names())
        return {k: v for k, v in self._export(include_optimizer=True).items()
                if k not in weights}

    def load_optimizer_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        weights = set(self._weight_names())
        bad = sorted(k for k in state if k in weights)
        if bad:
            raise ValueError(f"load_optimizer_state_dict: {bad} are weights (load_state_dict)")
        self._import(dict(state))

    # Checkpoints --------------------------------------------------------------------------

    def save(self, path: str) -> List[Dict]:
        """Writes a safetensors checkpoint (weights, optimizer state, step, config) on the
        server, relative to its --checkpoint_dir; a sharded layer writes one per shard on its
        own server (``shard_path``). Returns each file's {"path", "bytes", "step"}."""
        n = self._core.num_shards
        return [self._core.save(i, path if n == 1 else shard_path(path, i, n)) for i in range(n)]

    def load(self, path: str) -> None:
        """Reads a checkpoint ``save`` wrote (same path) into this layer."""
        n = self._core.num_shards
        for i in range(n):
            self._core.load(i, path if n == 1 else shard_path(path, i, n))


def _is_expert_tensor(name: str) -> bool:
    return name.split(".", 1)[0] in _EXPERT_TENSORS
