"""Tensor-parallel collectives of a pair of CPU ranks, as one send and one receive each way.

Between two CPU (gloo) ranks one send and one receive each way costs a quarter of gloo's ring
all-reduce / all-gather / reduce-scatter of the same tensor (`benchmarks/tp_collectives.py`:
a tp-2 step 1.05-1.10x faster), so a pair trades tensors and adds them: x0 + x1 in either order
is the same float (addition commutes), the bits the ring gives. `tp_styles.choose_collectives` picks
`PairCollectives` for a TP group when tp is applied (`extensions.load("pair_collectives")`)
only when the group is such a pair; other sizes and devices keep c10d's collectives
(`tp_styles.C10dCollectives`), and a plain tp-1 run never loads this module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def swap(x: torch.Tensor, group: dist.ProcessGroup, me: int) -> torch.Tensor:
    """The other rank's `x` (same shape; `x` contiguous), for this rank's own."""
    peer = dist.get_global_rank(group, 1 - me)
    theirs = torch.empty_like(x)
    sent = dist.isend(x, peer, group=group)
    dist.irecv(theirs, peer, group=group).wait()
    sent.wait()
    return theirs


class PairCollectives:
    """`tp_styles.C10dCollectives`' three calls for a pair of CPU ranks; `me`: this rank's
    rank in the pair."""

    def __init__(self, me: int):
        self.me = me

    def gather(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """Both ranks' `x` along dim 0, in rank order."""
        theirs = swap(x, group, self.me)
        return torch.cat((x, theirs) if self.me == 0 else (theirs, x))

    def reduce_scatter(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The sum of both ranks' `x`, this rank's half of dim 0."""
        mine, other = x.chunk(2)
        if self.me == 1:
            mine, other = other, mine
        return mine + swap(other, group, self.me)

    def summed(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The sum of both ranks' `x`."""
        return x + swap(x, group, self.me)
