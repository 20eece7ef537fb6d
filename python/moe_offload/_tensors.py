"""torch tensors to and from moe_offload._core.

A tensor crosses as (data_ptr, nbytes, shape, dtype code, device) of a contiguous tensor, device
-1 for host memory and N for cuda:N, which the C++ client reads (or, as a destination, writes)
in place; a host result arrives as a HostBuffer owning the client's result, which
torch.frombuffer wraps without copying.

CUDA tensors go to the client as they are (``device_input``, ``device_output``) when its build
has CUDA: it moves them by CUDA IPC or stages them itself, ordered on the caller's stream. A
client built without CUDA gets them through host memory instead (``stage_on_host`` /
``unstage``).
"""

import torch

from . import _core

_TO_CORE = {
    torch.float32: _core.DTYPE_FLOAT32,
    torch.bfloat16: _core.DTYPE_BFLOAT16,
    torch.int32: _core.DTYPE_INT32,
    torch.int64: _core.DTYPE_INT64,
}
_FROM_CORE = {code: dtype for dtype, code in _TO_CORE.items()}

# The layer dtypes moe-server stores (LayerConfig.dtype).
LAYER_DTYPES = (torch.float32, torch.bfloat16)


def core_dtype(dtype: torch.dtype, field: str) -> int:
    try:
        return _TO_CORE[dtype]
    except KeyError:
        raise TypeError(
            f"{field}: dtype {dtype} is not one moe-server carries "
            "(float32, bfloat16, int32, int64)") from None


def torch_dtype(code: int) -> torch.dtype:
    return _FROM_CORE[code]


def stage_on_host(t: torch.Tensor) -> torch.Tensor:
    """The host tensor the client sends for ``t``: ``t`` itself on the CPU, else a copy (a
    client built without CUDA takes host tensors only; results come back in ``unstage``)."""
    if t.device.type == "cpu":
        return t
    return t.to("cpu")


def unstage(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host result moved to the device its inputs came from (see ``stage_on_host``)."""
    return t if device.type == "cpu" else t.to(device)


def host_spec(t: torch.Tensor, field: str):
    """(keep-alive tensor, spec) for a tensor sent to _core: the spec points into the contiguous
    host tensor returned beside it, which the caller must hold until the call returns."""
    code = core_dtype(t.dtype, field)
    t = stage_on_host(t.detach()).contiguous()
    return t, spec(t, code)


def spec(t: torch.Tensor, code: int):
    """_core's description of a contiguous tensor ``t`` whose dtype code is ``code``."""
    device = t.device.index if t.device.type == "cuda" else -1
    return (t.data_ptr(), t.numel() * t.element_size(), list(t.shape), code, device)


# CUDA IPC names a tensor by its offset in its allocation, which must be a multiple of this
# (client/client.h, ForwardInto); the caching allocator's blocks start at 512-byte multiples.
_DEVICE_ALIGNMENT = 16


def device_input(t: torch.Tensor, field: str, stream: "torch.cuda.Stream"):
    """(tensor, spec) for a CUDA tensor the client reads on ``stream``: contiguous and aligned
    (a copy otherwise), and recorded on ``stream`` so that its memory is not handed to other
    work before the stream has passed the server's read (see README, "CUDA tensors")."""
    code = core_dtype(t.dtype, field)
    t = t.detach().contiguous()
    if t.data_ptr() % _DEVICE_ALIGNMENT:
        t = t.clone()
    t.record_stream(stream)
    return t, spec(t, code)


def device_output(t: torch.Tensor, stream: "torch.cuda.Stream"):
    """The spec of a fresh CUDA destination the client writes on ``stream``."""
    t.record_stream(stream)
    return spec(t, _TO_CORE[t.dtype])


def from_core(out) -> torch.Tensor:
    """A tensor over the bytes of a _core result (HostBuffer, shape, dtype code), not copied."""
    buffer, shape, code = out
    dtype = torch_dtype(code)
    if buffer.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
