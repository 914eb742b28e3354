"""Streamed HF text (`mesh3d.hf_streaming`, `mesh3d.data.streaming`) in the training process
(`num_loading_workers: 0`; the workers and a whole resumed run are in
`tests/ranks/test_streaming_ranks.py`): the samples, their split over dp ranks, the saved
position, the refusals and the bad-input lines."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_fixtures import make_documents, make_tokenizer, write_jsonl
from parity import TINY
from tokenizers import Tokenizer

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.data import streaming
from mesh3d.data.build import StagedData
from mesh3d.data.loader import Feed
from mesh3d.errors import UserError

VOCAB = 600


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    make_tokenizer(d / "tok", vocab_size=VOCAB)
    write_jsonl(d / "a.jsonl", make_documents(300, seed=1))
    docs = make_documents(300, seed=2)
    pq.write_table(pa.table({"text": docs}), d / "b.parquet", row_group_size=50)
    return d


def cfg_of(d, dataset: str, steps: int = 6, extra: list[str] = ()):
    stages = (f"[{{name: s, start_training_step: 1, data: {{seed: 7, num_loading_workers: 0, "
              f"dataset: {{hf_dataset_or_datasets: {dataset}, text_column_name: text}}}}}}]")  # fmt: skip
    return apply_overrides(
        config_from_dict(copy.deepcopy(TINY)),
        [f"model.model_config.vocab_size={VOCAB}", f"tokenizer.tokenizer_name_or_path={d / 'tok'}",
         f"data_stages={stages}", f"tokens.train_steps={steps}", "mesh3d.hf_streaming=true",
         *extra],
    )  # fmt: skip


def feed_of(cfg, dp_rank: int = 0, dp: int = 1) -> Feed:
    mbs = cfg.tokens.micro_batch_size
    return Feed(StagedData(cfg), dp_rank, dp, mbs, timeout_s=30)


def windows(feed: Feed, steps) -> list[bytes]:
    """Each sample of the steps as the bytes of its S + 1 tokens."""
    out = []
    for s in steps:
        for inputs, labels in feed.batches(s):
            for x, y in zip(inputs, labels):
                assert (x[1:] == y[:-1]).all()
                out.append(np.append(x.numpy(), y[-1].item()).tobytes())
    return out


def _shard_streams(tok, docs, n: int, w: int) -> list[list[bytes]]:
    """Each logical shard's windows in reading order: rows k, k + n, ... tokenized with EOS."""
    eos = tok.token_to_id("</s>")
    out = []
    for k in range(n):
        ids = [
            t for doc in docs[k::n] for t in tok.encode(doc, add_special_tokens=False).ids + [eos]
        ]
        out.append([np.array(ids[i * w : (i + 1) * w], dtype=np.int64).tobytes()
                    for i in range(len(ids) // w)])  # fmt: skip
    return out


def test_samples_are_each_logical_shards_documents_tokenized_with_eos_and_packed(d):
    cfg = cfg_of(d, d / "a.jsonl", steps=4)
    got = windows(feed_of(cfg), range(1, 5))
    tok = Tokenizer.from_file(str(d / "tok" / "tokenizer.json"))
    w = cfg.tokens.sequence_length + 1
    shards = _shard_streams(tok, make_documents(300, seed=1), 8, w)  # 8 = the global batch
    assert len(got) == 4 * 8
    for i, sample in enumerate(got):  # sample j of a step is logical shard j's
        assert sample in shards[i % 8], i
    assert [got[k] for k in range(8)] != [s[0] for s in shards]  # shuffled within each shard
    assert len({got[i] for i in range(0, 32, 8)}) == 4  # shard 0 gives a new sample each step


class _Workers:
    """W loading workers of one dp rank, run in this process (tests/unit starts none): each
    worker's iterator sees its own `get_worker_info().id`, and a step is their parts put
    together by `RankStream.assemble`, as `loader.StageLoader` does with real workers."""

    def __init__(self, cfg, dp_rank: int, dp: int, workers: int, monkeypatch, positions=None):
        self.current = 0
        monkeypatch.setattr(streaming, "get_worker_info",
                            lambda: SimpleNamespace(id=self.current))  # fmt: skip
        data = StagedData(cfg)
        self.stream = data.datasets[0].for_rank(dp_rank, dp, cfg.tokens.micro_batch_size, workers)
        if positions is not None:
            self.stream.resume_from(positions)
        self.its = [iter(self.stream) for _ in range(self.stream.workers)]

    def step(self) -> list[bytes]:
        parts = []
        for w, it in enumerate(self.its):
            self.current = w
            parts.append(next(it))
        self.current = 0  # the training process's own reads (num_loading_workers: 0) are worker 0
        out = []
        for inputs, labels in self.stream.assemble(parts):
            for x, y in zip(inputs, labels):
                out.append(np.append(x.numpy(), y[-1].item()).tobytes())
        return out


def _rank_reads(cfg, r: int, dp: int, steps, workers: int, resume, monkeypatch):
    """(rank r's samples of `steps`, its data_state after the last) with `workers` workers."""
    steps = list(steps)
    if workers == 0:
        feed = feed_of(cfg, r, dp)
        if resume is not None:
            feed.resume(resume[0], resume[1], "ck")
        got = windows(feed, steps)
        return got, copy.deepcopy(feed.data_state(steps[-1]))
    positions = None
    if resume is not None:
        positions = {k: v for saved in resume[1] for k, v in saved["positions"].items()}
    ws = _Workers(cfg, r, dp, workers, monkeypatch, positions)
    got = [x for _ in steps for x in ws.step()]
    state = {"stage": 0, "shards": ws.stream.stream.shards, "positions": ws.stream.state()}
    return got, state


def steps_at(cfg, dp: int, steps, workers: int = 0, resume=None, monkeypatch=None) -> list[bytes]:
    """The global batches of `steps` read by `dp` ranks (rank 0's samples, then rank 1's...);
    `resume`: (step, saved positions) to continue from."""
    steps = list(steps)
    per_rank = [_rank_reads(cfg, r, dp, steps, workers, resume, monkeypatch)[0] for r in range(dp)]
    n = len(per_rank[0]) // len(steps)
    return [b"".join(b"".join(rank[i * n : (i + 1) * n]) for rank in per_rank)
            for i in range(len(steps))]  # fmt: skip


def saved_at(cfg, dp: int, step: int, workers: int = 0, monkeypatch=None) -> list[dict]:
    """What a checkpoint of `step` holds when `dp` ranks streamed up to it."""
    return [_rank_reads(cfg, r, dp, range(1, step + 1), workers, None, monkeypatch)[1]
            for r in range(dp)]  # fmt: skip


def test_every_dp_reads_the_global_batches_of_one_process_and_the_seed_fixes_the_order(d):
    cfg = cfg_of(d, f"[{d / 'a.jsonl'}, {d / 'b.parquet'}]", steps=4)
    one = steps_at(cfg, 1, range(1, 5))
    assert len(set(one)) == 4
    for dp in (2, 4, 8):
        assert steps_at(cfg, dp, range(1, 5)) == one, dp
    other = cfg_of(d, f"[{d / 'a.jsonl'}, {d / 'b.parquet'}]", steps=4,
                   extra=["data_stages[0].data.seed=8"])  # fmt: skip
    assert steps_at(other, 1, range(1, 5)) != one


def test_a_folder_of_several_files_and_a_weighted_blend_read_alike_at_every_dp(
    d, tmp_path, monkeypatch
):
    folder = tmp_path / "parts"
    folder.mkdir()
    docs = make_documents(240, seed=5)
    for i in range(3):  # rows are counted per file: each file splits over the shards on its own
        write_jsonl(folder / f"part-{i}.jsonl", docs[i * 80 : (i + 1) * 80])
    cfg = cfg_of(d, f"{{{folder}: 0.6, {d / 'b.parquet'}: 0.4}}", steps=6)
    one = steps_at(cfg, 1, range(1, 7))
    assert steps_at(cfg, 4, range(1, 7), 2, monkeypatch=monkeypatch) == one
    state = saved_at(cfg, 2, 2, 1, monkeypatch)
    assert steps_at(cfg, 8, range(3, 7), resume=(2, state)) == one[2:]


def test_loading_workers_read_the_same_global_batches(d, monkeypatch):
    cfg = cfg_of(d, d / "a.jsonl", steps=3)
    one = steps_at(cfg, 1, range(1, 4))
    for dp, w in ((1, 1), (1, 2), (1, 3), (2, 2), (4, 2), (8, 2)):  # 8 x 2: one shard per rank
        assert steps_at(cfg, dp, range(1, 4), w, monkeypatch=monkeypatch) == one, (dp, w)


def test_blend_follows_the_weights(d):
    cfg = cfg_of(d, f"{{{d / 'a.jsonl'}: 0.75, {d / 'b.parquet'}: 0.25}}", steps=8)
    feed = feed_of(cfg)
    windows(feed, range(1, 9))
    positions = feed.data_state(8)["positions"]
    counts = np.sum([p["counts"] for p in positions.values()], axis=0).tolist()
    assert counts == [192, 64], counts  # one shuffle block of 32 samples per shard, 3:1


def _plain(x):
    """`x` with tensors as lists, to compare."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x.tolist() if hasattr(x, "tolist") else x


def test_resume_from_the_saved_position_continues_exactly(d):
    cfg = cfg_of(d, f"[{d / 'a.jsonl'}, {d / 'b.parquet'}]", steps=10)
    straight = steps_at(cfg, 1, range(1, 11))
    state = saved_at(cfg, 1, 4)
    assert state[0]["shards"] == 8 and state[0]["stage"] == 0
    assert sorted(state[0]["positions"]) == list(range(8))
    again = feed_of(cfg)
    again.resume(4, state, "ck/4")
    assert _plain(again.data_state(4)) == _plain(state[0])  # saved again before a step: the same
    assert steps_at(cfg, 1, range(5, 11), resume=(4, state)) == straight[4:]


@pytest.mark.parametrize("saved_dp, saved_w, dp, w", [(2, 0, 1, 0), (1, 0, 4, 0), (4, 0, 2, 2),
                                                      (2, 2, 8, 0)])  # fmt: skip
def test_resume_at_another_dp_or_worker_count_reads_what_the_uninterrupted_run_reads(
    d, saved_dp, saved_w, dp, w, monkeypatch
):
    cfg = cfg_of(d, f"[{d / 'a.jsonl'}, {d / 'b.parquet'}]", steps=8)
    straight = steps_at(cfg, 1, range(1, 9))
    state = saved_at(cfg, saved_dp, 3, saved_w, monkeypatch)
    assert len(state) == saved_dp
    assert steps_at(cfg, dp, range(4, 9), w, (3, state), monkeypatch) == straight[3:]


def test_a_resume_that_cannot_continue_exactly_is_refused_in_one_line(d):
    cfg = cfg_of(d, d / "a.jsonl", steps=6)
    state = saved_at(cfg, 2, 2)
    with pytest.raises(UserError) as e:
        feed_of(cfg).resume(2, state[:1], "ck/2")  # one dp rank's file lost
    _one_line(e, "ck/2", "logical shard(s) [4, 5, 6, 7] of 8", "start a new data stage at step 3")
    with pytest.raises(UserError) as e:
        feed_of(cfg_of(d, d / "a.jsonl", steps=6, extra=["mesh3d.stream_shards=4"])).resume(
            2, state, "ck/2")  # fmt: skip
    _one_line(e, "in 8 logical shards", "set mesh3d.stream_shards: 8")
    old = [{"stage": 0, "dp": 2, "shards": 1, "state": {}}]  # per dp rank, before logical shards
    with pytest.raises(UserError, match="before logical shards"):
        feed_of(cfg).resume(2, old, "ck/2")
    with pytest.raises(UserError, match="holds no stream position"):
        feed_of(cfg).resume(2, [], "ck/2")
    feed_of(cfg).resume(6, [], "ck/6")  # nothing left to read: nothing to refuse


def test_logical_shards_must_divide_the_batch_and_be_divided_by_dp(d):
    with pytest.raises(UserError) as e:
        feed_of(cfg_of(d, d / "a.jsonl", extra=["mesh3d.stream_shards=3"]))
    _one_line(e, "mesh3d.stream_shards 3 does not divide", "global batch of 8")
    with pytest.raises(UserError) as e:
        feed_of(cfg_of(d, d / "a.jsonl", extra=["mesh3d.stream_shards=0"]))
    _one_line(e, "must be a positive integer")
    with pytest.raises(UserError) as e:
        StagedData(cfg_of(d, d / "a.jsonl", extra=["mesh3d.stream_shards=2", "parallelism.dp=4",
                                                    "tokens.batch_accumulation_per_replica=1"]))  # fmt: skip
    _one_line(e, "2 logical shards", "dp 4 does not divide")


def _one_line(excinfo, *parts):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, msg


def test_bad_input_is_one_line_naming_the_file(d, tmp_path):
    good = [json.dumps({"text": t}) for t in make_documents(40, seed=3)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(good[:2] + ['{"text": "cut off'] + good[2:]) + "\n")
    with pytest.raises(UserError) as e:
        windows(feed_of(cfg_of(d, bad)), range(1, 7))
    _one_line(e, str(bad), "row 3", "not valid JSON")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError) as e:
        feed_of(cfg_of(d, empty))
    _one_line(e, str(empty), "is empty")
    other = write_jsonl(tmp_path / "other.jsonl", ["x y z"], column="content")
    with pytest.raises(UserError) as e:
        feed_of(cfg_of(d, other))
    _one_line(e, str(other), "no column 'text'", "content", "text_column_name")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes((d / "b.parquet").read_bytes()[:-100])
    with pytest.raises(UserError) as e:
        feed_of(cfg_of(d, broken))
    _one_line(e, str(broken), "parquet", "replace")
    short = write_jsonl(tmp_path / "short.jsonl", make_documents(20, seed=4))
    with pytest.raises(UserError) as e:
        windows(feed_of(cfg_of(d, short, steps=50)), range(1, 51))
    _one_line(e, str(short), "ran out after", "lower tokens.train_steps")


def test_validation_needs_a_map_style_first_stage(d):
    extra = ["tokens.val_check_interval=2", "tokens.limit_val_batches=1"]
    with pytest.raises(UserError, match="limit_val_batches: 0"):
        StagedData(cfg_of(d, d / "a.jsonl", extra=extra))


def test_parquet_and_a_saved_arrow_folder_stream_like_json_lines(d, tmp_path):
    import datasets

    docs = make_documents(300, seed=2)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    lines = write_jsonl(tmp_path / "b.jsonl", docs)
    want = windows(feed_of(cfg_of(d, lines, steps=3)), range(1, 4))
    assert windows(feed_of(cfg_of(d, d / "b.parquet", steps=3)), range(1, 4)) == want
    assert windows(feed_of(cfg_of(d, tmp_path / "saved", steps=3)), range(1, 4)) == want


def test_a_streamed_stage_says_so_and_names_its_sources(d):
    """Nothing said that streaming was on."""
    from logs import logged

    seen, _ = logged(lambda: StagedData(cfg_of(d, f"[{d / 'a.jsonl'}, {d / 'b.parquet'}]")))
    assert [m for m in seen if "streamed" in m] == [
        f"data_stages[0] ('s') is streamed (mesh3d.hf_streaming: true): 2 files of "
        f"{d / 'a.jsonl'}, {d / 'b.parquet'}, read row by row and tokenized in the loader"
    ]
