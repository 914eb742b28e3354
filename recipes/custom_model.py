"""Your own model, not Llama, trained in 3D with mesh3d's public API and a loop you own.

    python recipes/custom_model.py                                         # one process
    torchrun --nproc_per_node=8 recipes/custom_model.py --dp 2 --tp 2 --pp 2   # 3D on 8 CPU ranks

A GPT-2-style model (learned positions, LayerNorm, GELU MLP, blocks in a `ModuleDict`) is
defined here, with its tensor-parallel plan in six lines. mesh3d gives the mesh, applies the
plan, cuts the model into pipeline stages and builds the schedule, normalizes the loss so that
any layout computes the same gradients, and sums gradients over dp. The model, the data and the
loop stay the user's. Every rank builds the full model from the same seed, so the weights are
the same at any layout.

Flags it cannot run with stop before any process starts work, with one line naming the flag
(exit 2): dp * tp * pp must be the number of processes, --dp must divide the 8-sample batch into
per-rank batches of whole microbatches (2 each), --tp must divide the 4 attention heads, --pp can
be at most the 2 microbatches, and --steps must be >= 1.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import mesh3d
from mesh3d.errors import UserError, exit_on_user_error, on_every_rank

VOCAB, DIM, HEADS, LAYERS, SEQ = 96, 64, 4, 4, 16


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        # no key bias: its gradient is exactly zero (softmax ignores a shift shared by all keys),
        # so Adam would only amplify rounding noise into updates that differ between layouts
        self.c_q, self.c_k, self.c_v = (
            nn.Linear(dim, dim),
            nn.Linear(dim, dim, bias=False),
            nn.Linear(dim, dim),
        )
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # heads = this rank's share under tensor parallelism (-1 below)
        q, k, v = (
            f(x).view(b, s, -1, self.head_dim).transpose(1, 2)
            for f in (self.c_q, self.c_k, self.c_v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln_2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids -> logits. A pipeline stage keeps only its blocks; the others become None."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.h = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:  # the first stage: ids -> hidden states
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h.values():
            x = block(x)
        if self.head is not None:  # the last stage: hidden states -> logits
            x = self.head(self.ln_f(x))
        return x


# The tensor-parallel plan: which submodules shard how (Megatron's column -> row pairs).
TP_PLAN: mesh3d.TPPlan = {
    "h.*.attn.c_q": ColwiseParallel(),
    "h.*.attn.c_k": ColwiseParallel(),
    "h.*.attn.c_v": ColwiseParallel(),
    "h.*.attn.c_proj": RowwiseParallel(),
    "h.*.mlp.fc": ColwiseParallel(),
    "h.*.mlp.proj": RowwiseParallel(),
}


def batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: a learnable rule (next token = 3 x token + 1 mod VOCAB)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (global_batch, 1), generator=g)
    seq = (start * torch.tensor(3).pow(torch.arange(SEQ + 1)) + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def _either(values: list[int]) -> str:
    """[1, 2, 4] -> "1, 2 or 4"; [] -> "none" (no value fits)."""
    if not values:
        return "none"
    *head, last = values
    return f"{', '.join(map(str, head))} or {last}" if head else str(last)


def check(dp: int, tp: int, pp: int, steps: int, global_batch: int = 8, microbatches: int = 2,
          world: int | None = None) -> None:  # fmt: skip
    """Raise `UserError` (one line naming each bad flag) for what this example cannot train
    right: a degree or step count < 1, a dp that drops samples or leaves a rank's batch that
    the microbatches do not divide, a tp that splits a head, more pipeline stages than
    microbatches; with `world` (the number of processes), a layout of another size."""
    axes = {"dp": dp, "tp": tp, "pp": pp, "steps": steps}
    bad = [f"--{k} {v} must be >= 1" for k, v in axes.items() if v < 1]
    if bad:
        raise UserError("; ".join(bad))
    fits = [d for d in range(1, global_batch + 1) if global_batch % (d * microbatches) == 0]
    if global_batch % dp:
        bad.append(
            f"--dp {dp} must divide the global batch of {global_batch} samples (else "
            f"some are dropped); use --dp {_either(fits)}"
        )
    elif (global_batch // dp) % microbatches:
        bad.append(
            f"--dp {dp} leaves {global_batch // dp} sample(s) per rank, which its "
            f"{microbatches} microbatches do not divide; use --dp {_either(fits)}"
        )
    if HEADS % tp:
        tps = [t for t in range(1, HEADS + 1) if HEADS % t == 0]
        bad.append(
            f"--tp {tp} must divide the model's {HEADS} attention heads; use --tp {_either(tps)}"
        )
    most = min(microbatches, LAYERS)  # 1F1B: a microbatch per stage; a block per stage
    if pp > most:
        bad.append(
            f"--pp {pp} is more pipeline stages than the {microbatches} microbatches; "
            f"use --pp {_either(list(range(1, most + 1)))}"
        )
    if not bad and world is not None and dp * tp * pp != world:
        n = dp * tp * pp
        bad.append(
            f"--dp {dp} x --tp {tp} x --pp {pp} = {n} processes, but {world} started; "
            f"launch `torchrun --nproc_per_node={n} recipes/custom_model.py` with these "
            f"flags, or give flags whose product is {world}"
        )
    if bad:
        raise UserError("; ".join(bad))


def train(dp: int = 1, tp: int = 1, pp: int = 1, steps: int = 5, global_batch: int = 8,
          microbatches: int = 2, seed: int = 0, lr: float = 3e-3) -> dict:  # fmt: skip
    """Train on the current process group (started if needed); losses and this rank's model."""
    check(dp, tp, pp, steps, global_batch, microbatches)
    mesh3d.init_distributed(device="cpu")
    mesh = mesh3d.build_mesh(mesh3d.ParallelDims(dp=dp, tp=tp, pp=pp), "cpu")
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(seed)
    model = GPT(VOCAB, DIM, HEADS, LAYERS, SEQ)  # the full model, the same on every rank
    if pp > 1:
        layers = list(range(pp_rank * LAYERS // pp, (pp_rank + 1) * LAYERS // pp))
        model = mesh3d.build_stage(model, pp_rank, pp, layers, blocks="h",
                                   first=("wte", "wpe"), last=("ln_f", "head"))  # fmt: skip
    mesh3d.apply_tp(model, mesh["tp"], TP_PLAN)
    # foreach=False: plain and DTensor parameters mix here; eps 1e-6 keeps Adam from turning
    # fp32 summation-order noise of near-zero gradients into visible update differences
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6, foreach=False)

    per_rank = global_batch // dp
    mbs = per_rank // microbatches

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return mesh3d.normalized_loss(logits, labels, VOCAB, global_batch * SEQ)

    schedule = None
    if pp > 1:
        meta = lambda *shape, **kw: torch.empty(shape, device="meta", **kw)  # noqa: E731
        hidden = meta(mbs, SEQ, DIM, requires_grad=True)
        inputs = meta(mbs, SEQ, dtype=torch.int64) if pp_rank == 0 else hidden
        outputs = meta(mbs, SEQ, VOCAB) if pp_rank == pp - 1 else hidden
        stage = PipelineStage(model, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group(),
                              input_args=(inputs,), output_args=(outputs,))  # fmt: skip
        schedule = mesh3d.build_schedule("1f1b", [stage], microbatches, loss_fn)

    losses = []
    for step in range(1, steps + 1):
        ids, labels = (
            t[dp_rank * per_rank : (dp_rank + 1) * per_rank] for t in batch(step, global_batch)
        )
        if schedule is not None:
            parts = mesh3d.run_schedule(schedule, [stage], ids, labels)
            loss = torch.stack(parts).sum() if parts else torch.zeros(())
        else:
            loss = torch.zeros(())
            for x, y in zip(ids.split(mbs), labels.split(mbs)):
                part = loss_fn(model(x), y)
                part.backward()
                loss += part.detach()
        mesh3d.allreduce_gradients(model, mesh["dp"].get_group())  # sum: the loss is global
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the global mean token loss
        if pp > 1:  # the last stage has it; every rank reports it
            dist.broadcast(loss, group=mesh["pp"].get_group(), group_src=pp - 1)
        losses.append(float(loss))
    return {"loss": losses, "model": model, "mesh": mesh}


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for axis in ("dp", "tp", "pp"):
        ap.add_argument(f"--{axis}", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; before any process group work
    try:
        check(args.dp, args.tp, args.pp, args.steps, world=world)
    except UserError as e:
        raise on_every_rank(e) from None  # every rank refuses alike: rank 0 prints it
    out = train(args.dp, args.tp, args.pp, steps=args.steps)
    if dist.get_rank() == 0:
        print("losses:", " ".join(f"{x:.4f}" for x in out["loss"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
