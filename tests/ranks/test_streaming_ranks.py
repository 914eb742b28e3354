"""Streamed HF text in whole training runs (`mesh3d.hf_streaming`, 2 loading workers per rank).

A streamed stage's samples depend only on the data config (logical shards, `data/streaming.py`),
so every layout trains on the same stream and a resume at any dp continues it.

One 2-rank launch at dp 2: a run trains 8 steps straight, with a streamed JSON Lines stage at its
own `sequence_length` (32 tokens) then a Nanoset stage at `tokens.sequence_length` (16) from
step 5, each step's samples at its stage's length; a second run saves at steps 3 (mid-stream)
and 6 (after the switch); two more resume from each, and must read the same batches (token
hashes) with the same losses. The step-3 checkpoint holds each dp rank's logical shards'
positions inside its manifest. A 1-rank launch trains the same 8 steps (the reference) and
resumes at dp 1 from steps 6 and 3 (mid-stream, saved at dp 2). An 8-rank launch trains
dp2 x tp2 x pp2 straight (one rank of each replica reads and tokenizes, `train/stream_share.py`)
and resumes dp4 x tp2 from step 3. Every one equals the reference within 1e-5. A last launch
streams a file whose row 46 (logical shard 5: dp rank 1's) is not JSON: both ranks stop with
that rank's one line, marked as everyone's, so it is printed once.
"""

from __future__ import annotations

import copy
import json

import pytest
from data_fixtures import make_documents, make_tokenizer, write_jsonl
from dist import run_ranks
from parity import TINY, hashed_runs, layout_overrides

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.data.tokenize import main as tokenize_main
from mesh3d.errors import UserError
from mesh3d.train.loop import train

LONG = 32  # the streamed stage's sequence length (tokens.sequence_length is 16)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    tok = make_tokenizer(d / "tok", vocab_size=600)
    write_jsonl(d / "s.jsonl", make_documents(600, seed=1))
    text = write_jsonl(d / "m.jsonl", make_documents(400, seed=2))
    tokenize_main(["--tokenizer", str(tok), "--input", str(text), "--output", str(d / "m")])
    return d


def _overrides(d, root, steps: int, resume=None, stream=None) -> list[str]:
    stages = (
        f"[{{name: stream, start_training_step: 1, sequence_length: {LONG}, "
        f"data: {{seed: 5, num_loading_workers: 2, "
        f"dataset: {{hf_dataset_or_datasets: {stream or d / 's.jsonl'}, text_column_name: text}}}}}}, "
        f"{{name: map, start_training_step: 5, data: {{seed: 6, num_loading_workers: 2, "
        f"dataset: {{dataset_folder: [{d / 'm'}]}}}}}}]"
    )
    out = [
        "model.model_config.vocab_size=600", f"model.model_config.max_position_embeddings={LONG}",
        f"tokenizer.tokenizer_name_or_path={d / 'tok'}",
        f"data_stages={stages}", "mesh3d.hf_streaming=true", f"tokens.train_steps={steps}",
        f"checkpoints.checkpoints_path={root}", "checkpoints.checkpoint_interval=3",
    ]  # fmt: skip
    return out + ([f"checkpoints.resume_checkpoint_path={resume}"] if resume else [])


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    t = tmp_path_factory.mktemp("runs")
    dp2 = layout_overrides(2, 1, "ALL_REDUCE", 0, False)
    two = run_ranks(
        2, hashed_runs,
        [dp2 + _overrides(data, t / "straight", 8), dp2 + _overrides(data, t / "saved", 6),
         dp2 + _overrides(data, t / "from3", 8, t / "saved" / "3"),
         dp2 + _overrides(data, t / "from6", 8, t / "saved" / "6")],
        timeout=400,
    )  # fmt: skip
    dp1 = layout_overrides(1, 1, "ALL_REDUCE", 0, False)
    one = run_ranks(
        1, hashed_runs,
        [dp1 + _overrides(data, t / "dp1", 8), dp1 + _overrides(data, t / "dp1_6", 8, t / "saved" / "6"),
         dp1 + _overrides(data, t / "dp1_3", 8, t / "saved" / "3")],
        timeout=300,
    )[0]  # fmt: skip
    three_d = layout_overrides(2, 2, "ALL_REDUCE", 0, False) + ["parallelism.pp=2"]
    dp4tp2 = layout_overrides(4, 2, "REDUCE_SCATTER", 0, False)
    eight = run_ranks(
        8, hashed_runs,
        [three_d + _overrides(data, t / "3d", 8),
         dp4tp2 + _overrides(data, t / "dp4_3", 8, t / "saved" / "3")],
        timeout=600,
    )  # fmt: skip
    return {"two": two, "one": one, "eight": eight, "root": t}


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_a_resumed_stream_reads_what_the_uninterrupted_run_read(runs):
    for rank in runs["two"]:
        straight, _, from3, from6 = rank
        assert from3["hashes"] == straight["hashes"][3:]
        assert from6["hashes"] == straight["hashes"][6:]
        assert from3["loss"] == straight["loss"][3:]  # bitwise: same layout, CPU fp32
        assert from6["loss"] == straight["loss"][6:]
        assert straight["lengths"] == [LONG] * 4 + [16] * 4  # each stage's own length
        assert from3["lengths"] == straight["lengths"][3:]
    r0, r1 = (r[0]["hashes"] for r in runs["two"])
    assert all(a != b for a, b in zip(r0, r1))  # each dp rank its own samples


