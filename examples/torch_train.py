#!/usr/bin/env python3
"""A small MoE transformer trained through moe-server, beside the same model run in process.

The model (token and position embeddings, causal self-attention, a router, LayerNorms and the
output head in PyTorch; the MoE feed-forward of each block a moe_offload.RemoteMoE on
moe-server) learns generated sequences: each token follows the previous one through a fixed
random transition table with a few likely successors, so the loss falls from ln(vocab) towards
the table's entropy. A twin model with moe_offload.TorchMoE (the layer contract in plain
PyTorch) starts from the same weights (the server's initial expert weights, exported with
state_dict) and trains on the same batches with the same AdamW settings, the server's optimizer
standing in for torch's on the remote side.

Both run in float32 on the CPU, where they differ only in the order of floating-point sums, so
their loss curves must agree: the script checks |loss_remote - loss_local| <= TOLERANCE *
loss_local at every step (--tolerance, default 2e-2) and exits with status 1 if not, or if the
loss did not fall. Measured with the defaults: the difference stays near 1e-6 for the first
tens of steps, then grows to a few 1e-3 as the two runs' rounding differences compound through
the routers' top-K choices (which may flip on a near-tie), while a learning rate 20% off on the
server's side alone shows as 3-5% within 20 steps. It prints loss and tokens/s as it goes (a
progress bar on a terminal) and writes the two curves to a PNG when matplotlib is installed.

    python examples/torch_train.py                       # starts its own moe-server (CPU)
    python examples/torch_train.py --server localhost:50051 --steps 500
"""

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

import moe_offload
from moe_offload.local_server import LocalServer


class Block(torch.nn.Module):
    def __init__(self, d_model, heads, moe, num_experts, top_k):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.attn = torch.nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.router = torch.nn.Linear(d_model, num_experts, bias=False)
        self.moe = moe
        self.top_k = top_k

    def forward(self, x, causal_mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        h = self.ln2(x)
        probs = torch.softmax(self.router(h), dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + self.moe(h, expert_ids, weights)


class MoETransformer(torch.nn.Module):
    def __init__(self, vocab, seq_len, d_model, heads, moes, num_experts, top_k):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = torch.nn.ModuleList(
            Block(d_model, heads, moe, num_experts, top_k) for moe in moes)
        self.ln = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)
        mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, self.causal_mask[: tokens.shape[1], : tokens.shape[1]])
        return self.head(self.ln(x))


def transition_table(vocab, successors, generator):
    """Each token's next-token distribution: `successors` likely tokens, the rest rare."""
    logits = torch.full((vocab, vocab), -4.0)
    for t in range(vocab):
        picks = torch.randperm(vocab, generator=generator)[:successors]
        logits[t, picks] = torch.randn(successors, generator=generator) + 2.0
    return torch.softmax(logits, dim=-1)


def sample_batch(table, batch, seq_len, generator):
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(table.shape[0], (batch,), generator=generator)
    for i in range(seq_len):
        tokens[:, i + 1] = torch.multinomial(table[tokens[:, i]], 1, generator=generator)[:, 0]
    return tokens[:, :-1], tokens[:, 1:]


def entropy_rate(table):
    """The loss a perfect model reaches: the table's mean next-token entropy (stationary)."""
    pi = torch.full((table.shape[0],), 1.0 / table.shape[0])
    for _ in range(200):
        pi = pi @ table
    return float(-(pi[:, None] * table * table.clamp_min(1e-12).log()).sum())


