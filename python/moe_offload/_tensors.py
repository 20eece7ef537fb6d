"""torch tensors to and from moe_offload._core's host tensors.

An input crosses as (data_ptr, nbytes, shape, dtype code) of a contiguous CPU tensor, which the
C++ client reads in place; an output arrives as a HostBuffer owning the client's result, which
torch.frombuffer wraps without copying. CUDA tensors take one detour through host memory, in
``stage_on_host`` and ``unstage``: the only two places a device tensor is copied, so that a
co-located GPU data plane can replace exactly these.
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
    """The host tensor the client sends for ``t``: ``t`` itself on the CPU, else a copy.

    A CUDA tensor is copied to host memory here (and its results back in ``unstage``), until
    a data plane that moves device memory without the host takes over.
    """
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
    return t, (t.data_ptr(), t.numel() * t.element_size(), list(t.shape), code)


def from_core(out) -> torch.Tensor:
    """A tensor over the bytes of a _core result (HostBuffer, shape, dtype code), not copied."""
    buffer, shape, code = out
    dtype = torch_dtype(code)
    if buffer.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
