"""Spectral µP (`model.init_method: {use_mup: true}`): the initial full tensors have the std of
the formula (within 2%, widths 256 and 1024), each parameter trains at its own learning rate
(lr · fan_out / fan_in of Nanotron's fused matrices) on Nanotron's per-group schedule, the LR
scheduler file holds them as Nanotron writes it, and a tp 2 x pp 2 run equals one process.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_mup.py`."""

from __future__ import annotations

import pytest
from dist import run_ranks
from parity import max_rel_diff, train_runs
from test_mup import MUP


def _runs(rank, world, root):
    runs = [[*layout, f"checkpoints.checkpoints_path={root}/{name}",
             "checkpoints.checkpoint_interval=2", "tokens.train_steps=4"]
            for name, layout in (("one", []), ("tp2pp2", ["parallelism.tp=2", "parallelism.pp=2"]))
            if (world == 1) == (name == "one")]  # fmt: skip
    if world == 1:  # resume from step 2
        runs.append([*runs[0][:-1], "tokens.train_steps=4",
                     f"checkpoints.resume_checkpoint_path={root}/one/2",
                     f"checkpoints.checkpoints_path={root}/resumed"])  # fmt: skip
    return train_runs(rank, world, runs, base=MUP)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mup")
    one = run_ranks(1, _runs, root, timeout=180)[0]
    four = run_ranks(4, _runs, root, timeout=240)
    return root, one, four


def test_a_tp2_x_pp2_run_equals_one_process_and_resumes_exactly(runs):
    root, one, four = runs
    assert max_rel_diff(four[0][0], one[0]) <= 1e-5
    assert one[1]["loss"] == one[0]["loss"][2:]  # bitwise after a resume at step 2


def test_the_scheduler_file_holds_each_parameters_rate(runs):
    from mesh3d.checkpoint.load import safe_load

    root, _, _ = runs
    state = safe_load(
        root / "one/2/lr_scheduler/lr_scheduler_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt", "lr"
    )
    lr = MUP["optimizer"]["learning_rate_scheduler"]["learning_rate"]
    bases = sorted(set(round(b / lr, 6) for b in state["base_lrs"]))
    # embedding and norms at 1, o_proj at 1 too, down 64/128, qkv 128/64, gate_up 256/64, head 250/64
    assert bases == sorted({0.5, 1.0, 2.0, 4.0, round(250 / 64, 6)})
    assert len(state["base_lrs"]) == len(state["_last_lr"]) == 2 * 6 + 3
