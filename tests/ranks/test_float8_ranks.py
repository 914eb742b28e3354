"""`mesh3d.float8` (torchao Float8Linear in the decoder layers) and `mesh3d.async_tp`.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_float8.py`."""

from __future__ import annotations

import math

import pytest
import torch
from dist import run_ranks
from parity import layout_overrides, max_rel_diff, rel, train_runs
from safetensors import safe_open
from test_float8 import ASYNC_OK, F8, _cfg

from mesh3d.checks.speed import torchao_missing
from mesh3d.errors import ConfigError
from mesh3d.train.loop import train

TOL = 1e-5


CP_TOL = 5e-3  # loss and grad norm at cp2: other scales, so other roundings


L4 = ["model.model_config.num_hidden_layers=4", "tokens.train_steps=3"]


def _ckpt(path, steps: int, resume=None) -> list[str]:
    out = [f"checkpoints.checkpoints_path={path}", f"checkpoints.checkpoint_interval={steps}",
           f"tokens.train_steps={steps}"]  # fmt: skip
    return out + ([f"checkpoints.resume_checkpoint_path={resume}"] if resume else [])


def _async_tp_checks(cuda: bool) -> dict:
    """Inside a 2-rank launch: a CPU run with async_tp is refused when its model is built; then
    `enable_async_tp` on a tp group sets what inductor's micro-pipeline pass reads."""
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group
    from torch.distributed.device_mesh import init_device_mesh

    from mesh3d.train.async_tp import enable_async_tp

    refused = None
    if not cuda:
        try:
            auto = ["mesh3d.device=auto"]  # passes validation; the CPU is found when built
            train(_cfg(layout_overrides(1, 2, "REDUCE_SCATTER", 0, False) + ASYNC_OK + auto))
        except ConfigError as e:
            refused = str(e)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))  # tp: a group of its own
    tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()
    before = inductor_config._micro_pipeline_tp
    enable_async_tp(tp)
    return dict(
        refused=refused,
        pass_before=before,
        pass_after=inductor_config._micro_pipeline_tp,
        tp_symm_mem=is_symm_mem_enabled_for_group(tp.group_name),
        dp_symm_mem=is_symm_mem_enabled_for_group(dp.group_name),
    )


def _two_ranks(rank: int, world: int, runs: list[list[str]], cuda: bool):
    return train_runs(rank, world, runs), _async_tp_checks(cuda)


def _ref(layers4: bool = False, *extra: str) -> list[str]:
    out = layout_overrides(1, 1, "ALL_REDUCE", 0, layers4, microbatches=4) + list(extra)
    return out + (L4 if layers4 else [])


def _dp2(zero: int, *extra: str) -> list[str]:
    return layout_overrides(2, 1, "ALL_REDUCE", zero, False, microbatches=2) + [F8, *extra]


def _pp2(schedule: str, zero: int, virtual: int) -> list[str]:
    return layout_overrides(1, 1, "ALL_REDUCE", zero, True, microbatches=4) + L4 + [
        F8, "parallelism.pp=2", f"mesh3d.pp_schedule={schedule}",
        f"mesh3d.pp_virtual_stages={virtual}",
    ]  # fmt: skip