def test_the_stream_position_is_inside_the_checkpoint(runs):
    step3 = runs["root"] / "saved" / "3"
    files = json.loads((step3 / "mesh3d_manifest.json").read_text())
    names = json.dumps(files)
    for r in (0, 1):
        assert (step3 / "data" / f"stream_dp-{r}-of-2.pt").is_file()
        assert f"data/stream_dp-{r}-of-2.pt" in names
    assert not (runs["root"] / "saved" / "6" / "data").exists()  # map-style: the step suffices


def test_every_layout_trains_on_the_stream_of_one_process(runs):
    ref = runs["one"][0]["loss"]
    straight = runs["two"][0][0]["loss"]
    three_d = runs["eight"][0][0]["loss"]
    assert len(ref) == len(straight) == len(three_d) == 8
    diffs = {"dp2": _rel(straight, ref), "dp2 x tp2 x pp2": _rel(three_d, ref)}
    print("\nstreamed stage then Nanoset, max relative loss difference to one process:",
          {k: f"{v:.1e}" for k, v in diffs.items()})  # fmt: skip
    assert all(v <= 1e-5 for v in diffs.values()), diffs
    assert all(r[0]["loss"] == three_d for r in runs["eight"])  # every rank logs the same


def test_resume_at_another_dp_continues_the_stream(runs):
    ref = runs["one"][0]["loss"]
    from6, from3 = runs["one"][1:]
    assert isinstance(from6, dict) and len(from6["loss"]) == 2  # map-style data: any dp
    assert isinstance(from3, dict), from3  # mid-stream, saved at dp 2: continues at dp 1
    assert _rel(from3["loss"], ref[3:]) <= 1e-5
    dp4 = runs["eight"][0][1]
    assert isinstance(dp4, dict), dp4  # and at dp 4 x tp 2
    assert _rel(dp4["loss"], ref[3:]) <= 1e-5


def _stopped_with(rank: int, world: int, overrides: list[str]) -> tuple[str, bool]:
    """The `UserError` a run stops with on this rank, and whether it is printed once."""
    cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)
    with pytest.raises(UserError) as e:
        train(cfg)
    return str(e.value), getattr(e.value, "same_on_every_rank", False)


def test_a_bad_streamed_row_is_one_line_printed_once(data, tmp_path):
    lines = (data / "s.jsonl").read_bytes().splitlines()
    lines[45] = b'{"text": "cut'  # row 46: logical shard 45 % 8 = 5, dp rank 1's
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    run = layout_overrides(2, 1, "ALL_REDUCE", 0, False) + _overrides(
        data, tmp_path / "ck", 8, stream=tmp_path / "bad.jsonl"
    )
    (r0, once0), (r1, once1) = run_ranks(2, _stopped_with, run, timeout=300)
    assert r0 == r1 and once0 and once1, (r0, r1)
    assert "\n" not in r0 and f"{tmp_path / 'bad.jsonl'} row 46: not valid JSON" in r0, r0
