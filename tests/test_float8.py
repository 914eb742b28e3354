"""`mesh3d.float8` (torchao Float8Linear in the decoder layers) and `mesh3d.async_tp`.

In-process: which linears float8 converts (Llama: all 7 per layer; Qwen2-MoE: none inside an MoE
block; sizes not multiples of 16 skipped, a model with none refused), state-dict names
unchanged; the config refusals (float8 with tp 2, ep 2 or without torchao, also through the CLI's
exit code 2; async_tp without compile, tp > 1, REDUCE_SCATTER or CUDA).
Forked ranks, two launches:
- 1 rank: the float8 references (2 layers x 5 steps, 4 layers x 3 steps), the same run without
  float8 (it must differ) and with recomputed layers (it must not), and checkpoints: a float8
  run and a plain run each save one (same files, names, shapes); a plain run resumes the float8
  one (weights bitwise equal) and another starts from its weights through `init_method: {path}`;
- 2 ranks: float8 at dp2 (zero 0, zero 1, full_shard) and pp2 (1f1b; zbv with zero 1) equal
  the one-process float8 run within 1e-5: the microbatches are the same, so every tensorwise
  scale is too; cp2 only comes close (each cp rank scales its own half of the sequence). Then
  async_tp: a CPU training run is refused, and `enable_async_tp` sets what inductor's pass reads.
"""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from dist import run_ranks
from parity import TINY, layout_overrides, max_rel_diff, rel, train_runs
from safetensors import safe_open
from test_moe import MOE
from torch import nn

from mesh3d.checks import validation_errors
from mesh3d.checks.speed import torchao_missing
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.config.derive import padded_vocab_size
from mesh3d.errors import ConfigError
from mesh3d.models.moe import MoE
from mesh3d.models.registry import spec_of
from mesh3d.train.loop import train

MOE_BLOCKS = (MoE,)  # the MoE classes the Qwen2 spec names

TOL = 1e-5
CP_TOL = 5e-3  # loss and grad norm at cp2: other scales, so other roundings
F8 = "mesh3d.float8=true"
L4 = ["model.model_config.num_hidden_layers=4", "tokens.train_steps=3"]
ATTN, MLP = (
    [f"self_attn.{p}_proj" for p in "qkvo"],
    ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
)
PROJECTIONS = ATTN + MLP
ASYNC_OK = ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER", "mesh3d.compile=true",
            "mesh3d.async_tp=true", "mesh3d.device=cuda"]  # fmt: skip

needs_torchao = pytest.mark.skipif(
    torchao_missing(), reason="torchao is not installed (pip install torchao): float8 cannot run"
)


def _cfg(overrides: list[str], base: dict = TINY):
    return apply_overrides(config_from_dict(copy.deepcopy(base)), overrides)


def _meta_model(overrides: list[str], base: dict = TINY) -> nn.Module:
    cfg = _cfg(overrides, base)
    mc = cfg.model.model_config
    with torch.device("meta"):
        return spec_of(mc).build(mc, vocab_size=padded_vocab_size(cfg))


def _errors(overrides: list[str], key: str, base: dict = TINY) -> list[str]:
    return [e for e in validation_errors(_cfg(overrides, base)) if key in e]


# ---------------------------------------------------------------- conversion, in-process


@needs_torchao
def test_float8_converts_the_decoder_projections_only():
    from torchao.float8.float8_linear import Float8Linear

    from mesh3d.train.float8 import convert_to_float8

    model, plain = _meta_model([]), _meta_model([])
    assert convert_to_float8(model, MOE_BLOCKS) == (2 * 7, 0)  # 2 layers x q/k/v/o + gate/up/down
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == sorted(f"layers.{i}.{p}" for i in range(2) for p in PROJECTIONS)
    assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding
    # checkpoints see the plain model's names and shapes
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }


