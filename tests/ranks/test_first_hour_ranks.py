"""A new user's first hour, end to end: a Hugging Face folder (weights + tokenizer) -> `from-hf`
-> its config.yaml trains as is -> the step folder keeps the tokenizer (in the manifest) ->
`mesh3d generate` and `to-hf` on the checkpoints folder (the tokenizer comes along); plus the
defaults of that config, the log line of `init_method.path`, and which tokenizer files are
copied.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_first_hour.py`."""

from __future__ import annotations

import pytest
from dist import run_ranks
from test_first_hour import _recipe, hf_folder, transformers

from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.folder import read_manifest, verify
from mesh3d.config import load_config
from mesh3d.generate import main as generate_main

TOKENIZER_FILES = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def train_as_is(rank: int, world: int, config: str) -> list[float]:
    from mesh3d.train.loop import train

    res = train(load_config(config))  # as is: 100 steps
    return [m["lm_loss"] for m in res.metrics]


def test_hf_to_training_to_generate_to_hf(tmp_path, capsys):
    hf = hf_folder(tmp_path / "hf")
    convert.from_hf(hf, tmp_path / "nt")
    (losses,) = run_ranks(1, train_as_is, str(tmp_path / "nt" / "config.yaml"), timeout=240)
    assert len(losses) == 100 and all(x == x for x in losses)

    root = tmp_path / "nt" / "checkpoints"
    step = root / "100"
    assert (root / "latest.txt").read_text().strip() == "100"
    saved = sorted(p.name for p in (step / "tokenizer").iterdir())
    assert saved == TOKENIZER_FILES
    for name in saved:
        assert (step / "tokenizer" / name).read_bytes() == (hf / name).read_bytes()
    manifest = read_manifest(step)
    assert {f"tokenizer/{n}" for n in saved} <= set(manifest) and verify(step) == []

    # generate from the checkpoints folder (latest.txt), with the tokenizer saved in it
    try:
        generate_main(["--checkpoint", str(root), "--prompt", "The cat", "--max-new-tokens", "5"])
    except SystemExit as e:
        pytest.fail(f"exit {e.code}")
    out, err = capsys.readouterr()
    assert out.startswith("The cat") and f"{step / 'tokenizer'} (saved with the checkpoint)" in err

    # to-hf of the checkpoints folder: weights that transformers loads, and the tokenizer
    paths = convert.to_hf(root, tmp_path / "back")
    assert sorted(p.name for p in paths) == sorted(["config.json", "model.safetensors",
                                                    *TOKENIZER_FILES])  # fmt: skip
    assert (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").config.vocab_size
        == 300
    )
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert tok.decode(tok("The cat")["input_ids"]) == "The cat"


def _sft_recipe(rank: int, world: int, output: str) -> tuple[dict, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = _recipe("sft_arithmetic").main(
            ["--output", output, "--steps", "3", "--held-out", "2"]
        )
    return result, out.getvalue()


def test_sft_recipe_says_what_it_does_and_where_its_checkpoint_went(tmp_path):
    """Issue 43: it was silent for two minutes and never named its checkpoint."""
    ((result, out),) = run_ranks(1, _sft_recipe, str(tmp_path / "run"), timeout=240)
    assert f"writing into {tmp_path / 'run'}" in out
    assert "training 3 steps" in out and "step    3 / 3   loss" in out, out
    final = tmp_path / "run" / "checkpoints" / "3"
    assert result["checkpoint"] == final and f"checkpoint   {final}\n" in out, out
    assert f"mesh3d generate --checkpoint {final}" in out
