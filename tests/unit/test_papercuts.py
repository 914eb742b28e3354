"""Papercuts of a newcomer walkthrough: `convert to-hf` into a used folder, a tie in `plan
--search`, `plan` on one rank, the tokenize tool's file name in docs/data.md, generate's
max_position_embeddings note, sampling at a tiny temperature, a chat jsonl row's error."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.nanotron_weights import write_nanotron_weights
from mesh3d.config import LlamaConfig
from mesh3d.data.synthetic import make_tokenizer
from mesh3d.generate import main as generate_main
from mesh3d.generation.sampling import next_token
from mesh3d.models.registry import spec_of
from mesh3d.plan import main as plan_main
from mesh3d.plan.search import Candidate
from mesh3d.plan.search_report import why_first

ROOT = Path(__file__).resolve().parents[2]
SIZES = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, max_position_embeddings=32, vocab_size=300)  # fmt: skip


def step_of(root: Path, tok: Path, **mc) -> Path:
    """A checkpoints folder (latest.txt -> 1) of a tiny random Llama with the tokenizer `tok`."""
    mc = LlamaConfig(**SIZES, **mc)
    step = root / "1"
    torch.manual_seed(0)
    model = spec_of(mc).build(mc, attention="sdpa")
    write_nanotron_weights(step / "model", model.state_dict(), convert.shape_of(mc), tp=1, pp=1)
    (step / "model_config.json").write_text(json.dumps(dataclasses.asdict(mc)))
    (step / "checkpoint_metadata.json").write_text("{}")
    shutil.copytree(tok, step / "tokenizer")
    (root / "latest.txt").write_text("1")
    return root


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300).parent  # </s> = 2


def test_to_hf_into_a_used_folder_writes_its_own_special_tokens(tmp_path, tok, monkeypatch):
    warned = []
    monkeypatch.setattr("mesh3d.log.logger.warning", warned.append)
    out = tmp_path / "hf"
    first = convert.to_hf(step_of(tmp_path / "a", tok, eos_token_id=2), out)
    assert not warned
    (out / "notes.txt").write_text("mine")
    second = convert.to_hf(step_of(tmp_path / "b", tok, eos_token_id=1, bos_token_id=2), out)
    assert second == first  # every file written, tokenizer_config.json too
    conf = json.loads((out / "tokenizer_config.json").read_text())
    assert (conf["eos_token"], conf["bos_token"]) == ("<s>", "</s>")  # the second model's
    assert len(warned) == 1 and "notes.txt" in warned[0]


def test_to_hf_keeps_the_special_tokens_of_the_tokenizers_own_config(tmp_path, tok):
    own = tmp_path / "tok"
    shutil.copytree(tok, own)
    (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    paths = convert.to_hf(step_of(tmp_path / "a", own), tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert conf["eos_token"] == "<unk>" and conf["bos_token"] == "<s>"
    assert paths.count(tmp_path / "hf" / "tokenizer_config.json") == 1


def candidate(step: float, mbs: int, schedule: str = "1f1b") -> Candidate:
    return Candidate(1, 1, 1, 1, 1, 0, False, False, mbs, 16 // mbs, schedule, 1, memory_gib=1.0,
                     fits=True, step_time_s=step, parts={"compute": step})  # fmt: skip


def test_plan_search_says_a_tie_is_a_tie():
    a, b = candidate(0.00148, 1), candidate(0.0014800001, 2)
    line = why_first(a, b)
    assert "beats" not in line and f"{a.label} ties {b.label}" in line, line
    assert "search's order" in line
    assert "beats" in why_first(a, candidate(0.002, 2))


def test_plan_on_one_rank_says_there_is_no_communication(capsys):
    plan_main([str(ROOT / "recipes/configs/cpu_tiny.yaml")])
    section = capsys.readouterr().out.split("6. Communication per step")[1]
    assert "none: nothing is sent between ranks" in section
    assert "collective" not in section and " send " not in section


def test_docs_name_the_tokenize_tools_file_without_and_with_name():
    text = (ROOT / "docs/data.md").read_text()
    assert "writes `00000_unshuffled.ds` (with `--name NAME`:" in text


def run(capsys, *argv: str) -> tuple[int, str]:
    try:
        generate_main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_max_position_note_only_when_prompt_plus_new_tokens_pass_it(tmp_path, tok, capsys):
    ckpt = str(step_of(tmp_path, tok))  # max_position_embeddings 32
    code, err = run(capsys, "--checkpoint", ckpt, "--prompt", "12+7=", "--max-new-tokens", "4")
    assert code == 0 and "note:" not in err, err
    code, err = run(capsys, "--checkpoint", ckpt, "--prompt", "12+7=", "--max-new-tokens", "30")
    assert code == 0 and "+ --max-new-tokens 30 can go past the 32 tokens" in err, err


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45])
def test_sampling_at_a_tiny_temperature_picks_the_largest(temperature):
    logits = torch.tensor([[1.0, 3.0, 2.0], [-5.0, -4.0, -9.0], [0.0, -1.0, 0.5]])
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, temperature, None, gen).tolist() == [1, 1, 2]
    assert next_token(logits, temperature, 2, gen).tolist() == [1, 1, 2]


def test_chat_jsonl_errors_name_the_files_line(tmp_path, tok, capsys):
    ckpt = str(step_of(tmp_path, tok))
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"messages": "x"}\n')
    code, err = run(capsys, "--checkpoint", ckpt, "--prompts", str(bad))
    assert code == 2 and "row 1 of the 'messages' column is not a list" in err, err
    bad.write_text('{"prompt": "a"}\n\n[1, 2]\n')
    code, err = run(capsys, "--checkpoint", ckpt, "--prompts", str(bad))
    assert code == 2 and "line 3 is not a JSON object" in err and "keys" not in err, err