def progress(steps):
    """A tqdm progress bar on a terminal; None (a line every few steps) otherwise."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(range(steps), unit="step", dynamic_ncols=True)


def plot(path, remote_losses, local_losses, floor):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("torch_train: matplotlib is not installed (apt-get install python3-matplotlib); "
              "no loss-curve PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(remote_losses, label="RemoteMoE (moe-server)")
    ax.plot(local_losses, "--", label="TorchMoE (in process)")
    ax.axhline(floor, color="grey", linewidth=0.8, label="entropy of the data")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title("MoE transformer: experts on moe-server vs in process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"torch_train: loss curves written to {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", help="HOST:PORT of a running moe-server (default: start one)")
    p.add_argument("--moe-server", help="moe-server binary to start (default: "
                   "$MOE_SERVER_BIN or build/server/moe-server)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--d-hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=2e-2,
                   help="largest |remote - local| / local loss allowed at any step")
    p.add_argument("--plot", default="torch_train_loss.png", help="PNG of the loss curves")
    args = p.parse_args()

    server = None
    target = args.server
    if target is None:
        server = LocalServer(binary=args.moe_server)
        target = server.target
        print(f"torch_train: started moe-server on {target} (CPU engine)")
    try:
        return train(args, target)
    finally:
        if server is not None:
            server.stop()


def train(args, target):
    torch.manual_seed(args.seed)
    adamw = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    # Several runs against one server: layer names are unique to this process.
    tag = f"{int(time.time() * 1000) % 10**9}"
    remote_moes = [
        moe_offload.RemoteMoE(server=target, name=f"torch_train_{tag}_{i}",
                              num_experts=args.experts, top_k=args.top_k,
                              d_model=args.d_model, d_hidden=args.d_hidden, routing="client",
                              dtype=torch.float32, optimizer="adamw", seed=args.seed + i,
                              init_scale=0.5, betas=adamw["betas"], eps=adamw["eps"],
                              weight_decay=adamw["weight_decay"], lr=args.lr)
        for i in range(args.layers)]
    remote = MoETransformer(args.vocab, args.seq_len, args.d_model, args.heads, remote_moes,
                            args.experts, args.top_k)
    local_moes = [moe_offload.TorchMoE(args.experts, args.top_k, args.d_model, args.d_hidden)
                  for _ in range(args.layers)]
    local = MoETransformer(args.vocab, args.seq_len, args.d_model, args.heads, local_moes,
                           args.experts, args.top_k)
    # The same initial weights: dense ones from the remote model, experts from the server.
    local.load_state_dict(remote.state_dict())
    remote_opt = torch.optim.AdamW(remote.parameters(), **adamw)  # dense part only
    local_opt = torch.optim.AdamW(local.parameters(), **adamw)     # dense part and experts

    gen = torch.Generator().manual_seed(args.seed + 1)
    table = transition_table(args.vocab, 3, gen)
    floor = entropy_rate(table)
    tokens_per_step = args.batch * args.seq_len
    print(f"torch_train: {args.layers} MoE blocks (E={args.experts}, K={args.top_k}, "
          f"d={args.d_model}, h={args.d_hidden}) on {target}; {tokens_per_step} tokens a step; "
          f"loss starts near ln({args.vocab}) = {math.log(args.vocab):.3f}, data entropy "
          f"{floor:.3f}")

    remote_losses, local_losses = [], []
    worst = 0.0
    remote_seconds = 0.0
    bar = progress(args.steps)
    for step in (bar if bar is not None else range(args.steps)):
        inputs, labels = sample_batch(table, args.batch, args.seq_len, gen)

        start = time.perf_counter()
        loss = F.cross_entropy(remote(inputs).reshape(-1, args.vocab), labels.reshape(-1))
        remote_opt.zero_grad()
        loss.backward()
        remote_opt.step()
        for moe in remote_moes:
            moe.step()
        remote_seconds += time.perf_counter() - start

        local_loss = F.cross_entropy(local(inputs).reshape(-1, args.vocab), labels.reshape(-1))
        local_opt.zero_grad()
        local_loss.backward()
        local_opt.step()

        remote_losses.append(loss.item())
        local_losses.append(local_loss.item())
        diff = abs(remote_losses[-1] - local_losses[-1]) / local_losses[-1]
        worst = max(worst, diff)
        rate = (step + 1) * tokens_per_step / remote_seconds
        if bar is not None:
            bar.set_postfix(loss=f"{remote_losses[-1]:.4f}", local=f"{local_losses[-1]:.4f}",
                            tok_s=f"{rate:,.0f}")
        elif step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {remote_losses[-1]:.4f}  in process "
                  f"{local_losses[-1]:.4f}  difference {diff:.1e}  {rate:,.0f} tokens/s",
                  flush=True)
    if bar is not None:
        bar.close()

    print(f"torch_train: loss {remote_losses[0]:.4f} -> {remote_losses[-1]:.4f} through "
          f"moe-server, {local_losses[0]:.4f} -> {local_losses[-1]:.4f} in process; "
          f"{args.steps * tokens_per_step / remote_seconds:,.0f} tokens/s through moe-server")
    plot(args.plot, remote_losses, local_losses, floor)
    ok = worst <= args.tolerance
    print(f"torch_train: largest relative loss difference {worst:.2e} "
          f"({'within' if ok else 'OUTSIDE'} the tolerance {args.tolerance:g})")
    if not ok:
        return 1
    if not remote_losses[-1] < remote_losses[0]:
        print("torch_train: the loss did not fall")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