@needs_torchao
def test_float8_leaves_moe_blocks_and_odd_sizes_in_high_precision():
    from torchao.float8.float8_linear import Float8Linear

    from mesh3d.train.float8 import apply_float8, convert_to_float8

    moe = _meta_model([], MOE)  # layers 0 and 2 are MoE blocks, layer 1 a dense MLP
    assert convert_to_float8(moe, MOE_BLOCKS) == (3 * 4 + 3, 0)
    for name, m in moe.named_modules():
        if ".mlp." in name and name.split(".")[1] in ("0", "2"):
            assert not isinstance(m, Float8Linear), name  # router, shared expert and its gate
    odd = _meta_model(["model.model_config.intermediate_size=72"])  # 72 % 16 != 0
    assert convert_to_float8(odd, MOE_BLOCKS) == (2 * 4, 2 * 3)
    none = _meta_model(["model.model_config.hidden_size=40", "model.model_config.intermediate_size=72",
                        "model.model_config.num_attention_heads=4",
                        "model.model_config.num_key_value_heads=2"])  # fmt: skip
    with pytest.raises(ConfigError, match="found no linear layer to convert"):
        apply_float8(none, MOE_BLOCKS)


# ---------------------------------------------------------------- refusals, in-process


def test_float8_with_tensor_or_expert_parallelism_is_refused():
    key = "`mesh3d.float8` "  # not the torchao message, when torchao is missing here
    (tp,) = _errors([F8, "parallelism.tp=2"], key)
    assert tp.startswith("`mesh3d.float8` does not work with `parallelism.tp` > 1 yet (tp is 2)")
    assert "set parallelism.tp: 1 (use dp or pp), or mesh3d.float8: false" in tp
    ep = ["parallelism.dp=2", "parallelism.expert_parallel_size=2", F8]
    (msg,) = _errors(ep, key, MOE)
    assert "`parallelism.expert_parallel_size` > 1 yet (it is 2)" in msg
    assert not _errors([F8, "parallelism.dp=2", "parallelism.pp=2"], key)


def test_float8_without_torchao_is_a_config_error(monkeypatch, tmp_path, capsys):
    import yaml

    from mesh3d.checks.__main__ import main
    from mesh3d.train.float8 import convert_to_float8

    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    fix = "`pip install torchao` (or `pip install mesh3d[float8]`), or set mesh3d.float8: false"
    assert _errors([F8], "torchao") == [
        f"`mesh3d.float8: true` needs torchao, which is not installed: {fix}"
    ]
    with pytest.raises(ConfigError, match=r"needs torchao, and `import torchao.float8` failed"):
        convert_to_float8(_meta_model([]), MOE_BLOCKS)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(TINY))
    with pytest.raises(SystemExit) as stop:
        main([str(path), F8])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: `mesh3d.float8: true` needs torchao")


def test_async_tp_refusals_name_what_to_change():
    assert not _errors(ASYNC_OK, "async_tp")  # what it can run with
    assert not _errors(ASYNC_OK + ["mesh3d.device=auto"], "async_tp")  # checked when built
    (compile_,) = _errors(ASYNC_OK + ["mesh3d.compile=false"], "async_tp")
    assert "set mesh3d.compile: true as well, or mesh3d.async_tp: false" in compile_
    (tp1,) = _errors(ASYNC_OK + ["parallelism.tp=1"], "async_tp")
    assert "but `parallelism.tp` is 1; set tp > 1, or mesh3d.async_tp: false" in tp1
    (mode,) = _errors(ASYNC_OK + ["parallelism.tp_mode=ALL_REDUCE"], "async_tp")
    assert "needs `parallelism.tp_mode: REDUCE_SCATTER`" in mode and "ALL_REDUCE has none" in mode
    (cpu,) = _errors(ASYNC_OK + ["mesh3d.device=cpu"], "async_tp")
    assert cpu.startswith("`mesh3d.async_tp` needs CUDA GPUs with NCCL") and "device is cpu" in cpu
    assert len(_errors(["mesh3d.async_tp=true", "mesh3d.device=cpu"], "async_tp")) == 3


# ---------------------------------------------------------------- training, forked ranks


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
