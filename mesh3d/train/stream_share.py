"""A streamed step's tokens read once per dp replica and handed to the replica's other ranks.

A dp replica is every rank with one dp coordinate: its tp and cp peers and its pipeline stages.
They all train on the same samples, and a map-style stage lets each of them read its own copy
(a memory-mapped Nanoset costs nothing to read twice). A streamed stage tokenizes while
training, so reading it on every rank of a replica would tokenize every row tp x cp x pp times.
Instead the replica's first rank (pp, cp, tp coordinates 0, the one that also saves the stream
position) reads the step with its loading workers, and one broadcast over a gloo group of the
replica gives the others the step's windows: GBS / dp samples of S + 1 tokens, from which
inputs and labels are cut as the loader cuts them (`streaming.RankStream.assemble`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ReplicaShare:
    """The gloo group of this rank's dp replica and whether this rank reads for it; built on
    every rank alike (`dist.new_group` is collective over the world), only when some data stage
    is streamed and a replica has more than one rank."""

    def __init__(self, dims, rank: int):
        coords = dims.coords(rank)
        self.reader = coords["pp"] == 0 and coords["tp"] == 0 and coords.get("cp", 0) == 0
        self.group, self.src = None, rank
        for d in range(dims.dp):  # every rank creates every group, in the same order
            ranks = [r for r in range(dims.world_size) if dims.coords(r)["dp"] == d]
            group = dist.new_group(ranks, backend="gloo")
            if d == coords["dp"]:
                self.group, self.src = group, ranks[0]

    def share(self, batches: list, samples: int, seq_len: int, mbs: int) -> list:
        """The reader's `batches` of one step on every rank of the replica (`samples`: the
        replica's samples of the step, of `seq_len` + 1 tokens, `mbs` to a microbatch)."""
        if self.reader:
            first = torch.cat([x for x, _ in batches])
            windows = torch.cat([first, torch.cat([y for _, y in batches])[:, -1:]], dim=1)
        else:
            windows = torch.empty(samples, seq_len + 1, dtype=torch.int64)
        dist.broadcast(windows.contiguous(), src=self.src, group=self.group)
        if self.reader:
            return batches
        return [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in windows.split(mbs)]


def needs_share(data, dims) -> bool:
    """Whether some stage is streamed and a dp replica has more than one rank."""
    streamed = any(getattr(ds, "streamed", False) for ds in data.datasets)
    return streamed and dims.world_size // dims.dp > 1
