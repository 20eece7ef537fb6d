"""moe_offload: PyTorch MoE layers whose experts run on moe-server.

    import moe_offload
    layer = moe_offload.RemoteMoE(server="localhost:50051", name="moe0", num_experts=8,
                                  top_k=2, d_model=1024, d_hidden=4096, routing="client")
    out = layer(x, expert_ids, weights)
    (out * g).sum().backward()
    layer.step()

See python/README.md; the C++ client it binds is client/client.h.
"""

from ._errors import ServerError
from ._layer import RemoteMoE, shard_path
from .reference import TorchMoE

__all__ = ["RemoteMoE", "ServerError", "TorchMoE", "shard_path"]
__version__ = "0.1.0"
