"""Training on real data: Nanoset folders made by the tokenize tool, two data stages, resume.

One 4-rank launch at dp2 x tp2 trains 8 steps straight across a stage switch at step 4 (stage 2
blends two folders 0.7/0.3); a second run saves at steps 3 and 6 (before and after the switch);
two more resume from each. The batches each dp rank reads after a resume (token hashes) and the
losses must equal the uninterrupted run's. A 1-rank run resumes the step-3 checkpoint at dp1:
its losses match within 1e-5 (the same global batches, summed in another order). A last run
trains longer on one folder and its loss must fall.
"""

from __future__ import annotations

import pytest
import torch
from data_fixtures import make_documents, make_tokenizer, write_jsonl
from dist import run_ranks
from parity import hashed_runs, layout_overrides

from mesh3d.data.tokenize import main as tokenize_main


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    tok = make_tokenizer(d / "tok", vocab_size=600)
    for name, seed in (("a", 1), ("b", 2)):
        text = write_jsonl(d / f"{name}.jsonl", make_documents(400, seed=seed))
        tokenize_main(["--tokenizer", str(tok), "--input", str(text), "--output", str(d / name)])
        assert any((d / name).glob("*.ds"))
    return d


def _stage(name: str, start: int, seed: int, folders: list, weights=None) -> str:
    dataset = f"dataset_folder: [{', '.join(map(str, folders))}]"
    if weights:
        dataset += f", dataset_weights: {weights}"
    return f"{{name: {name}, start_training_step: {start}, data: {{seed: {seed}, dataset: {{{dataset}}}}}}}"


def _stages(d, *stages: str) -> list[str]:
    stages = stages or (
        _stage("first", 1, 5, [d / "a"]),
        _stage("blend", 4, 6, [d / "a", d / "b"], [0.7, 0.3]),
    )
    return [
        "model.model_config.vocab_size=600",
        f"tokenizer.tokenizer_name_or_path={d / 'tok'}",
        f"data_stages=[{', '.join(stages)}]",
    ]


def _ck(root, steps, resume=None) -> list[str]:
    out = [f"checkpoints.checkpoints_path={root}", "checkpoints.checkpoint_interval=3"]
    out.append(f"tokens.train_steps={steps}")
    return out + ([f"checkpoints.resume_checkpoint_path={resume}"] if resume else [])


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    t = tmp_path_factory.mktemp("runs")
    dp2 = layout_overrides(2, 2, "ALL_REDUCE", 0, False) + _stages(data)
    four = run_ranks(
        4,
        hashed_runs,
        [
            dp2 + _ck(t / "straight", 8),
            dp2 + _ck(t / "saved", 6),
            dp2 + _ck(t / "from3", 8, t / "saved" / "3"),
            dp2 + _ck(t / "from6", 8, t / "saved" / "6"),
        ],
        timeout=300,
    )
    dp1 = layout_overrides(1, 1, "ALL_REDUCE", 0, False) + _stages(data)
    long = layout_overrides(1, 1, "ALL_REDUCE", 0, False)
    long += _stages(data, _stage("only", 1, 5, [data / "a"]))
    long += ["tokens.train_steps=40", "optimizer.learning_rate_scheduler.learning_rate=0.003"]
    one = run_ranks(
        1, hashed_runs, [dp1 + _ck(t / "dp1", 8, t / "saved" / "3"), long], timeout=300
    )[0]
    return {"ranks": four, "dp1": one[0], "long": one[1]}


def test_resume_reads_the_same_batches_on_every_dp_rank(runs):
    for rank, (straight, saved, from3, from6) in enumerate(runs["ranks"]):
        assert saved["hashes"] == straight["hashes"][:6], rank
        assert from3["hashes"] == straight["hashes"][3:], rank  # resumed before the stage switch
        assert from6["hashes"] == straight["hashes"][6:], rank  # resumed after it
        assert from3["loss"] == straight["loss"][3:] and from6["loss"] == straight["loss"][6:]
    # the two dp replicas read different halves of each global batch; tp ranks of a replica agree
    hashes = [r[0]["hashes"] for r in runs["ranks"]]
    assert hashes[0] == hashes[1] and hashes[2] == hashes[3] and hashes[0] != hashes[2]


def test_stage_switch_changes_the_data(runs):
    straight = runs["ranks"][0][0]["hashes"]
    assert len(set(straight)) == 8  # every step reads new samples, in both stages


def test_resume_at_another_dp(runs):
    ref = torch.tensor(runs["ranks"][0][0]["loss"][3:])
    got = torch.tensor(runs["dp1"]["loss"])
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5, (got, ref)


def test_loss_falls_on_real_tokens(runs):
    loss = runs["long"]["loss"]
    first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
    assert last < first - 0.3, (first, last)  # ln(600) = 6.4 nats at the start
