"""Context parallelism (the sequence split over the "cp" axis) equals one process.

This file holds the tests of that subject that run in one process without a process group; the
others are in `tests/ranks/test_cp.py`."""

from __future__ import annotations

import pytest
import torch
from test_cp import CP

from mesh3d.checks import validate
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.errors import ConfigError
from mesh3d.mesh import ParallelDims
from mesh3d.parallel.context import gathered_order, local_indices, shard_sequence


def test_rank_order_is_nanotrons_tp_then_cp_then_dp_then_pp():
    dims = ParallelDims(dp=2, tp=2, pp=2, cp=2)  # 16 ranks
    for rank in range(16):
        c = dims.coords(rank)
        assert rank == ((c["pp"] * 2 + c["dp"]) * 2 + c["cp"]) * 2 + c["tp"]
    assert dims.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert dims.groups("cp")[:2] == [[0, 2], [1, 3]]
    assert dims.groups("dp")[:2] == [[0, 4], [1, 5]]
    assert dims.groups("pp")[0] == [0, 8]
    # cp = 1 leaves the three-axis layout as it was
    assert ParallelDims(2, 2, 2).coords(6) == {"pp": 1, "dp": 1, "cp": 0, "tp": 0}


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert local_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_indices(16, 4, 3).tolist() == [6, 7, 8, 9]
    for cp in (1, 2, 4):
        held = torch.cat([local_indices(32, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32))  # every token once
        # causal work (keys before each query) is the same on every rank
        work = {int((local_indices(32, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1
        x = torch.arange(32)[None]
        gathered = torch.cat([shard_sequence(x, cp, r) for r in range(cp)], dim=1)
        assert torch.equal(gathered[:, gathered_order(32, cp)], x)


def _cfg(*overrides: str):
    from parity import TINY

    return apply_overrides(config_from_dict(TINY), list(overrides))


def test_validate_names_the_cp_constraints():
    with pytest.raises(ConfigError, match=r"sequence_length` \(16\) must be divisible by `2 x "
                                          r"parallelism.context_parallel_size` \(32\)"):  # fmt: skip
        validate(_cfg(f"{CP}=16"), world_size=16)
    with pytest.raises(
        ConfigError, match=r"context_parallel_size \(2\) = 4, but the world size is 2"
    ):
        validate(_cfg(f"{CP}=2", "parallelism.tp=2"), world_size=2)
    with pytest.raises(ConfigError, match=r"tokens.sequence_length / context_parallel_size` \(4\) "
                                          r"must be divisible by `parallelism.tp` \(8\)"):  # fmt: skip
        validate(_cfg(f"{CP}=4", "parallelism.tp=8", "parallelism.tp_mode=REDUCE_SCATTER",
                      "model.model_config.num_attention_heads=8",
                      "model.model_config.num_key_value_heads=8"), world_size=32)  # fmt: skip
    validate(_cfg(f"{CP}=4", "parallelism.tp=2"), world_size=8)  # 16 tokens: chunks of 2
