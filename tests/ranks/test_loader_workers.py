"""The loader's worker processes (`mesh3d.data.loader`): they change when a batch is read, never
what it holds.

One 2-rank launch (dp 2; the ranks need no collective): each rank reads steps 1-8 of two stages
(a Nanoset folder, then a map-style HF JSON Lines file from step 4) in the training process and
through 2 workers, then through 2 workers again from step 5 (a resume) and from step 3 (a
resume before the stage switch), and compares the bytes. Rank 1 then kills its worker mid-run
and must get one `DataWorkerError` line naming the worker and the stage's files; rank 0 stops
(SIGSTOP) its worker and must get the timeout's line, not a hang, and streams a JSON Lines file
with a cut-off row through a worker: the row's one `UserError` line, naming the worker.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time

import pytest
from data_fixtures import make_documents, make_tokenizer, write_jsonl
from dist import run_ranks
from parity import TINY

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.data.build import StagedData
from mesh3d.data.loader import Feed, worker_pids
from mesh3d.data.tokenize import main as tokenize_main
from mesh3d.errors import DataWorkerError, UserError


def staged_config(d, workers: int, steps: int = 8, overrides: list[str] = ()):
    stages = (
        f"[{{name: a, start_training_step: 1, data: {{seed: 5, num_loading_workers: {workers}, "
        f"dataset: {{dataset_folder: [{d / 'a'}]}}}}}}, {{name: b, start_training_step: 4, "
        f"data: {{seed: 6, num_loading_workers: {workers}, dataset: {{hf_dataset_or_datasets: "
        f"{d / 'b.jsonl'}, text_column_name: text}}}}}}]"
    )
    return apply_overrides(
        config_from_dict(copy.deepcopy(TINY)),
        ["model.model_config.vocab_size=600", f"tokenizer.tokenizer_name_or_path={d / 'tok'}",
         f"data_stages={stages}", f"tokens.train_steps={steps}", *overrides],
    )  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("loader")
    tok = make_tokenizer(d / "tok", vocab_size=600)
    text = write_jsonl(d / "a.jsonl", make_documents(400, seed=1))
    tokenize_main(["--tokenizer", str(tok), "--input", str(text), "--output", str(d / "a")])
    write_jsonl(d / "b.jsonl", make_documents(400, seed=2))
    bad = write_jsonl(d / "bad.jsonl", make_documents(600, seed=3))
    lines = bad.read_text().splitlines()
    lines[40] = lines[40][:20]  # row 41 cut off (read by dp rank 0: even rows)
    bad.write_text("\n".join(lines) + "\n")
    return d


def _bytes(batches) -> list[bytes]:
    return [t.numpy().tobytes() for mb in batches for t in mb]


def _read(d, rank: int, workers: int, first: int, steps: int = 8) -> list:
    cfg = staged_config(d, workers, steps)
    feed = Feed(StagedData(cfg), rank, 2, cfg.tokens.micro_batch_size, timeout_s=60)
    try:
        return [_bytes(feed.batches(s)) for s in range(first, steps + 1)]
    finally:
        feed.close()


def _worker_fault(d, rank: int, sig: int, timeout_s: float) -> str:
    """Send `sig` to the one worker of a 1-worker feed after its first batch, then read on:
    the `DataWorkerError` line the feed raises ("no error" if it raises none)."""
    cfg = staged_config(d, 1, 40, ["data_stages[1].start_training_step=30"])
    feed = Feed(StagedData(cfg), rank, 2, cfg.tokens.micro_batch_size, timeout_s=timeout_s)
    feed.batches(1)
    (pid,) = worker_pids(feed.loader)
    os.kill(pid, sig)
    try:
        for step in range(2, 30):
            feed.batches(step)
        return "no error"
    except DataWorkerError as e:
        return str(e)
    finally:
        feed.close()
        with contextlib.suppress(ProcessLookupError):  # the loader killed it already
            os.kill(pid, signal.SIGKILL)


def _rank(rank: int, world: int, d) -> dict:
    t0 = time.perf_counter()
    out = {"main": _read(d, rank, 0, 1)}
    out["workers"] = _read(d, rank, 2, 1)
    out["workers_s"] = time.perf_counter() - t0
    out["from5"] = _read(d, rank, 2, 5)
    out["from3"] = _read(d, rank, 2, 3)
    if rank == 0:  # a worker that hangs (stopped): the timeout, not a hang
        out["hung"] = _worker_fault(d, rank, signal.SIGSTOP, timeout_s=3)
    if rank == 0:  # bad data found by a streaming worker: the data's own one line
        stage = (f"[{{name: s, start_training_step: 1, data: {{seed: 5, num_loading_workers: 1, "
                 f"dataset: {{hf_dataset_or_datasets: {d / 'bad.jsonl'}, "
                 "text_column_name: text}}}]")  # fmt: skip
        cfg = apply_overrides(staged_config(d, 1, 30), [f"data_stages={stage}",
                                                         "mesh3d.hf_streaming=true"])  # fmt: skip
        feed = Feed(StagedData(cfg), rank, 2, cfg.tokens.micro_batch_size, timeout_s=60)
        try:
            for step in range(1, 31):
                feed.batches(step)
            out["bad"] = "no error"
        except UserError as e:
            out["bad"] = str(e)
        finally:
            feed.close()
    if rank == 1:
        out["killed"] = _worker_fault(d, rank, signal.SIGKILL, timeout_s=60)
    return out


def test_workers_read_what_the_training_process_reads(data):
    results = run_ranks(2, _rank, data, timeout=240)
    for r in results:
        assert r["workers"] == r["main"]  # byte for byte, across the stage switch at step 4
        assert r["from5"] == r["main"][4:]  # resumed in stage 2
        assert r["from3"] == r["main"][2:]  # resumed before the switch
    assert results[0]["main"] != results[1]["main"]  # each dp rank its own slice
    bad = results[0]["bad"]
    assert "\n" not in bad and f"{data / 'bad.jsonl'} row 41: not valid JSON" in bad, bad
    assert bad.endswith("(read by data worker 0)"), bad
    hung = results[0]["hung"]
    assert "\n" not in hung and "no data worker answered within 3 s" in hung, hung
    killed = results[1]["killed"]
    assert "\n" not in killed
    assert "data worker 0 (pid" in killed and "killed by signal 9" in killed, killed
    assert str(data / "a") in killed and "num_loading_workers: 0" in killed, killed
