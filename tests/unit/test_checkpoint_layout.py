"""Nanotron weight files: the tree and metadata of a tiny 2x2 checkpoint, written by hand from
docs/nanotron-layout.md (checkpoints, tensor-parallel splits), round trips across TP/PP layouts, and
the errors for damaged checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from nanotron_fixtures import FIXTURES, needs_fixtures
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mesh3d.checkpoint import read_nanotron_weights, write_nanotron_weights
from mesh3d.errors import UserError
from mesh3d.models.spec import ModelShape

REPO = Path(__file__).resolve().parents[2]

# hidden 16, ffn 64, 4 heads (dh 4), 4 kv heads, 2 layers, padded vocab 256
TINY = dict(
    num_layers=2,
    hidden_size=16,
    intermediate_size=64,
    num_heads=4,
    num_kv_heads=4,
    padded_vocab=256,
)

ALL = "None,None,None|None,None,None"
EMB = "model/token_position_embeddings/pp_block/token_embedding/model_weight_pp-rank-0-of-2_tp-rank-{t}-of-2.safetensors"
LAYER = "model/decoder/{i}/pp_block/"
SHARDED = "model_weight_pp-rank-0-of-2_tp-rank-{t}-of-2.safetensors"
# Per file: (shape of `data`, unsharded_shape, local_global_slices_pairs); None = replicated (no metadata).
EXPECTED_2x2 = {
    EMB.format(t=0): ((128, 16), "(256, 16)", f"{ALL}#0,128,None|None,None,None"),
    EMB.format(t=1): ((128, 16), "(256, 16)", f"{ALL}#128,256,None|None,None,None"),
    "model/final_layer_norm/pp_block/model_weight.safetensors": ((16,), None, None),
}
for _i in (0, 1):
    _d = LAYER.format(i=_i)
    EXPECTED_2x2.update(
        {
            _d + "input_layernorm/model_weight.safetensors": ((16,), None, None),
            _d + "post_attention_layernorm/model_weight.safetensors": ((16,), None, None),
            _d + "attn/qkv_proj/" + SHARDED.format(t=0): (
                (24, 16),
                "(48, 16)",
                "0,8,None|None,None,None#0,8,None|None,None,None;"
                "8,16,None|None,None,None#16,24,None|None,None,None;"
                "16,24,None|None,None,None#32,40,None|None,None,None",
            ),
            _d + "attn/qkv_proj/" + SHARDED.format(t=1): (
                (24, 16),
                "(48, 16)",
                "0,8,None|None,None,None#8,16,None|None,None,None;"
                "8,16,None|None,None,None#24,32,None|None,None,None;"
                "16,24,None|None,None,None#40,48,None|None,None,None",
            ),
            _d + "attn/o_proj/" + SHARDED.format(t=0): (
                (16, 8),
                "(16, 16)",
                f"{ALL}#None,None,None|0,8,None",
            ),
            _d + "attn/o_proj/" + SHARDED.format(t=1): (
                (16, 8),
                "(16, 16)",
                f"{ALL}#None,None,None|8,16,None",
            ),
            _d + "mlp/gate_up_proj/" + SHARDED.format(t=0): (
                (64, 16),
                "(128, 16)",
                "0,32,None|None,None,None#0,32,None|None,None,None;32,64,None|None,None,None#64,96,None|None,None,None",
            ),
            _d + "mlp/gate_up_proj/" + SHARDED.format(t=1): (
                (64, 16),
                "(128, 16)",
                "0,32,None|None,None,None#32,64,None|None,None,None;32,64,None|None,None,None#96,128,None|None,None,None",
            ),
            _d + "mlp/down_proj/" + SHARDED.format(t=0): (
                (16, 32),
                "(16, 64)",
                f"{ALL}#None,None,None|0,32,None",
            ),
            _d + "mlp/down_proj/" + SHARDED.format(t=1): (
                (16, 32),
                "(16, 64)",
                f"{ALL}#None,None,None|32,64,None",
            ),
        }
    )
LM_HEAD_2x2 = {
    f"model/lm_head/pp_block/model_weight_pp-rank-1-of-2_tp-rank-{t}-of-2.safetensors": (
        (128, 16),
        "(256, 16)",
        f"{ALL}#{128 * t},{128 * (t + 1)},None|None,None,None",
    )
    for t in (0, 1)
}


def full_weights(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, f, dh = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_heads * dh, shape.num_kv_heads * dh
    full = {
        "embed_tokens.weight": torch.randn(shape.padded_vocab, h, generator=g),
        "norm.weight": torch.randn(h, generator=g),
    }
    if not shape.tied:
        full["lm_head.weight"] = torch.randn(shape.padded_vocab, h, generator=g)
    for i in range(shape.num_layers):
        for name, size in {
            "input_layernorm": (h,),
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "post_attention_layernorm": (h,),
            "mlp.gate_proj": (f, h),
            "mlp.up_proj": (f, h),
            "mlp.down_proj": (h, f),
        }.items():
            full[f"layers.{i}.{name}.weight"] = torch.randn(*size, generator=g)
    return full


def listing(root) -> dict[str, tuple]:
    out = {}
    for path in sorted(root.rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            assert list(f.keys()) == ["data"]
            meta = f.metadata() or {}
            out[path.relative_to(root).as_posix()] = (
                tuple(f.get_tensor("data").shape),
                meta.get("unsharded_shape"),
                meta.get("local_global_slices_pairs"),
            )
            assert set(meta) == (
                set()
                if "pp-rank" not in path.name
                else {"version", "unsharded_shape", "local_global_slices_pairs"}
            )
            assert meta.get("version", "1.4") == "1.4"
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_2x2_tree_and_metadata(tmp_path, tied):
    shape = ModelShape(**TINY, tied=tied)
    full = full_weights(shape)
    write_nanotron_weights(tmp_path, full, shape, tp=2, pp=2)
    expected = EXPECTED_2x2 if tied else {**EXPECTED_2x2, **LM_HEAD_2x2}
    assert listing(tmp_path) == expected
    # qkv of tp rank 1 holds its half of Q, then of K, then of V.
    qkv1 = load_file(tmp_path / (LAYER.format(i=1) + "attn/qkv_proj/" + SHARDED.format(t=1)))[
        "data"
    ]
    p = "layers.1.self_attn."
    want = torch.cat(
        [
            full[p + "q_proj.weight"][8:16],
            full[p + "k_proj.weight"][8:16],
            full[p + "v_proj.weight"][8:16],
        ]
    )
    assert torch.equal(qkv1, want)
    up0 = load_file(tmp_path / (LAYER.format(i=0) + "mlp/gate_up_proj/" + SHARDED.format(t=0)))[
        "data"
    ]
    assert torch.equal(up0[32:], full["layers.0.mlp.up_proj.weight"][:32])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_round_trip_any_layout(tmp_path, tied, kv_heads):
    shape = ModelShape(**{**TINY, "num_kv_heads": kv_heads}, tied=tied)
    full = full_weights(shape, seed=kv_heads)
    for tp, pp in [(2, 2), (1, 1), (4, 1), (2, 1), (1, 2)]:
        if kv_heads % tp:
            continue
        root = tmp_path / f"tp{tp}_pp{pp}"
        write_nanotron_weights(root, full, shape, tp=tp, pp=pp)
        back = read_nanotron_weights(root, shape)
        assert back.keys() == full.keys()
        for k, v in full.items():
            assert torch.equal(back[k], v), (tp, pp, k)


def test_bf16_and_numpy2_shape_strings(tmp_path):
    shape = ModelShape(**TINY, tied=True)
    full = {k: v.bfloat16() for k, v in full_weights(shape).items()}
    write_nanotron_weights(tmp_path, full, shape, tp=2, pp=2)
    path = tmp_path / (LAYER.format(i=0) + "attn/qkv_proj/" + SHARDED.format(t=0))
    rewrite(path, unsharded_shape="(np.int64(48), np.int64(16))")
    back = read_nanotron_weights(tmp_path, shape)
    assert all(torch.equal(back[k], v) and back[k].dtype == torch.bfloat16 for k, v in full.items())


def rewrite(path, **meta_changes):
    with safe_open(str(path), framework="pt") as f:
        meta = {**f.metadata(), **meta_changes}
    save_file(load_file(path), str(path), metadata=meta)


@pytest.fixture
def tiny_ckpt(tmp_path):
    shape = ModelShape(**TINY, tied=False)
    write_nanotron_weights(tmp_path, full_weights(shape), shape, tp=2, pp=2)
    return tmp_path, shape


def test_missing_shard_is_named(tiny_ckpt):
    root, shape = tiny_ckpt
    rel = LAYER.format(i=1) + "mlp/down_proj/" + SHARDED.format(t=1)
    (root / rel).unlink()
    with pytest.raises(UserError, match=f"missing shard .*{rel}"):
        read_nanotron_weights(root, shape)


def test_missing_norm_and_lm_head(tiny_ckpt):
    root, shape = tiny_ckpt
    for f in (root / "model/lm_head/pp_block").iterdir():
        f.unlink()
    with pytest.raises(
        UserError, match="missing weights of model.lm_head.pp_block.weight.*tie_word_embeddings"
    ):
        read_nanotron_weights(root, shape)
    (root / "model/final_layer_norm/pp_block/model_weight.safetensors").unlink()
    with pytest.raises(UserError, match="final_layer_norm/pp_block/model_weight.safetensors"):
        read_nanotron_weights(root, shape)


def test_truncated_file_is_named(tiny_ckpt):
    root, shape = tiny_ckpt
    rel = LAYER.format(i=0) + "attn/o_proj/" + SHARDED.format(t=0)
    data = (root / rel).read_bytes()
    (root / rel).write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=f"cannot read weight file .*{rel}"):
        read_nanotron_weights(root, shape)


def test_newer_version_is_refused(tiny_ckpt):
    root, shape = tiny_ckpt
    rewrite(root / EMB.format(t=1), version="1.6")
    with pytest.raises(UserError, match=r"version 1\.6, newer than the 1\.5"):
        read_nanotron_weights(root, shape)


def test_head_version_is_read(tiny_ckpt):
    root, shape = tiny_ckpt
    rewrite(root / EMB.format(t=1), version="1.5")
    read_nanotron_weights(root, shape)


def test_shape_mismatch_is_explained(tiny_ckpt):
    root, shape = tiny_ckpt
    with pytest.raises(
        UserError, match=r"full shape \(256, 16\) but the model config gives \(512, 16\)"
    ):
        read_nanotron_weights(root, ModelShape(**{**TINY, "padded_vocab": 512}, tied=False))
    norm = root / "model/final_layer_norm/pp_block/model_weight.safetensors"
    save_file({"data": torch.zeros(32)}, str(norm))
    with pytest.raises(
        UserError,
        match=r"model_weight.safetensors: shape \(32,\) but the model config gives \(16,\)",
    ):
        read_nanotron_weights(root, shape)


@pytest.mark.parametrize("tied", [True, False])
def test_names_are_those_of_our_model(tmp_path, tied):
    from types import SimpleNamespace

    from mesh3d.models.llama import Llama

    shape = ModelShape(**TINY, tied=tied)
    cfg = SimpleNamespace(
        hidden_size=16,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        rope_interleaved=False,
        tie_word_embeddings=tied,
        vocab_size=256,
        hidden_act="silu",
        max_position_embeddings=32,
    )
    model = Llama(cfg, vocab_size=256, attention="sdpa")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_nanotron_weights(tmp_path, state, shape, tp=2, pp=2)
    back = read_nanotron_weights(tmp_path, shape)
    assert set(back) == set(state) - set(model.tied_parameters)
    model.load_state_dict({**state, **back})


@needs_fixtures
def test_model_config_json_key_order_and_padded_vocab():
    from mesh3d.checkpoint import model_config_json
    from mesh3d.config import apply_overrides, load_config

    path = FIXTURES / "classic-config_tiny_llama.yaml"
    cfg = apply_overrides(
        load_config(path),
        [
            "model.model_config.vocab_size=250",
            "parallelism.tp=4",
            "model.make_vocab_size_divisible_by=32",
        ],
    )
    d = model_config_json(cfg)
    assert list(d)[:6] == [
        "bos_token_id",
        "eos_token_id",
        "hidden_act",
        "hidden_size",
        "initializer_range",
        "intermediate_size",
    ]
    assert d["vocab_size"] == 256 and d["tie_word_embeddings"] is True


def test_the_resume_line_says_what_changed_since_the_checkpoint(tmp_path):
    """A fresh clone's second hour: a 1-process checkpoint resumed at dp 2 logged only
    "Resumed from ... at step 30" while the global batch doubled and the random states (restored
    at the same layout only) started fresh; a resume with tokens.train_steps raised moved the
    learning rate (lr_decay_steps follows it) without a word. The line now says all three."""
    import json
    from types import SimpleNamespace

    from mesh3d.checkpoint.resume_notes import resume_change
    from mesh3d.config import DEFAULT_CONFIG, config_to_yaml, load_config
    from mesh3d.mesh import ParallelDims

    batch = ["tokens.micro_batch_size=8", "tokens.batch_accumulation_per_replica=2"]
    saved = load_config(DEFAULT_CONFIG, [*batch, "tokens.train_steps=30"])
    step = tmp_path / "30"
    step.mkdir()
    metas = {"last_train_step": 30, "consumed_train_samples": 480}
    (step / "checkpoint_metadata.json").write_text(json.dumps(
        {"dp": 1, "tp": 1, "cp": 1, "custom_metas": {"pp": 1}, "metas": metas, "version": "1.4"}))  # fmt: skip
    (step / "config.yaml").write_text(config_to_yaml(saved))
    one = SimpleNamespace(dims=ParallelDims(dp=1, tp=1, pp=1), global_batch=16)
    two = SimpleNamespace(dims=ParallelDims(dp=2, tp=1, pp=1), global_batch=32)
    assert resume_change(step, saved, one, 30) == ""
    at_dp2 = load_config(DEFAULT_CONFIG, [*batch, "tokens.train_steps=30", "parallelism.dp=2"])
    moved = resume_change(step, at_dp2, two, 30)
    assert moved == ("saved at dp1 tp1 pp1 cp1, now dp2 tp1 pp1 cp1: the weights and optimizer "
                     "are resharded, the random states start fresh (restored at the same layout "
                     "only); its global batch was 16 samples a step, now 32"), moved  # fmt: skip
    longer = resume_change(
        step, load_config(DEFAULT_CONFIG, [*batch, "tokens.train_steps=50"]), one, 30
    )
    assert longer.startswith("its learning-rate schedule had lr_decay_steps 20 -> 40 ("), longer
    assert longer.endswith("keep the old schedule with optimizer.learning_rate_scheduler."
                           "lr_decay_steps=20"), longer  # fmt: skip
    (step / "config.yaml").unlink()  # written by another tool: no batch or schedule claimed
    plain = resume_change(step, at_dp2, two, 30)
    assert plain.endswith("(restored at the same layout only)"), plain


@pytest.mark.parametrize("override, says", [
    ("parallelism.dp=2", "read 16 samples a step and this run reads 32: its data stages would go on from another sample"),
    ("tokens.batch_accumulation_per_replica=1", "Keep the global batch at 16 (dp x micro_batch_size x batch_accumulation_per_replica: e.g. tokens.batch_accumulation_per_replica=2)"),
    ("tokens.sequence_length=64", "trained data stage 0 ('Stable Training Stage') at sequence_length 128, and this config says 64"),
])  # fmt: skip
def test_a_resume_whose_data_would_not_go_on_where_it_stopped_is_refused(tmp_path, override, says):
    """A map-style stage's samples are read by position (step x global batch): resumed at another
    global batch (dp 2 at the same micro-batches), with a moved stage start or another length,
    the run trained 20 of 28 samples twice (or skipped 40) and said only "its global batch was
    8, now 4". Now refused by the checkpoint's per-stage counts; the same config goes on."""

    import dataclasses

    from mesh3d.checkpoint.resume_notes import check_data_position
    from mesh3d.config import DEFAULT_CONFIG, load_config
    from mesh3d.config.derive import global_batch_size
    from mesh3d.errors import UserError

    batch = ["tokens.micro_batch_size=8", "tokens.batch_accumulation_per_replica=2"]
    cfg = load_config(DEFAULT_CONFIG, batch)
    assert global_batch_size(cfg) == 16 and cfg.tokens.sequence_length == 128
    stage = {"name": "Stable Training Stage", "start_training_step": 1, "sequence_length": 128,
             "consumed_train_samples": 480}  # fmt: skip
    meta = {"metas": {"last_train_step": 30, "consumed_train_samples": 480, "data_stages": [stage]}}
    check_data_position(tmp_path, meta, cfg, 30, 16)  # the same config goes on
    check_data_position(tmp_path, meta, cfg, 0, 16)  # load_lr_scheduler: false starts at 0
    # a fault-tolerant group's: 2 groups read 32 a step, its stage counts its own 16
    groups = {"metas": {**meta["metas"], "consumed_train_samples": 960}}
    check_data_position(tmp_path, groups, cfg, 30, 32)  # resumed by one job reading 32
    changed = load_config(DEFAULT_CONFIG, [*batch, override])
    with pytest.raises(UserError, match=re.escape(says)):
        check_data_position(tmp_path, meta, changed, 30, global_batch_size(changed))
    first = cfg.data_stages[0]
    anneal = dataclasses.replace(first, name="anneal", start_training_step=31, sequence_length=256)
    later = dataclasses.replace(cfg, data_stages=[first, anneal])
    check_data_position(tmp_path, meta, later, 30, 16)  # a stage added after the checkpoint
    moved = dataclasses.replace(anneal, start_training_step=21)  # the boundary moved before it
    with pytest.raises(UserError, match=r"consumed 480 samples .* would have consumed 320"):
        check_data_position(tmp_path, meta, dataclasses.replace(cfg, data_stages=[first, moved]),
                            30, 16)  # fmt: skip


def test_a_hugging_face_folder_given_as_a_checkpoint_names_the_conversion(tmp_path):
    """`mesh3d generate --checkpoint hf_out` on a to-hf folder said only what it is not."""
    from mesh3d.checkpoint.training import resolve_step_dir
    from mesh3d.errors import UserError

    (tmp_path / "hf_out").mkdir()
    with pytest.raises(UserError) as plain:
        resolve_step_dir(tmp_path / "hf_out", "--checkpoint")
    assert "Hugging Face" not in str(plain.value)  # an empty folder: no such claim
    (tmp_path / "hf_out" / "config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        resolve_step_dir(tmp_path / "hf_out", "--checkpoint")
    assert str(e.value).endswith(f"it is a Hugging Face model folder: mesh3d convert from-hf "
                                 f"--model {tmp_path / 'hf_out'} --output FOLDER writes one "
                                 "mesh3d reads"), e.value  # fmt: skip
