"""Metrics to every sink with the same values (metrics file, W&B offline, TensorBoard), MFU and
its peak table, the profiler trace, the ETA, a resumed run continuing its W&B run, and one metrics
file per run (a fresh run replaces it, a resumed run cuts it at its start step and appends).

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_observability.py`."""

from __future__ import annotations

import copy
import json
import os
import struct
from pathlib import Path

import pytest
from dist import run_ranks
from parity import TINY

from mesh3d.config import apply_overrides, config_from_dict


def _run(rank: int, world: int, root: str, overrides: list[str]) -> list[dict]:
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=root, WANDB_SILENT="true")
    from mesh3d.train.loop import train

    cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)
    return train(cfg, metrics_file=str(Path(root) / "metrics.jsonl")).metrics


@pytest.fixture(scope="module")
def sinks(tmp_path_factory):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[dev]')")
    pytest.importorskip(
        "tensorboard", reason="tensorboard is not installed (pip install -e '.[dev]')"
    )
    root = tmp_path_factory.mktemp("sinks")
    common = [
        "mesh3d.wandb=true",
        f"mesh3d.tensorboard_dir={root / 'tb'}",
        f"checkpoints.checkpoints_path={root / 'ck'}",
        "checkpoints.checkpoint_interval=2",
        f"profiler.profiler_export_path={root / 'prof'}",
        "profiler.skip_first=0",
        "profiler.wait=0",
        "profiler.warmup=1",
        "profiler.active=1",
    ]
    first = run_ranks(1, _run, str(root), common + ["tokens.train_steps=2"], timeout=200)[0]
    resumed = common + ["tokens.train_steps=4", f"checkpoints.resume_checkpoint_path={root / 'ck'}"]
    second = run_ranks(1, _run, str(root), resumed, timeout=200)[0]
    return root, first, second


def _wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline W&B run file: a LevelDB-style log of protobuf `Record`s
    (7-byte header `:W&B` + magic + version; 32 KiB blocks; records of crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_every_sink_gets_the_same_values(sinks):
    root, first, second = sinks
    losses = [m["lm_loss"] for m in first + second]
    lines = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert [x["lm_loss"] for x in lines] == losses
    assert [x["iteration"] for x in lines] == [1, 2, 3, 4]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(root / "tb"))
    tb.Reload()
    events = sorted(tb.Scalars("lm_loss"), key=lambda e: e.step)
    assert [e.step for e in events] == [1, 2, 3, 4]
    assert [e.value for e in events] == pytest.approx(losses, rel=1e-7)  # stored as float32

    runs = sorted((root / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    history = [row for run in runs for row in _wandb_history(next(run.glob("run-*.wandb")))]
    assert [row["lm_loss"] for row in history] == losses
    assert [row["iteration_step"] for row in history] == [1, 2, 3, 4]
    assert {k for k in lines[0] if k != "iteration"} <= set(history[0])


def test_resumed_run_continues_the_same_wandb_run(sinks):
    root = sinks[0]
    meta = json.loads((root / "ck" / "2" / "checkpoint_metadata.json").read_text())
    run_id = meta["custom_metas"]["wandb_id"]
    runs = sorted(p.name for p in (root / "wandb").glob("offline-run-*"))
    assert [name.rsplit("-", 1)[1] for name in runs] == [run_id, run_id]


def test_profiler_writes_a_trace(sinks):
    traces = list((sinks[0] / "prof").glob("*.pt.trace.json"))
    assert traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)


def test_no_mfu_on_cpu_and_memory_reported(sinks):
    for m in sinks[1]:
        assert "mfu" not in m
        assert m["peak_rss_mib"] > 50


def test_the_last_step_is_logged_whatever_the_interval(tmp_path):
    # Nanotron logs steps 1, 1 + N, ...; mesh3d adds the last one, so the file and plot end there
    run_ranks(1, _run, str(tmp_path), ["tokens.train_steps=5", "logging.iteration_step_info_interval=3"],
              timeout=200)  # fmt: skip
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [1, 4, 5]


def _sink_refused(rank: int, world: int, overrides: list[str]) -> tuple[bool, str] | None:
    from mesh3d.errors import UserError
    from mesh3d.train.loop import train

    cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)
    try:
        train(cfg, metrics_file="/proc/nope/metrics.jsonl")
    except UserError as e:
        return e.same_on_every_rank, str(e)
    return None


def test_a_metrics_file_the_last_stage_cannot_write_stops_every_rank():
    # pp 2: the metrics rank is rank 1; its error reaches rank 0 too (it would hang otherwise)
    got = run_ranks(2, _sink_refused, ["parallelism.pp=2", "tokens.train_steps=2"], timeout=120)
    assert [alike for alike, _ in got] == [True, True]
    assert all(
        m.startswith("`--metrics-file` /proc/nope/metrics.jsonl: cannot write") for _, m in got
    )
