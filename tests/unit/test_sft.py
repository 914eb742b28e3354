"""SFT data (`mesh3d/data/sft.py`): Nanotron's prompt/completion examples, labels on the
completion only, positions per example, packing, truncation, and the refusals of bad input.
The training runs (loss against transformers, layout parity) are in ranks/test_sft_ranks.py."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from data_fixtures import make_tokenizer
from parity import TINY

from mesh3d.checks.validate import validation_errors
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.config.schema import SFTDatasetsArgs
from mesh3d.data.documents import IGNORE
from mesh3d.data.sft import build_sequences, load_sft_dataset, pack
from mesh3d.data.tokenize import load_tokenizer
from mesh3d.errors import UserError

SEQ = 32


def arithmetic(n: int, start: int = 0) -> list[dict]:
    return [
        {"prompt": f"Q: {i}+{2 * i}=", "completion": f" {3 * i}"} for i in range(start, start + n)
    ]


def write_jsonl(path, rows: list[dict]):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return str(make_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300).parent)


def _rows(examples: list[dict]):
    import datasets

    return datasets.Dataset.from_list(examples)


def test_labels_cover_the_completion_and_eos_only(tok):
    t = load_tokenizer(tok)
    eos = t.token_to_id("</s>")
    ex = {"prompt": "Q: 12+24=", "completion": " 36"}
    seqs, real, kept, skipped = build_sequences(_rows([ex]), tok, SEQ, 0, False, None, "t")
    full = t.encode(ex["prompt"] + ex["completion"]).ids + [eos]
    p = len(t.encode(ex["prompt"]).ids)
    inputs, labels, positions = (torch.from_numpy(seqs[0, k]) for k in range(3))
    n = len(full) - 1
    assert (kept, skipped, real) == (1, 0, n)
    assert inputs[:n].tolist() == full[:-1]
    assert labels[: p - 1].eq(IGNORE).all()  # targets inside the prompt: not trained
    assert labels[p - 1 : n].tolist() == full[p:]  # completion tokens and the EOS
    assert labels[n:].eq(IGNORE).all()  # padding
    assert positions[:n].tolist() == list(range(n))
    assert positions[n:].tolist() == list(range(SEQ - n))  # padding: its own segment


def test_packing_restarts_positions_and_keeps_every_label(tok):
    examples = arithmetic(12)
    packed, real_p, _, _ = build_sequences(_rows(examples), tok, SEQ, 0, True, None, "t")
    single, real_s, _, _ = build_sequences(_rows(examples), tok, SEQ, 0, False, None, "t")
    assert real_p == real_s and len(single) == 12 and len(packed) < len(single)
    # the same trained targets, only placed differently
    trained = lambda s: sorted(s[:, 1][s[:, 1] != IGNORE].tolist())  # noqa: E731
    assert trained(packed) == trained(single)
    assert real_p / packed[:, 0].size > real_s / single[:, 0].size  # better token efficiency


def test_pack_fills_greedily():
    ex = lambda n: ([1] * n, [5] * n, list(range(n)))  # noqa: E731
    out = pack([ex(3), ex(4), ex(2), ex(5), ex(5)], 8, 0, True)
    assert out.shape == (3, 3, 8)
    assert out[0, 2].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]  # 3 + 4, one pad
    assert out[1, 2].tolist() == [0, 1, 0, 1, 2, 3, 4, 0]  # 2 + 5
    assert out[2, 0].tolist() == [1] * 5 + [0] * 3  # padding: the pad id
    assert out[2, 1].tolist() == [5] * 5 + [IGNORE] * 3  # never trained
    assert out[2, 2].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    alone = pack([ex(3), ex(4)], 8, 0, False)  # without packing: one example per sequence
    assert alone.shape == (2, 3, 8) and alone[0, 2].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


def test_truncation_cuts_the_end(tok):
    t = load_tokenizer(tok)
    ex = {"prompt": "Q: 1+2=", "completion": " three " * 40}
    seqs, real, _, _ = build_sequences(_rows([ex]), tok, SEQ, 0, False, None, "t")
    full = t.encode(ex["prompt"] + ex["completion"]).ids
    assert real == SEQ  # S + 1 tokens kept: inputs fill the sequence
    assert seqs[0, 0].tolist() == full[:SEQ]
    assert seqs[0, 1].tolist()[-1] == full[SEQ]  # no EOS: it was cut with the tail


def test_prompt_filling_the_sequence_is_counted_and_skipped(tok, caplog):
    long = {"prompt": "word " * 200, "completion": " x"}
    with caplog.at_level(logging.WARNING, logger="mesh3d"):
        logging.getLogger("mesh3d").propagate = True
        seqs, _, kept, skipped = build_sequences(
            _rows([long] + arithmetic(3)), tok, SEQ, 0, False, None, "stage"
        )
    assert (kept, skipped, len(seqs)) == (3, 1, 3)
    assert "1 of 4 SFT examples" in caplog.text
    with pytest.raises(UserError, match="none of the 1 SFT examples"):
        build_sequences(_rows([long]), tok, SEQ, 0, False, None, "stage")


def test_missing_columns_name_found_and_needed(tok):
    with pytest.raises(UserError) as e:
        build_sequences(_rows([{"question": "a", "answer": "b"}]), tok, SEQ, 0, True, None, "s")
    msg = str(e.value)
    assert "\n" not in msg
    assert "'question', 'answer'" in msg and "'prompt' and 'completion'" in msg


def test_debug_max_samples_keeps_the_first_rows(tok):
    _, real, kept, _ = build_sequences(_rows(arithmetic(10)), tok, SEQ, 0, True, 4, "t")
    _, real4, _, _ = build_sequences(_rows(arithmetic(4)), tok, SEQ, 0, True, None, "t")
    assert kept == 4 and real == real4


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "save_to_disk"])
def test_local_files_load(tok, tmp_path, kind):
    import datasets

    rows = arithmetic(6)
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", rows)
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif kind == "arrow":
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "s"))
        path = next((tmp_path / "s").glob("*.arrow"))
    else:
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(path))
    args = SFTDatasetsArgs(hf_dataset_or_datasets=str(path))
    ds = load_sft_dataset(args, tok, SEQ, 1, 10, 300, cache_dir=str(tmp_path / "cache"))
    inputs, labels, positions = ds[9]  # past the first epoch: repeated
    assert inputs.shape == labels.shape == positions.shape == (SEQ,)
    assert 0 < ds.token_efficiency <= 1
    assert (labels != IGNORE).any()


def test_hub_id_fails_with_one_line(tok):
    args = SFTDatasetsArgs(hf_dataset_or_datasets="someone/some-sft-set")
    with pytest.raises(UserError) as e:
        load_sft_dataset(args, tok, SEQ, 1, 10, 300)
    assert "\n" not in str(e.value) and "not a local file or folder" in str(e.value)


def _cfg(tok, data, *more):
    stage = (f"data_stages=[{{name: sft, start_training_step: 1, data: {{seed: 3, dataset: "
             f"{{hf_dataset_or_datasets: {data}, sft_dataloader: true, debug_max_samples: 50}}}}}}]")  # fmt: skip
    return apply_overrides(config_from_dict(copy.deepcopy(TINY)), [
        f"tokenizer.tokenizer_name_or_path={tok}", stage, *more])  # fmt: skip


def test_sft_config_is_accepted(tok, tmp_path):
    cfg = _cfg(tok, write_jsonl(tmp_path / "d.jsonl", arithmetic(8)))
    assert type(cfg.data_stages[0].data.dataset) is SFTDatasetsArgs
    assert cfg.mesh3d.sft_packing is True
    assert not [e for e in validation_errors(cfg, 1) if "SFT" in e or "not supported" in e]


def test_sft_validation_holds_out_the_last_sequences(tok, tmp_path):
    """Validation on SFT data is accepted: the last limit_val_batches x GBS packed sequences are
    held out of training (the loss test is tests/ranks/test_sft_ranks.py); too few sequences to
    train on as well is one clear line."""
    from mesh3d.data.build import build_dataset
    from mesh3d.data.validation import held_out

    data = write_jsonl(tmp_path / "d.jsonl", arithmetic(30))
    v = ("model.model_config.vocab_size=300", "tokens.micro_batch_size=1",
         "tokens.batch_accumulation_per_replica=2")  # fmt: skip
    val = (*v, "tokens.val_check_interval=2", "tokens.limit_val_batches=1")
    cfg = _cfg(tok, data, *val)
    assert not [e for e in validation_errors(cfg, 1) if "SFT" in e or "not supported" in e]
    plain = build_dataset(_cfg(tok, data, *v), 0)
    ds = build_dataset(cfg, 0)
    gbs = len(ds.held)
    assert gbs == 2 and ds.epoch_len == plain.epoch_len - gbs
    assert (ds.held == plain.sequences[-gbs:]).all()
    assert (ds.sequences == plain.sequences[:-gbs]).all()
    held = held_out(cfg, [ds], [gbs])
    assert len(held) == gbs and all(torch.equal(a, b) for a, b in zip(held[0], ds.held_sample(0)))
    with pytest.raises(UserError, match="holds out .* fewer than one global batch"):
        build_dataset(_cfg(tok, data, *v, "tokens.val_check_interval=2",
                           f"tokens.limit_val_batches={plain.epoch_len // 2}"), 0)  # fmt: skip


# --- chat data (`messages`) ----------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Q: 2+3="},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Q: 4+4="},
    {"role": "assistant", "content": "8"},
]


@pytest.fixture(scope="module")
def chat_tok(tok, tmp_path_factory):
    """The test tokenizer with ChatML's <|im_start|> and <|im_end|> added."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(f"{tok}/tokenizer.json")
    t.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    folder = tmp_path_factory.mktemp("chat_tok")
    t.save(str(folder / "tokenizer.json"))
    return str(folder)


