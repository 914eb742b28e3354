"""`python -m mesh3d.convert`: HF Llama <-> Nanotron layout, bitwise round trip, logits parity
of mesh3d's Llama on converted weights, the interleaved-rotary permutation, CLI errors.

The tests of this subject that launch real processes are in
`tests/launch/test_convert_launch.py`."""

import json

import pytest
import torch
from safetensors.torch import load_file

from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.config import LlamaConfig, load_config
from mesh3d.convert import main as convert_main
from mesh3d.errors import UserError
from mesh3d.models.llama import Llama

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) not installed")

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def hf_llama(path, vocab=128, tied=False, theta=10000.0, scaling=None, kv=2):
    """A tiny random `LlamaForCausalLM` saved to `path` (fp32)."""
    rope = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=kv,
        num_hidden_layers=3,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else 0.05
            p.copy_((1 if name.endswith("norm.weight") else 0) + scale * torch.randn_like(p))
    model.save_pretrained(path)
    model.config._attn_implementation = "eager"
    return model


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_bitwise(tmp_path, tied):
    hf_llama(tmp_path / "hf", tied=tied)
    paths = convert.from_hf(tmp_path / "hf", tmp_path / "nt", tp=2, pp=2)
    assert any("pp-rank-1-of-2_tp-rank-1-of-2" in p.name for p in paths)
    convert.to_hf(tmp_path / "nt", tmp_path / "back")
    a = load_file(tmp_path / "hf" / "model.safetensors")
    b = load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    cfg = load_config(tmp_path / "nt" / "config.yaml")
    assert cfg.model.init_method.path == str((tmp_path / "nt").resolve())
    assert cfg.model.model_config.tie_word_embeddings is tied
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back")
    assert back.config.tie_word_embeddings is tied


