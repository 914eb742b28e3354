"""`mesh3d eval` through lm-evaluation-harness: the same per-sample scores at every layout and
as lm-eval's own transformers backend on the Hugging Face export of the same checkpoint.

A 1-rank launch trains a tiny Llama 3 steps (odd vocabulary: padded at tp 2), scores three
local tasks (multiple choice, greedy generation stopped at ".", rolling log-likelihood) at one
process through `evaluate` and through the command (results.json, the table); a 4-rank launch
scores them at tp 2 x pp 2, dp 2 x pp 2 and dp 4 (each replica a slice of every batch). This process converts the checkpoint (`mesh3d convert to-hf`) and
scores the export with lm-eval's `hf` model. Every sample's log-likelihoods agree within 1e-5
relative, greedy flags, accuracies and generated texts are identical.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os

import pytest

pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed: pip install 'mesh3d[eval]'"
)

from dist import run_ranks  # noqa: E402
from eval_fixtures import SEQ, TASKS, per_sample, train_config, write_tasks  # noqa: E402

from mesh3d.evaluation.cli import evaluate, main  # noqa: E402
from mesh3d.train.loop import train  # noqa: E402


def _args(root, **kw) -> argparse.Namespace:
    base = dict(tasks=",".join(TASKS), custom_tasks=str(root / "tasks"), num_fewshot=None,
                max_samples=None, batch_size=4, max_length=SEQ, tokenizer=None, device="cpu")  # fmt: skip
    return argparse.Namespace(**(base | kw))


def _one_rank(rank: int, world: int, root) -> dict:
    train(train_config(root))
    got = evaluate(root / "ck" / "3", _args(root), 1, 1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([str(root / "ck"), "--tasks", ",".join(TASKS), "--custom-tasks", str(root / "tasks"),
              "--output-dir", str(root / "out"), "--batch-size", "3", "--device", "cpu"])  # fmt: skip
    return {"samples": per_sample(got), "results": json.loads(json.dumps(got["results"], default=float)),
            "stdout": out.getvalue()}  # fmt: skip


def _four_ranks(rank: int, world: int, root) -> list:
    out = []  # lm-eval returns results on rank 0
    for tp, pp, dp in ((2, 2, 1), (1, 2, 2), (1, 1, 4)):
        got = evaluate(root / "ck" / "3", _args(root), tp, pp, dp)
        assert (got is None) == (rank != 0)
        out.append({"samples": per_sample(got)} if got is not None else None)
    return out


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    write_tasks(root)
    offline = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")  # no network needed
    try:
        one = run_ranks(1, _one_rank, root, timeout=400)[0]
        four = run_ranks(4, _four_ranks, root, timeout=400)[0]
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        from mesh3d.convert import main as convert

        convert(["to-hf", "--checkpoint", str(root / "ck" / "3"), "--output", str(root / "hf")])
        hf = simple_evaluate(model="hf", model_args=f"pretrained={root / 'hf'},dtype=float32",
                             tasks=list(TASKS), task_manager=TaskManager(include_path=str(root / "tasks")),
                             log_samples=True, batch_size=4, device="cpu")  # fmt: skip
    finally:
        for k, v in offline.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    return {"one": one, "four": four, "hf": per_sample(hf), "root": root,
            "hf_results": hf["results"]}  # fmt: skip


def _lls(samples: dict, task: str) -> list[float]:
    out = []
    for resps in samples[task]:
        for r in resps:
            out.append(r[0][0] if isinstance(r[0], list) else r[0])
    return out


def _greedy(samples: dict) -> list:
    return [[r[0][1] for r in resps] for resps in samples["tiny_mc"]]


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def test_every_sample_scores_alike_at_every_layout_and_as_transformers(scored):
    one, hf = scored["one"]["samples"], scored["hf"]
    layouts = dict(zip(("tp2 x pp2", "dp2 x pp2", "dp4"), (r["samples"] for r in scored["four"])))
    diffs = {}
    for task in ("tiny_mc", "tiny_text"):
        assert len(_lls(one, task)) == (60 if task == "tiny_mc" else 6)
        for name, got in layouts.items():
            diffs[f"{task} {name}"] = _rel(_lls(got, task), _lls(one, task))
        diffs[f"{task} transformers"] = _rel(_lls(hf, task), _lls(one, task))
    print("\nper-sample log-likelihood, max relative difference to one process:",
          {k: f"{v:.1e}" for k, v in diffs.items()})  # fmt: skip
    assert all(v <= 1e-5 for v in diffs.values()), diffs
    for got in layouts.values():
        assert _greedy(got) == _greedy(one) == _greedy(hf)
        assert got["tiny_gen"] == one["tiny_gen"] == hf["tiny_gen"]  # generated texts
    assert any(r[0] for r in one["tiny_gen"])  # something was generated


def test_scores_equal_the_transformers_backend(scored):
    ours, theirs = scored["one"]["results"], scored["hf_results"]
    assert ours["tiny_mc"]["acc,none"] == theirs["tiny_mc"]["acc,none"]
    assert ours["tiny_gen"]["exact_match,none"] == theirs["tiny_gen"]["exact_match,none"]
    a, b = ours["tiny_text"]["bits_per_byte,none"], theirs["tiny_text"]["bits_per_byte,none"]
    assert abs(a - b) <= 1e-5 * b


def test_the_command_prints_the_table_and_writes_results_and_samples(scored):
    root, out = scored["root"], scored["one"]["stdout"]
    assert "tiny_mc" in out and "acc" in out and "written to" in out
    results = json.loads((root / "out" / "results.json").read_text())
    assert set(results["results"]) == set(TASKS)
    assert (
        results["results"]["tiny_mc"]["acc,none"] == scored["one"]["results"]["tiny_mc"]["acc,none"]
    )
    rows = (root / "out" / "samples_tiny_mc.jsonl").read_text().splitlines()
    assert len(rows) == 20 and "resps" in json.loads(rows[0])