def _trained_text(seqs, tok_dir) -> str:
    t = load_tokenizer(tok_dir)
    labels = seqs[:, 1][seqs[:, 1] != IGNORE].tolist()
    return t.decode(labels, skip_special_tokens=False)


@pytest.mark.parametrize("turns, expected", [("all", "5<|im_end|>\n8<|im_end|>\n"),
                                             ("last", "8<|im_end|>\n")])  # fmt: skip
def test_chat_trains_assistant_turns_only(chat_tok, turns, expected):
    seqs, _, kept, _ = build_sequences(
        _rows([{"messages": CHAT}]), chat_tok, 160, 0, False, None, "t", turns
    )
    assert kept == 1
    assert _trained_text(seqs, chat_tok) == expected
    t = load_tokenizer(chat_tok)  # the whole conversation, rendered as ChatML, is the input
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT)
    ids = t.encode(text, add_special_tokens=False).ids
    assert seqs[0, 0, : len(ids) - 1].tolist() == ids[:-1]


def test_chat_template_from_tokenizer_config(tok, tmp_path):
    import shutil

    shutil.copy(f"{tok}/tokenizer.json", tmp_path / "tokenizer.json")
    template = (
        "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant: {% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    seqs, _, _, _ = build_sequences(_rows([{"messages": CHAT}]), str(tmp_path), 160, 0, False,
                                    None, "t")  # fmt: skip
    assert _trained_text(seqs, str(tmp_path)) == "5\n8\n"


