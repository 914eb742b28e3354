"""`mesh3d eval --engine lighteval`: the same per-sample scores at every layout and as
lighteval's own transformers backend on the Hugging Face export of the same checkpoint.

A 1-rank launch trains a tiny Llama 3 steps (odd vocabulary: padded at tp 2) and scores two
local lighteval custom tasks (multiple choice by log-likelihood accuracy, greedy generation
stopped at ".", 8 new tokens at most) at one process, and through the command (lighteval's
results json, its details parquet, the table); a 4-rank launch scores them at tp 2 x pp 2 and
dp 2 x tp 2. This process converts the checkpoint (`mesh3d convert to-hf`) and scores the
export with lighteval's `TransformersModel`. Offline throughout (HF_HUB_OFFLINE=1): only the
custom-task file is imported, no built-in task. Every choice's log-likelihood agrees within
1e-5 relative, greedy flags, accuracies and generated texts are identical.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os

import pytest
import torch

pytest.importorskip(
    "lighteval", reason="lighteval is not installed: pip install 'mesh3d[lighteval]'"
)

from dist import run_ranks  # noqa: E402
from eval_fixtures import SEQ, train_config, write_lighteval_tasks, write_tasks  # noqa: E402

from mesh3d.evaluation.cli import evaluate_lighteval, main  # noqa: E402
from mesh3d.train.loop import train  # noqa: E402

TASKS = "tiny_mc,tiny_gen"


def _args(root, **kw) -> argparse.Namespace:
    base = dict(tasks=TASKS, custom_tasks=str(root / "lighteval_tasks.py"), num_fewshot=None,
                max_samples=None, batch_size=4, max_length=SEQ, tokenizer=None, device="cpu")  # fmt: skip
    return argparse.Namespace(**(base | kw))


def _per_sample(pipeline) -> dict:
    """{task: {prompt: (choice log-likelihoods, greedy flags, generated texts)}}; and the scores."""
    out = {}
    for task, details in pipeline.get_details().items():
        out[task.split("|")[0]] = {
            d.doc.query: (
                [float(x) for x in d.model_response.logprobs],
                [bool(x) for x in d.model_response.argmax_logits_eq_gold],
                list(d.model_response.text),
            )  # fmt: skip
            for d in details
        }
    results = {t: {k: float(v) for k, v in m.items()}
               for t, m in pipeline.get_results()["results"].items()}  # fmt: skip
    return {"samples": out, "results": results}


def _one_rank(rank: int, world: int, root) -> dict:
    train(train_config(root))
    got = _per_sample(evaluate_lighteval(root / "ck" / "3", _args(root), 1, 1))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([str(root / "ck"), "--engine", "lighteval", "--tasks", TASKS,
              "--custom-tasks", str(root / "lighteval_tasks.py"), "--output-dir",
              str(root / "out"), "--batch-size", "3", "--device", "cpu"])  # fmt: skip
    return got | {"stdout": out.getvalue()}


def _four_ranks(rank: int, world: int, root) -> list:
    out = []
    for tp, pp, dp in ((2, 2, 1), (2, 1, 2)):
        pipeline = evaluate_lighteval(root / "ck" / "3", _args(root), tp, pp, dp)
        out.append(_per_sample(pipeline) if rank == 0 else None)
    return out


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("lighteval")
    write_tasks(root)
    write_lighteval_tasks(root)
    offline = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")  # no network needed
    try:
        one = run_ranks(1, _one_rank, root, timeout=400)[0]
        four = run_ranks(4, _four_ranks, root, timeout=400)[0]
        from lighteval.models.transformers.transformers_model import (
            TransformersModel,
            TransformersModelConfig,
        )

        from mesh3d.convert import main as convert
        from mesh3d.evaluation.lighteval_run import run_lighteval
        from mesh3d.evaluation.lighteval_tasks import task_configs, task_specs

        convert(["to-hf", "--checkpoint", str(root / "ck" / "3"), "--output", str(root / "hf")])
        specs = task_specs(TASKS)
        hf = TransformersModel(TransformersModelConfig(
            model_name=str(root / "hf"), dtype="float32", device="cpu", batch_size=4,
            max_length=SEQ))  # fmt: skip
        theirs = _per_sample(run_lighteval(hf, specs, task_configs(specs, _args(root).custom_tasks),
                                           None, None))  # fmt: skip
    finally:
        torch.set_grad_enabled(True)  # lighteval's transformers backend turns it off at import
        for k, v in offline.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    return {"one": one, "four": four, "hf": theirs, "root": root}


def _rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    pairs = [(x, y) for q in a for x, y in zip(a[q][0], b[q][0], strict=True)]
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in pairs)


def test_every_sample_scores_alike_at_every_layout_and_as_transformers(scored):
    one = scored["one"]["samples"]
    others = {"tp2 x pp2": scored["four"][0]["samples"], "dp2 x tp2": scored["four"][1]["samples"],
              "lighteval transformers": scored["hf"]["samples"]}  # fmt: skip
    assert len(one["tiny_mc"]) == 20 and sum(len(v[0]) for v in one["tiny_mc"].values()) == 60
    diffs = {name: _rel(got["tiny_mc"], one["tiny_mc"]) for name, got in others.items()}
    print("\nper-choice log-likelihood, max relative difference to one process:",
          {k: f"{v:.1e}" for k, v in diffs.items()})  # fmt: skip
    assert all(v <= 1e-5 for v in diffs.values()), diffs
    for got in others.values():
        assert {q: v[1] for q, v in got["tiny_mc"].items()} == {
            q: v[1] for q, v in one["tiny_mc"].items()
        }
        assert {q: v[2] for q, v in got["tiny_gen"].items()} == {
            q: v[2] for q, v in one["tiny_gen"].items()
        }  # the generated texts
    assert len(one["tiny_gen"]) == 10 and any(v[2][0] for v in one["tiny_gen"].values())


def test_scores_equal_the_transformers_backend(scored):
    ours, theirs = scored["one"]["results"], scored["hf"]["results"]
    assert ours["tiny_mc:0"]["acc"] == theirs["tiny_mc:0"]["acc"]
    assert ours["tiny_gen:0"]["em"] == theirs["tiny_gen:0"]["em"]
    for four in scored["four"]:
        assert four["results"] == ours


def test_the_command_prints_the_table_and_writes_results_and_details(scored):
    import pandas as pd

    root, out = scored["root"], scored["one"]["stdout"]
    assert "tiny_mc" in out and "acc" in out and "written to" in out
    (results,) = (root / "out" / "results" / "mesh3d").glob("results_*.json")
    got = json.loads(results.read_text())["results"]
    assert got["tiny_mc|0"]["acc"] == scored["one"]["results"]["tiny_mc:0"]["acc"]
    details = sorted((root / "out" / "details" / "mesh3d").glob("*/details_*.parquet"))
    assert [p.name.split("_")[1] for p in details] == ["tiny", "tiny"] and len(details) == 2
    rows = pd.read_parquet(next(p for p in details if "tiny_mc" in p.name))
    assert len(rows) == 20 and "model_response" in rows.columns


# --- the lighteval: section with mesh3d.eval_engine: lighteval ------------------------------


def _in_run(rank: int, world: int, root) -> list:
    from parity import layout_overrides

    layout = layout_overrides(2, 1, "ALL_REDUCE", 0, False) + ["parallelism.pp=2"]
    section = (f"lighteval={{batch_size: 4, tasks: {{tasks: 'custom|tiny_mc|0|0,tiny_gen', "
               f"custom_tasks: {root / 'lighteval_tasks.py'}}}, "
               f"logging: {{local_output_path: {root / 'evals'}}}}}")  # fmt: skip
    out = {}
    for name, extra in (("run", [section, "mesh3d.eval_engine=lighteval"]), ("plain", [])):
        cfg = train_config(root / name, steps=4,
                           extra=[*layout, "checkpoints.checkpoint_interval=2", *extra])  # fmt: skip
        res = train(cfg)
        out[name] = {"evals": res.evals, "loss": [m["lm_loss"] for m in res.metrics]}
    return out


def _checkpoint_scores(rank: int, world: int, root) -> dict:
    return _per_sample(evaluate_lighteval(root / "run" / "ck" / "4", _args(root), 1, 1))


@pytest.fixture(scope="module")
def in_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lighteval_in_run")
    write_tasks(root)
    write_lighteval_tasks(root)
    for name in ("run", "plain"):
        (root / name).mkdir()
        (root / name / "tok").symlink_to(root / "tok")
    offline = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    try:
        got = run_ranks(4, _in_run, root, timeout=600)[0]
        one = run_ranks(1, _checkpoint_scores, root, timeout=300)[0]
    finally:
        for k, v in offline.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    return got["run"] | {"plain_loss": got["plain"]["loss"], "one": one, "root": root}


def test_the_section_scores_through_lighteval_in_the_run_as_on_the_checkpoint(in_run):
    """dp 2 x pp 2 training ranks score Nanotron's task strings through lighteval after the
    step-2 and step-4 saves and train on exactly as a run without them (lighteval's import turns
    autograd off and its pipeline reseeds Python's and numpy's generators; mesh3d puts both
    back): the step-4 scores and every choice's log-likelihood (lighteval's
    details file) equal `mesh3d eval --engine lighteval` on that checkpoint at one process."""
    import pandas as pd

    assert [e["iteration"] for e in in_run["evals"]] == [2, 4]
    assert len(in_run["loss"]) == 4 and in_run["loss"] == in_run["plain_loss"]
    (last,) = [e for e in in_run["evals"] if e["iteration"] == 4]
    one = in_run["one"]
    assert last["eval/tiny_mc/acc"] == one["results"]["tiny_mc:0"]["acc"]
    assert last["eval/tiny_gen/em"] == one["results"]["tiny_gen:0"]["em"]
    (details,) = (in_run["root"] / "evals" / "4" / "details" / "mesh3d").glob("*/*tiny_mc*")
    rows = pd.read_parquet(details)
    got = {d["query"]: list(r["logprobs"]) for d, r in zip(rows["doc"], rows["model_response"])}
    assert (
        _rel(
            {q: (v, None) for q, v in got.items()},
            {q: v[:1] for q, v in one["samples"]["tiny_mc"].items()},
        )
        <= 1e-5
    )
