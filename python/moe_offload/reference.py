"""TorchMoE: the layer contract (engine/layer.h, docs/CONTRACT.md) in plain PyTorch, in process.

The same layer as RemoteMoE, computed by autograd on local parameters: what the tests check
the server against and what examples/torch_train.py trains beside it. Its parameters carry the
server's state names and shapes (w1, w3 [E, h, d], w2 [E, d, h], router [d, E]), so
``TorchMoE.load_state_dict(remote.state_dict())`` starts both from the same weights, and
``torch.optim.AdamW`` / ``torch.optim.SGD`` with ``torch.nn.utils.clip_grad_norm_`` is the
contract's optimizer. float32 math; a bf16 RemoteMoE rounds at points this module does not.
"""

from typing import Optional

import torch
import torch.nn.functional as F

_ACTIVATIONS = {
    "swiglu": F.silu,
    "silu": F.silu,
    "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
    "relu": F.relu,
}


class TorchMoE(torch.nn.Module):
    """forward(x, expert_ids, weights) -> out (client routing); forward(x) -> (out, aux)
    (server routing), exactly as RemoteMoE."""

    def __init__(self, num_experts: int, top_k: int, d_model: int, d_hidden: int,
                 routing: str = "client", activation: str = "swiglu", renormalize: bool = True,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation: {activation!r} is not one of {sorted(_ACTIVATIONS)}")
        if routing not in ("client", "server"):
            raise ValueError(f"routing: {routing!r} is not 'client' or 'server'")
        e, d, h = num_experts, d_model, d_hidden
        self.num_experts, self.top_k, self.routing = num_experts, top_k, routing
        self.activation = activation
        self.renormalize = renormalize
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        # Placeholder values: load the server's (or any) state with load_state_dict.
        self.w1 = torch.nn.Parameter(torch.randn(e, h, d) / d ** 0.5)
        if activation == "swiglu":
            self.w3 = torch.nn.Parameter(torch.randn(e, h, d) / d ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(e, d, h) / h ** 0.5)
        if routing == "server":
            self.router = torch.nn.Parameter(torch.randn(d, e) / d ** 0.5)

    @classmethod
    def like(cls, remote) -> "TorchMoE":
        """A TorchMoE with a RemoteMoE's configuration and current weights."""
        ref = cls(remote.num_experts, remote.top_k, remote.d_model, remote.d_hidden,
                  routing=remote.routing, activation=remote.activation,
                  renormalize=remote.renormalize,
                  aux_loss_coef=remote.aux_loss_coef, z_loss_coef=remote.z_loss_coef)
        ref.load_state_dict({k: v.float() for k, v in remote.state_dict().items()})
        return ref

    def experts(self, x: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """out[t] = sum_k weights[t, k] * y_{expert_ids[t, k]}(x[t])."""
        act = _ACTIVATIONS[self.activation]
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, ks = (expert_ids == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            a = act(xe @ self.w1[e].t())
            if self.activation == "swiglu":
                a = a * (xe @ self.w3[e].t())
            y = a @ self.w2[e].t()
            out = out.index_add(0, rows, y * weights[rows, ks].unsqueeze(1))
        return out

    def route(self, x: torch.Tensor):
        """Server routing: (expert_ids, weights, aux + z) from the router."""
        logits = x.float() @ self.router.float()
        s = torch.softmax(logits, dim=-1)
        top_s, ids = s.topk(self.top_k, dim=-1)
        p = top_s / top_s.sum(-1, keepdim=True) if self.renormalize else top_s
        t, e = logits.shape
        aux = logits.new_zeros(())
        if self.aux_loss_coef:
            f = torch.bincount(ids.flatten(), minlength=e).float() / (t * self.top_k)
            aux = aux + self.aux_loss_coef * e * (f * s.mean(0)).sum()
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * (torch.logsumexp(logits, -1) ** 2).mean()
        return ids, p, aux

    def forward(self, x: torch.Tensor, expert_ids: Optional[torch.Tensor] = None,
                weights: Optional[torch.Tensor] = None):
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if self.routing == "client":
            out = self.experts(x, expert_ids.reshape(-1, self.top_k),
                               weights.reshape(-1, self.top_k).float())
            return out.reshape(*lead, -1)
        ids, p, aux = self.route(x)
        return self.experts(x, ids, p).reshape(*lead, -1), aux
