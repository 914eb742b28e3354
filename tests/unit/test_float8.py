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

The tests of this subject that need a process group are in `tests/ranks/test_float8_ranks.py`."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from parity import TINY
from test_moe import MOE
from torch import nn

from mesh3d.checks import validation_errors
from mesh3d.checks.speed import torchao_missing
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.config.derive import padded_vocab_size
from mesh3d.errors import ConfigError
from mesh3d.models.moe import MoE
from mesh3d.models.registry import spec_of

MOE_BLOCKS = (MoE,)  # the MoE classes the Qwen2 spec names

F8 = "mesh3d.float8=true"
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
