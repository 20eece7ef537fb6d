"""RemoteMoE's forward and backward as autograd operations.

A training forward leaves its context (what the server keeps for the backward) on the server
under a context id; the id lives in the autograd graph (the Function's ctx, or a tensor the
custom op returns), so any number of forwards may be outstanding before their backwards run, in
any order. Each backward consumes its context.

Two implementations of the same operation:
  * ``torch.autograd.Function`` (every torch, Debian's 1.13 included): used in eager mode.
  * ``torch.library.custom_op`` with ``register_fake`` and ``register_autograd`` (torch >= 2.4):
    what torch.compile traces; the fake implementation gives output shapes without a server.

With server routing the forward also returns ``aux``, the router's load-balancing and z losses
(already times their coefficients). Its incoming gradient ``grad_aux`` (d loss / d aux: 0.3 for
``loss = task + 0.3 * aux``, none when aux is not in the loss) goes to the server with the
backward (BackwardRequest.aux_loss_grad), which adds the aux terms' gradient times it. It is a
number the request carries, so a CUDA ``grad_aux`` is read on the host, which waits for the
stream; only a layer with a non-zero coefficient reads it (otherwise the aux terms have no
gradient to scale).
"""

import itertools
import weakref
from typing import Optional, Tuple

import torch

# Layers the custom ops can name: handle -> RemoteMoE (weakly held).
_LAYERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(layer) -> int:
    handle = next(_HANDLES)
    _LAYERS[handle] = layer
    return handle


def _layer(handle: int):
    layer = _LAYERS.get(handle)
    if layer is None:
        raise RuntimeError(f"moe_offload: RemoteMoE handle {handle} no longer exists")
    return layer


def aux_loss_grad(layer, grad_aux) -> float:
    """d loss / d aux for the server: 0 when aux is not in the loss (``grad_aux`` None), 1 (the
    value that changes nothing) when the layer has no aux terms."""
    if layer.aux_loss_coef == 0 and layer.z_loss_coef == 0:
        return 1.0
    return 0.0 if grad_aux is None else float(grad_aux)


def _zeros_if_none(grad, like_shape, dtype, device):
    return torch.zeros(like_shape, dtype=dtype, device=device) if grad is None else grad


class ClientRouted(torch.autograd.Function):
    """out = layer(x, expert_ids, weights); gradients for x and weights."""

    @staticmethod
    def forward(ctx, layer, training, x, expert_ids, weights):
        out, context_id, _ = layer._run_forward(x, expert_ids, weights, training)
        ctx.layer = layer
        ctx.context_id = context_id
        ctx.weights_dtype = weights.dtype
        ctx.out_meta = (out.shape, out.dtype, out.device)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        context_id = _take_context(ctx)
        grad_out = _zeros_if_none(grad_out, *ctx.out_meta)
        dx, dweights = ctx.layer._run_backward(context_id, grad_out)
        return None, None, dx, None, dweights.to(ctx.weights_dtype)


class ServerRouted(torch.autograd.Function):
    """(out, aux) = layer(x); the gradient for x includes the path through the router."""

    @staticmethod
    def forward(ctx, layer, training, x):
        out, context_id, aux = layer._run_forward(x, None, None, training)
        ctx.layer = layer
        ctx.context_id = context_id
        ctx.out_meta = (out.shape, out.dtype, out.device)
        ctx.set_materialize_grads(False)
        return out, aux

    @staticmethod
    def backward(ctx, grad_out, grad_aux):
        weight = aux_loss_grad(ctx.layer, grad_aux)
        context_id = _take_context(ctx)
        grad_out = _zeros_if_none(grad_out, *ctx.out_meta)
        dx, _ = ctx.layer._run_backward(context_id, grad_out, weight)
        return None, None, dx


def _take_context(ctx) -> int:
    context_id = ctx.context_id
    if context_id is None:
        raise RuntimeError(
            "moe_offload: this RemoteMoE forward was already backpropagated; its context on the "
            "server is consumed by the first backward, so it cannot be backpropagated twice "
            "(retain_graph does not keep it)")
    ctx.context_id = None
    return context_id


# The context id (uint64) as a one-element int64 tensor, bits unchanged.
def _id_to_tensor(context_id: int) -> torch.Tensor:
    signed = context_id - (1 << 64) if context_id >= (1 << 63) else context_id
    return torch.tensor([signed], dtype=torch.int64)


def _id_from_tensor(t: torch.Tensor) -> int:
    return int(t.item()) & ((1 << 64) - 1)


HAVE_CUSTOM_OP = all(
    hasattr(torch.library, f) for f in ("custom_op", "register_fake", "register_autograd"))

if HAVE_CUSTOM_OP:

    @torch.library.custom_op("moe_offload::forward", mutates_args=())
    def forward_op(x: torch.Tensor, expert_ids: Optional[torch.Tensor],
                   weights: Optional[torch.Tensor], handle: int,
                   training: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, context_id, aux = _layer(handle)._run_forward(x, expert_ids, weights, training)
        return out, aux, _id_to_tensor(context_id)

    @forward_op.register_fake
    def _(x, expert_ids, weights, handle, training):
        return (torch.empty_like(x), x.new_empty((), dtype=torch.float32),
                torch.empty((1,), dtype=torch.int64, device="cpu"))

    @torch.library.custom_op("moe_offload::backward", mutates_args=())
    def backward_op(grad_out: torch.Tensor, context: torch.Tensor,
                    weights: Optional[torch.Tensor], handle: int,
                    grad_aux: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        # grad_aux is read here, in the op, so that a traced backward never needs its value.
        layer = _layer(handle)
        weight = 1.0 if weights is not None else aux_loss_grad(layer, grad_aux)
        dx, dweights = layer._run_backward(_id_from_tensor(context), grad_out, weight)
        if weights is None:
            return dx, grad_out.new_empty((0,), dtype=torch.float32)
        return dx, dweights.to(weights.dtype)

    @backward_op.register_fake
    def _(grad_out, context, weights, handle, grad_aux):
        if weights is None:
            return torch.empty_like(grad_out), grad_out.new_empty((0,), dtype=torch.float32)
        return torch.empty_like(grad_out), torch.empty_like(weights)

    def _setup_context(ctx, inputs, output):
        x, _, weights, handle, _ = inputs
        out, _, context = output
        ctx.save_for_backward(context, weights)
        ctx.handle = handle
        ctx.has_weights = weights is not None
        ctx.out_meta = (out.shape, out.dtype, out.device)

    def _backward(ctx, grad_out, grad_aux, grad_context):
        context, weights = ctx.saved_tensors
        grad_out = _zeros_if_none(grad_out, *ctx.out_meta)
        dx, dweights = backward_op(grad_out.contiguous(), context,
                                   weights if ctx.has_weights else None, ctx.handle,
                                   None if ctx.has_weights else grad_aux)
        return dx, None, (dweights if ctx.has_weights else None), None, None

    forward_op.register_autograd(_backward, setup_context=_setup_context)
