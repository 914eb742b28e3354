"""Dummy data for `dataset: null`, the same samples at every layout.

As Nanotron's, inputs and labels are drawn uniformly ("random"), but each *global sample index*
is seeded on its own (Nanotron seeds per rank). "learnable" sequences follow a fixed next-token
rule, so the loss visibly falls on a CPU smoke run.
"""

from __future__ import annotations

import torch

_MIX = 0x9E3779B1  # odd constant to spread (seed, index) pairs over generator seeds


class DummyTokens:
    """Map-style dataset: `self[i]` -> (input_ids [S], label_ids [S]) for global sample i.

    Example:

        ds = mesh3d.DummyTokens(vocab_size=256, seq_len=128, seed=42, kind="learnable")
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, kind: str = "random"):
        if kind not in ("random", "learnable"):
            raise ValueError(f"unknown dummy data kind {kind!r}; use 'random' or 'learnable'")
        self.vocab_size, self.seq_len, self.seed, self.kind = vocab_size, seq_len, seed, kind

    def sample_key(self, index: int) -> int:
        """The low 32 bits of sample `index`'s generator seed, all that torch's CPU generator
        (mt19937) uses: equal keys give equal samples."""
        return (self.seed * _MIX + index) % (2**32)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed * _MIX + index) % (2**63))
        V, S = self.vocab_size, self.seq_len
        if self.kind == "random":  # inputs, then labels
            return torch.randint(0, V, (S,), generator=g), torch.randint(0, V, (S,), generator=g)
        # learnable: x[t+1] = (5 * x[t] + 3) mod V from a random start; labels = next tokens
        seq = [int(torch.randint(0, V, (1,), generator=g))]
        for _ in range(S):
            seq.append((5 * seq[-1] + 3) % V)
        t = torch.tensor(seq, dtype=torch.long)
        return t[:-1], t[1:]


def microbatches(
    dataset, step: int, global_batch_size: int, dp_rank: int, dp: int, micro_batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's microbatches for training step `step` (1-based): its contiguous slice of
    samples [(s-1)*GBS, s*GBS).

    Example:

        batches = mesh3d.microbatches(ds, step, gbs, dp_rank, dp, micro_batch_size)
    """
    per_rank = global_batch_size // dp
    if global_batch_size % dp or per_rank % micro_batch_size or not 0 <= dp_rank < dp or step < 1:
        raise ValueError(f"microbatches: step {step} (>= 1), dp_rank {dp_rank} (< dp {dp}), "
                         f"batch {global_batch_size} (dp x k x {micro_batch_size}): none left out")  # fmt: skip
    first = (step - 1) * global_batch_size + dp_rank * per_rank
    out = []
    for m in range(per_rank // micro_batch_size):
        rows = [dataset[first + m * micro_batch_size + j] for j in range(micro_batch_size)]
        out.append(tuple(torch.stack(column) for column in zip(*rows)))  # (inputs, labels[, pos])
    return out
