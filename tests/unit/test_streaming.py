"""Streamed HF text (`mesh3d.hf_streaming`, `mesh3d.data.streaming`) in the training process
(`num_loading_workers: 0`; the workers and a whole resumed run are in
`tests/ranks/test_streaming_ranks.py`): the samples, their split over dp ranks, the saved
position, the refusals and the bad-input lines."""

from __future__ import annotations

import copy
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_fixtures import make_documents, make_tokenizer, write_jsonl
from parity import TINY
from tokenizers import Tokenizer

from mesh3d.config import apply_overrides, config_from_dict
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


def test_samples_are_the_documents_tokenized_with_eos_and_packed(d):
    cfg = cfg_of(d, d / "a.jsonl", steps=4)
    got = b"".join(windows(feed_of(cfg), range(1, 5)))
    tok = Tokenizer.from_file(str(d / "tok" / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    ids = [
        t
        for doc in make_documents(300, seed=1)
        for t in tok.encode(doc, add_special_tokens=False).ids + [eos]
    ]
    w = cfg.tokens.sequence_length + 1
    stream = [
        np.array(ids[i * w : (i + 1) * w], dtype=np.int64).tobytes() for i in range(len(ids) // w)
    ]
    samples = [got[i : i + 8 * w] for i in range(0, len(got), 8 * w)]
    assert samples and all(s in stream for s in samples)  # whole windows, shuffled in blocks
    assert samples[:8] != stream[:8]  # and shuffled


def test_dp_ranks_split_the_rows_without_duplicates_and_the_seed_fixes_the_order(d):
    cfg = cfg_of(d, d / "a.jsonl", steps=4)
    r0, r1 = (windows(feed_of(cfg, r, 2), range(1, 5)) for r in (0, 1))
    assert not set(r0) & set(r1)
    assert r0 == windows(feed_of(cfg, 0, 2), range(1, 5))
    other = cfg_of(d, d / "a.jsonl", steps=4, extra=["data_stages[0].data.seed=8"])
    assert windows(feed_of(other, 0, 2), range(1, 5)) != r0


def test_blend_follows_the_weights(d):
    cfg = cfg_of(d, f"{{{d / 'a.jsonl'}: 0.75, {d / 'b.parquet'}: 0.25}}", steps=8)
    feed = feed_of(cfg)
    for s in range(1, 9):
        feed.batches(s)
    counts = feed.loader.loader.dataset._shard.counts
    assert counts == [192, 64], counts  # one shuffle block of 256 samples read, 3:1


def _plain(x):
    """`x` with tensors as lists, to compare."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x.tolist() if hasattr(x, "tolist") else x


def test_resume_from_the_saved_position_continues_exactly(d):
    cfg = cfg_of(d, f"[{d / 'a.jsonl'}, {d / 'b.parquet'}]", steps=10)
    feed = feed_of(cfg)
    straight = windows(feed, range(1, 11))
    feed = feed_of(cfg)
    windows(feed, range(1, 5))
    state = feed.data_state(4)
    assert state["dp"] == 1 and state["shards"] == 1 and state["stage"] == 0
    again = feed_of(cfg)
    again.resume(4, state, "ck/4")
    assert _plain(again.data_state(4)) == _plain(state)  # saved again before a step: the same
    assert windows(again, range(5, 11)) == straight[4 * 8 :]


def test_resume_at_another_dp_or_without_a_position_is_refused(d):
    cfg = cfg_of(d, d / "a.jsonl", steps=6)
    feed = feed_of(cfg, 0, 2)
    windows(feed, range(1, 3))
    state = feed.data_state(2)
    with pytest.raises(UserError) as e:
        feed_of(cfg, 0, 1).resume(2, state, "ck/2")
    msg = str(e.value)
    assert "\n" not in msg and "at dp 2" in msg and "this run has dp 1" in msg
    assert "start a new data stage at step 3" in msg
    with pytest.raises(UserError, match="holds no stream position"):
        feed_of(cfg).resume(2, None, "ck/2")
    feed_of(cfg).resume(6, None, "ck/6")  # nothing left to read: nothing to refuse


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
    import logging

    from mesh3d.log import logger

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        StagedData(cfg_of(d, f"[{d / 'a.jsonl'}, {d / 'b.parquet'}]"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [m for m in seen if "streamed" in m] == [
        f"data_stages[0] ('s') is streamed (mesh3d.hf_streaming: true): 2 files of "
        f"{d / 'a.jsonl'}, {d / 'b.parquet'}, read row by row and tokenized in the loader"
    ]
