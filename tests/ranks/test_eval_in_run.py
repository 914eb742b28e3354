"""The `lighteval:` section scored inside the run, at the training layout (dp 2 x pp 2).

One 4-rank launch trains a tiny Llama 4 steps twice, with an evaluation of three local tasks
after the checkpoints of steps 2 and 4 and without: the two train bitwise alike (losses,
batches read, weights). A 1-rank launch then scores the step-4 checkpoint with `mesh3d eval`:
the in-run scores of step 4 equal it (accuracy and exact match identical, bits per byte and
every sample's log-likelihood within 1e-5 relative, generated texts identical).
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed: pip install 'mesh3d[eval]'"
)

from dist import run_ranks  # noqa: E402
from eval_fixtures import SEQ, TASKS, per_sample, train_config, write_tasks  # noqa: E402
from parity import full_weights, layout_overrides  # noqa: E402

from mesh3d.evaluation.cli import evaluate  # noqa: E402
from mesh3d.train.hooks import BatchHashes, KeepModel  # noqa: E402
from mesh3d.train.loop import train  # noqa: E402


def _runs(rank: int, world: int, root) -> list[dict]:
    layout = layout_overrides(2, 1, "ALL_REDUCE", 0, False) + ["parallelism.pp=2"]
    lighteval = (f"lighteval={{batch_size: 4, tasks: {{tasks: '{','.join(TASKS)}', "
                 f"custom_tasks: {root / 'tasks'}}}, logging: {{local_output_path: {root / 'evals'}}}}}")  # fmt: skip
    out = []
    for name, extra in (("with", [lighteval]), ("without", [])):
        cfg = train_config(
            root / name, steps=4, extra=[*layout, "checkpoints.checkpoint_interval=2", *extra]
        )
        hashes = BatchHashes()
        res = train(cfg, str(root / name / "metrics.jsonl"), hooks=[hashes, KeepModel()])
        weights = full_weights(res.model, res.mesh)
        out.append({"loss": [m["lm_loss"] for m in res.metrics], "hashes": hashes.hashes,
                    "weights": weights if rank == 0 else None, "evals": res.evals})  # fmt: skip
    return out


def _mesh3d_eval(rank: int, world: int, root) -> dict:
    args = argparse.Namespace(tasks=",".join(TASKS), custom_tasks=str(root / "tasks"),
                              num_fewshot=None, max_samples=None, batch_size=4, max_length=SEQ,
                              tokenizer=None, device="cpu")  # fmt: skip
    got = evaluate(root / "with" / "ck" / "4", args, 1, 1)
    return {
        "samples": per_sample(got),
        "results": json.loads(json.dumps(got["results"], default=float)),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inrun")
    write_tasks(root)
    for name in ("with", "without"):
        (root / name).mkdir()
        (root / name / "tok").symlink_to(root / "tok")
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    four = run_ranks(4, _runs, root, timeout=600)
    one = run_ranks(1, _mesh3d_eval, root, timeout=300)[0]
    return {"four": four, "one": one, "root": root}


def test_a_run_with_evaluations_trains_bitwise_like_one_without(runs):
    for rank in runs["four"]:
        with_, without = rank
        assert with_["loss"] == without["loss"]
        assert with_["hashes"] == without["hashes"]
    w0, wo0 = runs["four"][0][0]["weights"], runs["four"][0][1]["weights"]
    assert w0.keys() == wo0.keys() and all((w0[k] == wo0[k]).all() for k in w0)
    evals = runs["four"][0][0]["evals"]
    assert [e["iteration"] for e in evals] == [2, 4]
    assert all(r[0]["evals"] == evals for r in runs["four"])  # every rank has the scores
    assert runs["four"][0][1]["evals"] == []


def test_in_run_scores_equal_mesh3d_eval_on_the_saved_checkpoint(runs):
    step4 = runs["four"][0][0]["evals"][-1]
    ref = runs["one"]["results"]
    assert step4["eval/tiny_mc/acc"] == ref["tiny_mc"]["acc,none"]
    assert step4["eval/tiny_gen/exact_match"] == ref["tiny_gen"]["exact_match,none"]
    a, b = step4["eval/tiny_text/bits_per_byte"], ref["tiny_text"]["bits_per_byte,none"]
    assert abs(a - b) <= 1e-5 * b, (a, b)
    root = runs["root"]
    for task in TASKS:
        rows = [
            json.loads(x)
            for x in (root / "evals" / "4" / f"samples_{task}.jsonl").read_text().splitlines()
        ]
        got = per_sample({"samples": {task: rows}})[task]
        want = runs["one"]["samples"][task]
        if task == "tiny_gen":
            assert got == want  # greedy texts
            continue
        flat = [
            v for resps in got for r in resps for v in (r[0] if isinstance(r[0], list) else r)[:1]
        ]
        ref_flat = [
            v for resps in want for r in resps for v in (r[0] if isinstance(r[0], list) else r)[:1]
        ]
        assert len(flat) == len(ref_flat) > 0
        assert max(abs(x - y) / abs(y) for x, y in zip(flat, ref_flat)) <= 1e-5


def test_scores_are_in_the_metrics_file_and_the_plot_draws_them(runs):
    from mesh3d.plot import read_metrics, write_plot

    root = runs["root"]
    metrics = read_metrics(root / "with" / "metrics.jsonl")
    evals = [m for m in metrics if any(k.startswith("eval/") for k in m)]
    assert [m["iteration"] for m in evals] == [2, 4]
    assert evals[-1] == runs["four"][0][0]["evals"][-1]
    assert [m["iteration"] for m in metrics if "lm_loss" in m] == [1, 2, 3, 4]
    png = write_plot([root / "with" / "metrics.jsonl"], root / "with" / "plot.png")
    assert png.stat().st_size > 0


def _failing(rank: int, world: int, root) -> list:
    """A task whose data file is gone: the run trains on (one line) or, with eval_failure:
    stop, ends after the checkpoint it could not score."""
    from mesh3d.errors import RunStopped

    broken = root / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "gone.yaml").write_text((root / "tasks" / "tiny_mc.yaml").read_text().replace(
        "task: tiny_mc", "task: gone").replace(str(root / "mc.jsonl"), str(root / "missing.jsonl")))  # fmt: skip
    section = f"lighteval={{tasks: {{tasks: gone, custom_tasks: {broken}}}}}"
    out = []
    for mode in ("continue", "stop"):
        cfg = train_config(root / mode, steps=2, extra=[section, "checkpoints.checkpoint_interval=1",
                                                        f"mesh3d.eval_failure={mode}"])  # fmt: skip
        try:
            res = train(cfg)
            out.append({"steps": len(res.metrics), "evals": res.evals})
        except RunStopped as e:
            out.append({"stopped": str(e)})
    return out


def test_a_failing_evaluation_is_one_line_and_the_run_goes_on_or_stops_when_told(tmp_path):
    write_tasks(tmp_path)
    for mode in ("continue", "stop"):
        (tmp_path / mode).mkdir()
        (tmp_path / mode / "tok").symlink_to(tmp_path / "tok")
    went_on, stopped = run_ranks(1, _failing, tmp_path, timeout=300)[0]
    assert went_on == {"steps": 2, "evals": []}
    text = stopped["stopped"]
    assert "\n" not in text and "the evaluation of step 1 failed" in text, text
    assert "mesh3d.eval_failure: stop" in text and "saved and untouched" in text, text
    assert (tmp_path / "stop" / "ck" / "1" / "mesh3d_manifest.json").is_file()
    assert not (tmp_path / "stop" / "ck" / "2").exists()