TWO_RANKS = {  # label -> (overrides, reference)
    "dp2 zero 0": (_dp2(0), "f8"),
    "dp2 zero 1": (_dp2(1), "f8"),
    "dp2 full_shard": (_dp2(1, "mesh3d.full_shard=true"), "f8"),
    "pp2 1f1b": (_pp2("1f1b", 0, 1), "f8_pp"),
    "pp2 zbv zero 1": (_pp2("zbv_zero_bubble", 1, 2), "f8_pp"),
    "cp2": (_ref(False, F8, "parallelism.context_parallel_size=2"), "f8"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if torchao_missing():
        pytest.skip("torchao is not installed (pip install torchao): float8 cannot run")
    d = tmp_path_factory.mktemp("float8")
    one = {
        "f8": _ref(False, F8),
        "f8_pp": _ref(True, F8),
        "plain": _ref(False),
        "f8_recompute": _ref(False, F8, "parallelism.recompute_layer=true"),
        "f8_saved": _ref(False, F8) + _ckpt(d / "f8", 3),
        "plain_saved": _ref(False) + _ckpt(d / "plain", 3),
        "plain_resumed": _ref(False) + _ckpt(d / "resumed", 3, d / "f8" / "3"),
        "plain_init": _ref(False) + _ckpt(d / "init", 1) + [f"model.init_method={{path: {d / 'f8' / '3'}}}"],
    }  # fmt: skip
    out = dict(zip(one, run_ranks(1, train_runs, list(one.values()), timeout=300)[0]))
    cuda = torch.cuda.is_available()
    two = [o for o, _ in TWO_RANKS.values()]
    results = run_ranks(2, _two_ranks, two, cuda, timeout=300)
    out["two"] = [dict(zip(TWO_RANKS, r[0])) for r in results]
    out["async"] = [r[1] for r in results]
    out["dir"], out["cuda"] = d, cuda
    return out


def test_float8_trains_and_changes_the_numbers(runs):
    f8, plain = runs["f8"], runs["plain"]
    assert all(math.isfinite(x) for x in f8["loss"] + f8["grad_norm"])
    assert f8["loss"][-1] < f8["loss"][0] - 1.0  # learnable dummy data: the loss falls
    assert all(b < a for a, b in zip(f8["loss"], f8["loss"][1:]))
    assert runs["f8_recompute"]["loss"] == f8["loss"]  # recomputed layers: the same scales
    # float8 matmuls round differently from fp32 ones: the same run without it differs
    assert 1e-5 < rel(torch.tensor(f8["loss"]), torch.tensor(plain["loss"])) < 1e-2


def test_float8_dp_and_pp_equal_one_process(runs):
    table = {}
    for label, (_, ref) in TWO_RANKS.items():
        run, base = runs["two"][0][label], runs[ref]
        table[label] = (
            rel(torch.tensor(run["loss"]), torch.tensor(base["loss"])),
            rel(torch.tensor(run["grad_norm"]), torch.tensor(base["grad_norm"])),
            max_rel_diff(run, base),
        )
    report = "\n".join(
        f"{k}: loss {a:.1e}, grad norm {b:.1e}, all {c:.1e}" for k, (a, b, c) in table.items()
    )
    print(f"\nfloat8 parity against one process (relative):\n{report}")
    for label, (loss, norm, everything) in table.items():
        if label == "cp2":
            assert loss <= CP_TOL and norm <= CP_TOL, report
        else:
            assert everything <= TOL, report
    for r, ranks in enumerate(runs["two"]):
        for label, run in ranks.items():
            assert not run["replica_mismatches"], (r, label, run["replica_mismatches"])
            assert run["loss"] == runs["two"][0][label]["loss"], "all ranks log one loss"


def _tensors(step) -> dict[str, dict[str, tuple]]:
    """Every safetensors file of a step's model/ folder: its tensor names and shapes."""
    out = {}
    for f in sorted((step / "model").rglob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names = st.keys()
            out[str(f.relative_to(step))] = {k: tuple(st.get_slice(k).get_shape()) for k in names}
    return out


def test_float8_checkpoint_is_a_plain_checkpoint(runs):
    d = runs["dir"]
    f8, plain = d / "f8" / "3", d / "plain" / "3"
    files = {str(p.relative_to(f8)) for p in f8.rglob("*") if p.is_file()}
    assert files == {str(p.relative_to(plain)) for p in plain.rglob("*") if p.is_file()}
    assert _tensors(f8) == _tensors(plain) and _tensors(f8)
    opt = next((f8 / "optimizer").glob("*.pt"))
    names = torch.load(opt, weights_only=True)["names"]
    assert names == torch.load(plain / "optimizer" / opt.name, weights_only=True)["names"]
    # a plain run resumes it: the very weights the float8 run ended with
    saved, resumed = runs["f8_saved"]["weights"], runs["plain_resumed"]["weights"]
    assert resumed.keys() == saved.keys() and runs["plain_resumed"]["loss"] == []
    assert all(torch.equal(resumed[k], saved[k]) for k in saved)
    # and starts from its weights (Nanotron-layout files): already trained at step 1
    (first,) = runs["plain_init"]["loss"]
    assert math.isfinite(first) and first < runs["f8_saved"]["loss"][-1] + 0.1
    assert first < runs["plain"]["loss"][0] - 1.0


def test_async_tp_refused_on_cpu_and_switched_on_for_the_tp_group(runs):
    for rank, checks in enumerate(runs["async"]):
        if not runs["cuda"]:
            assert checks["refused"] == (
                "`mesh3d.async_tp` needs CUDA GPUs with NCCL (it runs on symmetric memory); this "
                "run is on cpu with gloo. Set mesh3d.async_tp: false (or run on CUDA GPUs)"
            ), rank
        assert (checks["pass_before"], checks["pass_after"]) == (False, True), rank
        assert checks["tp_symm_mem"] and not checks["dp_symm_mem"], rank
