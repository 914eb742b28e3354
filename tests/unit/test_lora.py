"""LoRA (`mesh3d.lora`) without a process group: which projections each family adapts and how
tp splits them, peft's initialisation, the merge, `mesh3d plan`'s saving, a resumed LoRA
checkpoint checked against its base, and every bad input named in one line."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from parity import TINY

from mesh3d.checks.validate import validation_errors
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.errors import UserError
from mesh3d.layout import lora_plan_of
from mesh3d.models import lora


def _cfg(*overrides: str, base: dict = TINY):
    return apply_overrides(config_from_dict(copy.deepcopy(base)), list(overrides))


def _errors(*overrides: str) -> list[str]:
    return validation_errors(_cfg(*overrides))


def test_targets_kinds_and_adapter_splits():
    plan = lora_plan_of(_cfg("mesh3d.lora={r: 4, target_modules: [q_proj, o_proj, down_proj]}"))
    assert list(plan.modules) == [f"layers.{i}.{m}" for i in (0, 1)
                                  for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]  # fmt: skip
    assert plan.modules["layers.0.self_attn.q_proj"] == "column"
    assert plan.modules["layers.0.mlp.down_proj"] == "row"
    assert plan.shapes["layers.0.mlp.down_proj"] == (64, 128)  # (out, in)
    kinds = {n: plan.adapter_kind(n) for n in plan.adapter_shapes()}
    assert kinds["layers.0.self_attn.q_proj.lora_A.weight"] == "replicated"
    assert kinds["layers.0.self_attn.q_proj.lora_B.weight"] == "column"
    assert kinds["layers.0.mlp.down_proj.lora_A.weight"] == "row"
    assert kinds["layers.0.mlp.down_proj.lora_B.weight"] == "replicated"
    assert plan.adapter_shapes()["layers.0.mlp.down_proj.lora_A.weight"] == (4, 128)
    assert plan.scaling == 8 / 4  # lora_alpha default 8
    default = lora_plan_of(_cfg("mesh3d.lora={}"))  # peft's default for Llama: q_proj, v_proj
    assert sorted({m.rsplit(".", 1)[1] for m in default.modules}) == ["q_proj", "v_proj"]
    regex = lora_plan_of(_cfg(r"mesh3d.lora={target_modules: 'layers\.1\..*_proj'}"))
    assert len(regex.modules) == 7 and all(m.startswith("layers.1.") for m in regex.modules)


def test_moe_layers_adapt_attention_only_and_mqa_kv_is_not_a_target():
    d = copy.deepcopy(TINY)
    mc = d["model"]["model_config"]
    mc["is_qwen2_config"] = mc.pop("is_llama_config")
    mc["moe_config"] = {"num_experts": 4, "top_k": 2}
    mods = lora_plan_of(_cfg("mesh3d.lora={target_modules: all-linear}", base=d)).modules
    assert len(mods) == 2 * 4 and all(".self_attn." in m for m in mods)  # no router, no expert
    d = copy.deepcopy(TINY)
    mc = d["model"]["model_config"]
    del (
        mc["is_llama_config"],
        mc["rms_norm_eps"],
        mc["tie_word_embeddings"],
        mc["num_key_value_heads"],
    )
    mc.update(is_starcoder2_config=True, multi_query=True)
    mods = lora_plan_of(_cfg("mesh3d.lora={target_modules: all-linear}", base=d)).modules
    assert sorted({m.split(".", 2)[2] for m in mods}) == [
        "mlp.c_fc",
        "mlp.c_proj",
        "self_attn.o_proj",
        "self_attn.q_proj",
    ]  # kv_proj: whole on every tp rank


def test_adapter_init_is_peft_and_the_merge_is_w_plus_scaled_ba():
    a = lora.adapter_init("layers.0.self_attn.q_proj.lora_A.weight", (4, 64), seed=7)
    assert a.abs().max() <= 1 / math.sqrt(64) and a.abs().max() > 0.9 / math.sqrt(64)
    assert torch.equal(a, lora.adapter_init("layers.0.self_attn.q_proj.lora_A.weight", (4, 64), 7))
    assert not lora.adapter_init("layers.0.self_attn.q_proj.lora_B.weight", (64, 4), 7).any()
    plan = lora.LoraPlan(2, 4.0, {"m": "column"}, {"m": (3, 5)})
    w, a, b = torch.randn(3, 5), torch.randn(2, 5), torch.randn(3, 2)
    out = lora.merged({"m.weight": w}, {"m.lora_A.weight": a, "m.lora_B.weight": b}, plan)
    assert torch.allclose(out["m.weight"], w + 2.0 * b @ a, atol=1e-6)
    x = torch.randn(7, 5)  # the merged weight computes what the adapted layer computes
    layer = torch.nn.Linear(5, 3, bias=False)
    layer.weight.data.copy_(w)
    lora.inject(_Holder(layer), plan)
    layer.lora_A.weight.data.copy_(a)
    layer.lora_B.weight.data.copy_(b)
    assert torch.allclose(layer(x), x @ out["m.weight"].T, atol=1e-5)


class _Holder(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m


def test_plan_counts_adapters_only_for_gradients_and_optimizer():
    from mesh3d.plan import make_plan

    full = make_plan(_cfg())
    ours = make_plan(_cfg("mesh3d.lora={r: 4, target_modules: all-linear}"))
    adapters = sum(4 * (o + i) for o, i in lora_plan_of(_cfg(
        "mesh3d.lora={r: 4, target_modules: all-linear}")).shapes.values())  # fmt: skip
    assert ours.trainable_params == adapters and ours.total_params == full.total_params
    r, f = ours.ranks[0], full.ranks[0]
    assert r.grad_bytes == adapters * 4 < f.grad_bytes / 10  # fp32 masters: 4 B each
    assert r.optimizer_bytes < f.optimizer_bytes / 10
    assert r.param_bytes == f.param_bytes + adapters * 4


@pytest.mark.parametrize(
    "override, words",
    [
        ("mesh3d.lora={target_modules: [qkv]}", ["`mesh3d.lora.target_modules`", "matches no projection", "q_proj"]),
        ("mesh3d.lora={target_modules: q_proj}", ["'q_proj' matches no projection", "a regular expression over the whole module name", "e.g. [q_proj]"]),
        ("mesh3d.lora={target_modules: [q_proj, c_fc]}", ["entries ['c_fc'] match no projection"]),
        ("mesh3d.lora={target_modules: 'layers\\.(9'}", ["not a valid regular expression"]),
        ("mesh3d.lora={r: 200, target_modules: [q_proj]}", ["`mesh3d.lora.r` 200 is larger than", "64 x 64", "r <= 64"]),
        ("mesh3d.lora={r: 0}", ["`mesh3d.lora.r` must be >= 1"]),
        ("mesh3d.lora={lora_dropout: 0.1}", ["`mesh3d.lora.lora_dropout` 0.1", "set it to 0"]),
        ("mesh3d.lora={lora_alpha: -1}", ["`mesh3d.lora.lora_alpha` must be a finite number > 0"]),
    ],
)  # fmt: skip
def test_bad_lora_settings_are_named(override, words):
    errors = _errors(override)
    assert len(errors) == 1, errors
    assert all(w in errors[0] for w in words), errors[0]


def test_a_family_without_adapters_is_refused():
    from pathlib import Path

    from mesh3d.config import load_config

    example = Path(__file__).parents[1] / "configs" / "nanotron_mamba_example.yaml"
    errors = validation_errors(load_config(example, ["mesh3d.lora={}"]))
    assert errors == [
        "`mesh3d.lora` with the mamba family is not supported yet; train it without adapters"
    ]


def test_lora_with_float8_is_refused():
    errors = _errors("mesh3d.lora={}", "mesh3d.float8=true")
    assert any("`mesh3d.lora` with `mesh3d.float8: true`" in e for e in errors), errors


def test_the_base_fingerprint_samples_every_quarter_mib_past_the_first_mib(tmp_path):
    base = tmp_path / "base"
    (base / "model").mkdir(parents=True)
    data = bytearray(3 << 20)
    (base / "model" / "w.safetensors").write_bytes(data)
    before = lora.folder_fingerprint(base)
    data[(2 << 20) + (1 << 18) + 100] = 1  # deep in the file, in a sampled block
    (base / "model" / "w.safetensors").write_bytes(data)
    after = lora.folder_fingerprint(base)
    assert after["sha256"] == before["sha256"] and after["weights"] != before["weights"]


def test_a_checkpoint_for_another_or_a_missing_base_is_refused(tmp_path):
    base = tmp_path / "base"
    (base / "model").mkdir(parents=True)
    (base / "model" / "w.safetensors").write_bytes(b"x" * 10)
    cfg = _cfg(f"model.init_method={{path: {base}}}")
    saved = lora.base_fingerprint(cfg)
    lora.check_base(saved, cfg, "ckpt/4")  # the same base: accepted
    other = _cfg("model.init_method={std: 0.05}")
    with pytest.raises(
        UserError, match=r"ckpt/4 holds LoRA adapters for base .* set model.init_method"
    ):
        lora.check_base(saved, other, "ckpt/4")
    (base / "model" / "w.safetensors").write_bytes(b"y" * 10)  # re-exported: same size
    with pytest.raises(UserError, match="holds LoRA adapters for base"):
        lora.check_base(saved, cfg, "ckpt/4")  # before: accepted (names and sizes only)
    older = {k: v for k, v in saved.items() if k != "weights"}  # a checkpoint of before
    lora.check_base(older, cfg, "ckpt/4")  # compared on what it holds: the size is the same
    (base / "model" / "w.safetensors").write_bytes(b"x" * 11)  # the size changed
    for fingerprint in (saved, older):
        with pytest.raises(UserError, match="holds LoRA adapters for base"):
            lora.check_base(fingerprint, cfg, "ckpt/4")
    moved = tmp_path / "moved"
    base.rename(moved)
    with pytest.raises(UserError, match="its LoRA base checkpoint .* is missing; restore it"):
        lora.check_base(saved, cfg, "ckpt/4")


def test_to_peft_refuses_an_output_it_cannot_write_before_reading_anything(tmp_path):
    """A FileExistsError / FileNotFoundError traceback before, after the adapters were read."""
    from mesh3d.checkpoint.lora_files import write_peft

    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match=r"`--output` .*afile: cannot write there .*a file is"):
        write_peft(tmp_path / "no-step", tmp_path / "afile")
    with pytest.raises(UserError, match=r"`--output` /proc/adapter: cannot write there"):
        write_peft(tmp_path / "no-step", Path("/proc/adapter"))