CASES = {
    "gqa_untied_padded_vocab": dict(vocab=101),
    "tied": dict(tied=True, kv=4),
    "llama3_scaling": dict(theta=500000.0, scaling=LLAMA3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mesh3d_logits_match_hf_after_from_hf(tmp_path, case):
    kw = CASES[case]
    hf = hf_llama(tmp_path / "hf", **kw)
    convert.from_hf(tmp_path / "hf", tmp_path / "nt", tp=2, pp=2)
    mc = LlamaConfig(**json.loads((tmp_path / "nt" / "model_config.json").read_text()))
    assert mc.rope_scaling == kw.get("scaling")
    full = read_nanotron_weights(tmp_path / "nt" / "model", convert.shape_of(mc))
    ours = Llama(mc, attention="sdpa").eval()
    missing, unexpected = ours.load_state_dict(full, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    vocab = kw.get("vocab", 128)
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert got.shape[-1] == mc.vocab_size >= vocab
    err = rel_err(got[..., :vocab], expected)
    print(f"{case}: max relative error {err:.2e}")
    assert err <= 1e-5


def test_interleaved_checkpoint_to_hf_matches(tmp_path):
    """A model trained with rope_interleaved: true computes the same in HF after to-hf."""
    hf_llama(tmp_path / "hf")
    convert.from_hf(tmp_path / "hf", tmp_path / "nt", tp=1, pp=1)
    mcj = tmp_path / "nt" / "model_config.json"
    d = json.loads(mcj.read_text())
    d["rope_interleaved"] = True
    mcj.write_text(json.dumps(d))
    mc = LlamaConfig(**d)
    ours = Llama(mc, attention="sdpa").eval()
    ours.load_state_dict(read_nanotron_weights(tmp_path / "nt" / "model", convert.shape_of(mc)))
    convert.to_hf(tmp_path / "nt", tmp_path / "back")
    hf = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager"
    )
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) <= 1e-5


def test_transformers4_config_and_user_errors(tmp_path):
    hf_llama(tmp_path / "hf", theta=500000.0, scaling=LLAMA3)
    path = tmp_path / "hf" / "config.json"
    d = json.loads(path.read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = rope
    path.write_text(json.dumps(d))
    convert.from_hf(tmp_path / "hf", tmp_path / "nt")
    mc = json.loads((tmp_path / "nt" / "model_config.json").read_text())
    assert mc["rope_theta"] == 500000.0 and mc["rope_scaling"] == LLAMA3
    path.write_text(json.dumps(dict(d, rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    with pytest.raises(UserError, match="'yarn'.*not supported"):
        convert.from_hf(tmp_path / "hf", tmp_path / "nt2")
    path.write_text(json.dumps(dict(d, model_type="gpt2")))
    with pytest.raises(
        UserError, match="model_type 'gpt2'.*is not a family mesh3d converts; supported: llama"
    ):
        convert.from_hf(tmp_path / "hf", tmp_path / "nt3")


def test_from_hf_names_bad_sizes_a_file_and_an_unwritable_output(tmp_path):
    """Tracebacks before: TypeError / ZeroDivisionError from a config.json's sizes,
    NotADirectoryError from an --output that is a file; `--model FILE` said 'does not exist'."""
    hf_llama(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    good = json.loads(path.read_text())
    for key, value in (("hidden_size", "abc"), ("num_attention_heads", 0),
                       ("num_hidden_layers", -1)):  # fmt: skip
        path.write_text(json.dumps(dict(good, **{key: value})))
        with pytest.raises(UserError, match=f"config.json: {key} {value!r} must be a whole"):
            convert.from_hf(tmp_path / "hf", tmp_path / "nt")
    path.write_text(json.dumps(good))
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match="`--output` .*afile: cannot write there .*a file is"):
        convert.from_hf(tmp_path / "hf", tmp_path / "afile")
    with pytest.raises(UserError, match="--model .*afile is a file, not a folder"):
        convert.from_hf(tmp_path / "afile", tmp_path / "nt")
    with pytest.raises(UserError, match="--checkpoint .*afile is a file, not a folder"):
        convert.to_hf(tmp_path / "afile", tmp_path / "out")
    assert not (tmp_path / "nt").exists() and not (tmp_path / "out").exists()


def test_from_hf_says_a_command_that_trains_from_any_folder(tmp_path, capsys, monkeypatch):
    """from-hf printed `torchrun ... recipes/train.py --config-file ...`, which fails outside a
    clone (no recipes/ there); it now names `mesh3d train CONFIG` (a fresh clone's second hour),
    and the config it names exists."""
    hf_llama(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    convert_main(["from-hf", "--model", "hf", "--output", "nt", "--tp", "2"])
    line = capsys.readouterr().out.splitlines()[-1]
    config = tmp_path / "nt" / "config.yaml"
    assert (
        line == f"train from it: mesh3d train {config.resolve()}  (starts its 2 processes itself)"
    )
    assert config.is_file() and "recipes/train.py" not in line
    convert_main(["to-hf", "--checkpoint", "nt", "--output", "back"])  # from-hf's folder back
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "wrote 2 files under back from nt:", first  # the folder it read named


def test_converting_or_generating_from_damaged_files_is_refused(tmp_path, capsys):
    """`convert to-hf` and one-process `generate` read a step folder's weights without the
    manifest check training's loading does: a file damaged on disk (same size, other bytes)
    was exported or sampled from. Now both stop at the manifest's `failed verification` line."""
    from mesh3d.checkpoint.folder import crc32_of, write_manifest
    from mesh3d.data.synthetic import make_tokenizer
    from mesh3d.generate import main as generate_main

    hf_llama(tmp_path / "hf")
    step = tmp_path / "nt"
    convert.from_hf(tmp_path / "hf", step)
    make_tokenizer(step / "tokenizer", vocab_size=128)
    weights = sorted((step / "model").rglob("*.safetensors"))
    write_manifest(step, {p.relative_to(step).as_posix(): crc32_of(p) for p in weights})
    convert.to_hf(step, tmp_path / "ok")  # the files match their manifest: exported
    data = bytearray(weights[0].read_bytes())
    data[-1] ^= 0xFF
    weights[0].write_bytes(data)
    with pytest.raises(UserError, match=r"checkpoint .*nt failed verification: .* is damaged"):
        convert.to_hf(step, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as e:
        generate_main(["--checkpoint", str(step), "--prompt", "a", "--max-new-tokens", "2",
                       "--device", "cpu"])  # fmt: skip
    assert e.value.code == 2 and "failed verification" in capsys.readouterr().err
