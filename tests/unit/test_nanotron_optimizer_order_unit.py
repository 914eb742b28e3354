"""Nanotron's parameter order in the optimizer files, the tests that need no process group:
mesh3d's parameter list of every family is Nanotron's `named_parameters()` order (of each tp
rank: row-parallel biases on tp rank 0 only), and mesh3d reads an optimizer file in either
order (its own older files have Llama's order).

The others (files saved by training at tp1, tp2, tp2 REDUCE_SCATTER, dp2 zero 1) are in
`tests/ranks/test_nanotron_optimizer_order.py`."""

from __future__ import annotations

import json

import pytest
import torch
from test_moe import MOE
from test_nanotron_optimizer_order import FAMILIES, family_config, nanotron_order

from mesh3d.checkpoint import nanotron_state
from mesh3d.checkpoint.load import OptimizerFiles
from mesh3d.checkpoint.nanotron_weights import nanotron_params
from mesh3d.config import config_from_dict
from mesh3d.models.registry import model_shape


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameter_list_is_nanotron_module_order(family, tp_rank):
    """Every family's parameter list, as a tp rank's optimizer file lists it (row-parallel
    biases on tp rank 0 only), is Nanotron's `named_parameters()` order of that rank."""
    cfg = family_config(family, "tp2")
    listed = nanotron_state.tp_rank_entries(nanotron_params(model_shape(cfg)), tp_rank)
    assert [p.name for p in listed] == nanotron_order(cfg, tp_rank)


def test_optimizer_files_read_in_nanotron_and_in_llama_order(tmp_path):
    """The same states written in both orders: `OptimizerFiles` finds each by its name."""
    cfg = config_from_dict(MOE)
    params = nanotron_params(model_shape(cfg))
    gen = torch.Generator().manual_seed(0)
    states = {p.name: {k: torch.randn(p.shape, generator=gen) for k in ("exp_avg", "exp_avg_sq")}
              for p in params}  # fmt: skip
    llama_order = sorted(params, key=lambda p: "post_attention_layernorm" in p.name)
    got = []
    for name, order in (("nanotron", params), ("llama", llama_order)):
        folder = tmp_path / name
        folder.mkdir()
        opt_cfg = nanotron_state.optimizer_config("NamedOptimizer", 1, 1, 1, params, False)
        (folder / "optimizer_config.json").write_text(json.dumps(opt_cfg))
        entries = [(p.name, states[p.name]) for p in order]
        payload = nanotron_state.optimizer_payload(entries, [{"lr": 1.0}] * len(order))
        torch.save(payload, folder / nanotron_state.optimizer_file(0, 1, 0, 1))
        files = OptimizerFiles(folder)
        got.append({p.name: files.full(p, "exp_avg_sq") for p in params})
    assert [p.name for p in llama_order] != [p.name for p in params]
    for p in params:
        assert torch.equal(got[0][p.name], states[p.name]["exp_avg_sq"]), p.name
        assert torch.equal(got[1][p.name], states[p.name]["exp_avg_sq"]), p.name