def test_chat_without_template_is_refused(tok):
    with pytest.raises(UserError) as e:
        build_sequences(_rows([{"messages": CHAT}]), tok, 64, 0, False, None, "stage")
    msg = str(e.value)
    assert "\n" not in msg and "no chat template" in msg and "'prompt' and 'completion'" in msg


def test_chat_rows_must_be_messages(chat_tok):
    with pytest.raises(UserError, match="row 1 of the 'messages' column"):
        build_sequences(_rows([{"messages": ["hi"]}]), chat_tok, 64, 0, False, None, "t")


GOOD = json.dumps({"prompt": "Q: 1+2=", "completion": " 3"}).encode()
CHAT_ROW = json.dumps({"messages": CHAT}).encode()
BAD_ROWS = {  # file lines -> what the one line says (besides the file and the row)
    "numbers": ([GOOD, b'{"prompt": 5, "completion": 7}'], "row 2: 'prompt' is int 5, not text"),
    "all numbers": ([b'{"prompt": 5, "completion": 7}'], "row 1: 'prompt' is int 5"),
    "not utf-8": ([GOOD, b'{"prompt": "a\xff", "completion": "b"}'], "row 2 holds bytes that are not UTF-8"),
    "no messages": ([CHAT_ROW, b'{"messages": []}'], "row 2 of the 'messages' column is an empty list"),
    "no assistant": ([json.dumps({"messages": CHAT[:2]}).encode()] * 3,
                     "none of the 3 conversations has an assistant turn"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_rows_are_one_line_naming_file_and_row(chat_tok, tmp_path, case):
    """Rows that ended in a TypeError, UnicodeDecodeError or the template's ValueError, and chat
    data without any assistant turn (was blamed on the sequence length)."""
    lines, says = BAD_ROWS[case]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    args = SFTDatasetsArgs(hf_dataset_or_datasets=str(path))
    with pytest.raises(UserError) as e:
        load_sft_dataset(args, chat_tok, SEQ, 1, 10, 400, where="data_stages[0] ('sft')",
                         cache_dir=str(tmp_path / "cache"))  # fmt: skip
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and says in msg, msg
    assert "sequence_length" not in msg, msg
