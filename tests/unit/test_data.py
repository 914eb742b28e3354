"""Data: the tokenize tool, Nanoset (datatrove folders, blending, epochs), the HF datasets path.

Single process and fast; the tokenizer and the text are generated locally (`data_fixtures`).

The tests of this subject that launch real processes are in `tests/launch/test_data_launch.py`."""

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import make_documents, make_tokenizer, write_jsonl
from tokenizers import Tokenizer

from mesh3d.config.schema import PretrainDatasetsArgs
from mesh3d.data.datatrove import DatatroveFolder
from mesh3d.data.dummy import microbatches
from mesh3d.data.hf import check_tokenizer_vocab, load_pretrain_dataset
from mesh3d.data.nanoset import Nanoset, check_enough, greedy_blend
from mesh3d.data.token_writer import TokenFileWriter
from mesh3d.data.tokenize import tokenize_to_folder
from mesh3d.errors import UserError

VOCAB = 800


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_documents(300, seed=0)


def expected_stream(tok_path: Path, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of `docs` tokenized one by one, EOS after each, and the document end offsets."""
    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id("</s>")
    per_doc = [tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs]
    return np.concatenate(per_doc), np.cumsum([len(d) for d in per_doc])


def write_ds(folder: Path, name: str, tokens: np.ndarray, token_bytes: int = 2, meta: bool = True):
    """A .ds file written directly (optionally with its .ds.metadata)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tokens.astype("<u2" if token_bytes == 2 else "<u4").tofile(path)
    if meta:
        Path(f"{path}.metadata").write_text(f"test-tok|{token_bytes}\n{len(tokens)}\n")
    return path


def labelled_folder(folder: Path, label: int, samples: int, seq: int) -> Path:
    """One .ds file whose sample i starts with (label, i): easy to trace in a blend."""
    windows = np.zeros((samples, seq + 1), dtype=np.int64)
    windows[:, 0] = label
    windows[:, 1] = np.arange(samples)
    write_ds(folder, "00000_unshuffled.ds", windows.ravel())
    return folder


# ---------------------------------------------------------------- the tokenize tool


def test_tool_output_reads_back_token_for_token(tmp_path, tok_path, docs):
    inputs = [write_jsonl(tmp_path / "a.jsonl", docs[:200]), tmp_path / "b.txt"]
    inputs[1].write_text("\n".join(docs[200:]) + "\n\n")  # a blank line is skipped
    ds_path, n_docs, n_tokens = tokenize_to_folder(
        str(tok_path), [str(p) for p in inputs], str(tmp_path / "out"), name="mix"
    )
    assert ds_path.name == "mix_00000_unshuffled.ds"
    want, ends = expected_stream(tok_path, docs)
    got = np.fromfile(ds_path, dtype="<u2")
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.fromfile(f"{ds_path}.index", dtype="<u8"), ends)
    meta = Path(f"{ds_path}.metadata").read_text().splitlines()
    assert meta[0] == f"{tok_path.resolve()}|2" and int(meta[1]) == len(want) == n_tokens
    assert n_docs == len(docs)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "mix_00000_unshuffled.ds",
        "mix_00000_unshuffled.ds.index",
        "mix_00000_unshuffled.ds.metadata",
    ]  # no temporary files left
    # Nanoset windows are consecutive S+1 slices of that stream
    S = 15
    folder = DatatroveFolder(tmp_path / "out", S, vocab_size=VOCAB)
    assert len(folder) == len(want) // (S + 1)
    np.testing.assert_array_equal(folder.window(3), want[3 * (S + 1) : 4 * (S + 1)])


def test_tool_parquet_and_saved_dataset_inputs(tmp_path, tok_path, docs):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("pyarrow")
    datasets.Dataset.from_dict({"body": docs[:50]}).to_parquet(str(tmp_path / "a.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs[50:80]})}).save_to_disk(
        str(tmp_path / "saved")
    )
    ds_path, _, _ = tokenize_to_folder(
        str(tok_path),
        [str(tmp_path / "a.parquet"), str(tmp_path / "saved")],
        str(tmp_path / "out"),
        text_column="body",
    )
    assert ds_path.name == "00000_unshuffled.ds"
    np.testing.assert_array_equal(
        np.fromfile(ds_path, dtype="<u2"), expected_stream(tok_path, docs[:80])[0]
    )


def test_writer_uses_uint32_above_65536_ids(tmp_path):
    ids = [[70000, 5, 65536], [1]]
    with TokenFileWriter(tmp_path / "big.ds", "big-tok", vocab_size=70001, eos=70000) as w:
        w.add(ids)
    assert Path(f"{tmp_path / 'big.ds'}.metadata").read_text().startswith("big-tok|4\n")
    got = np.fromfile(tmp_path / "big.ds", dtype="<u4")
    np.testing.assert_array_equal(got, [70000, 5, 65536, 70000, 1, 70000])
    np.testing.assert_array_equal(np.fromfile(f"{tmp_path / 'big.ds'}.index", "<u8"), [4, 6])


def test_nanoset_reads_uint32_files(tmp_path):
    tokens = np.arange(65530, 65530 + 3 * 9, dtype=np.int64)  # crosses 65535
    write_ds(tmp_path / "meta", "x.ds", tokens, token_bytes=4)
    write_ds(tmp_path / "vocab", "x.ds", tokens, token_bytes=4, meta=False)  # size from vocab
    for folder in ("meta", "vocab"):
        ds = Nanoset([tmp_path / folder], None, 8, 3, seed=1, vocab_size=70000)
        rows = sorted(int(ds[i][0][0]) for i in range(3))
        assert rows == [65530, 65539, 65548]
        x, y = ds[0]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
        assert torch.equal(x[1:], y[:-1])


def test_tool_bad_inputs(tmp_path, tok_path, docs):
    bad = write_jsonl(tmp_path / "d.jsonl", docs[:5], column="content")
    with pytest.raises(
        UserError, match=r"has no column 'text' \(it has: content, id\).*--text-column"
    ):
        tokenize_to_folder(str(tok_path), [str(bad)], str(tmp_path / "out"))
    assert list((tmp_path / "out").iterdir()) == []  # temporary files removed
    empty = tmp_path / "e.txt"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="no documents in .*e.txt"):
        tokenize_to_folder(str(tok_path), [str(empty)], str(tmp_path / "out"))
    with pytest.raises(UserError, match=r"'nothing' is not in the tokenizer's vocabulary"):
        tokenize_to_folder(str(tok_path), [str(bad)], str(tmp_path / "o"), eos_token="nothing")
    with pytest.raises(UserError, match="mesh3d runs offline: download it first"):
        tokenize_to_folder("org/some-model", [str(bad)], str(tmp_path / "o"))


# ---------------------------------------------------------------- Nanoset


def test_blend_proportions(tmp_path):
    a = labelled_folder(tmp_path / "a", 1, 400, seq=7)
    b = labelled_folder(tmp_path / "b", 2, 300, seq=7)
    ds = Nanoset([a, b], [7, 3], 7, 1000, seed=5, vocab_size=VOCAB)  # weights normalized
    one = Nanoset(str(a), None, 7, 10, seed=5, vocab_size=VOCAB)  # one folder, not in a list
    assert len(one.folders) == 1 and int(one[0][0][0]) == 1
    sources = [ds.sample_source(i)[0] for i in range(1000)]
    assert abs(sources.count(0) / 1000 - 0.7) <= 0.03
    labels = [int(ds[i][0][0]) for i in range(1000)]
    assert labels == [s + 1 for s in sources]
    for i in (0, 17, 999):  # the sample index is the window's position in its folder
        k, s = ds.sample_source(i)
        assert int(ds[i][0][1]) == s and s < (400, 300)[k]


def test_epoch_zero_is_nanotrons_index(tmp_path):
    """Reference: Nanotron's greedy (np.argmax), RandomState(seed) shuffle, truncated."""
    sizes, weights, seed = (50, 30, 20), np.array([0.5, 0.2, 0.3]), 9
    folders = [labelled_folder(tmp_path / f"f{k}", k, n, seq=3) for k, n in enumerate(sizes)]
    E = sum(sizes)
    which, sample, counts = np.zeros(E, np.int64), np.zeros(E, np.int64), np.zeros(3, np.int64)
    for j in range(E):
        k = int(np.argmax(weights * max(j, 1) - counts))
        which[j], sample[j] = k, counts[k] % sizes[k]
        counts[k] += 1
    np.testing.assert_array_equal(greedy_blend(weights, E), which)
    np.random.RandomState(seed).shuffle(which)
    np.random.RandomState(seed).shuffle(sample)
    ds = Nanoset(folders, list(weights), 3, E, seed=seed, vocab_size=VOCAB)
    want = list(zip(which.tolist(), sample.tolist()))
    assert [ds.sample_source(i) for i in range(E)] == want
    short = Nanoset(folders, list(weights), 3, E - 7, seed=seed, vocab_size=VOCAB)
    assert [short.sample_source(i) for i in range(E - 7)] == want[: E - 7]


def test_epochs_reshuffled_and_seeded(tmp_path):
    folder = labelled_folder(tmp_path / "a", 0, 64, seq=3)

    def order(seed: int) -> list[list[int]]:
        ds = Nanoset([folder], None, 3, 3 * 64, seed=seed, vocab_size=VOCAB)
        return [[ds.sample_source(e * 64 + j)[1] for j in range(64)] for e in range(3)]

    first = order(1)
    for epoch in first:
        assert sorted(epoch) == list(range(64))  # each epoch is every sample once
    assert first[0] != first[1] != first[2]
    assert order(1) == first
    assert order(2)[1] != first[1] and order(2)[0] != first[0]


def test_file_level_shuffle_is_datatroves_seed_42(tmp_path):
    names = [f"{i:05d}_unshuffled.ds" for i in range(6)]
    for i, n in enumerate(names):
        write_ds(tmp_path, n, np.full(8, i))
    folder = DatatroveFolder(tmp_path, 3, vocab_size=VOCAB)
    want = [names[i] for i in np.random.default_rng(42).permutation(len(names))]
    assert [Path(f.path).name for f in folder.files] == want
    assert [int(folder.window(2 * i)[0]) for i in range(6)] == [int(n[:5]) for n in want]


def test_same_global_batch_for_dp1_and_dp4(tmp_path):
    a = labelled_folder(tmp_path / "a", 1, 40, seq=5)
    b = labelled_folder(tmp_path / "b", 2, 25, seq=5)
    ds = Nanoset([a, b], [0.6, 0.4], 5, 10 * 16, seed=3, vocab_size=VOCAB)
    for step in (1, 5, 10):  # step 5 straddles the epoch boundary (65 samples)
        one = microbatches(ds, step, 16, 0, 1, 2)
        four = [mb for r in range(4) for mb in microbatches(ds, step, 16, r, 4, 2)]
        for i in (0, 1):
            assert torch.equal(torch.cat([m[i] for m in one]), torch.cat([m[i] for m in four]))


def test_nanoset_bad_inputs(tmp_path):
    def nanoset(folders, weights=None, vocab=VOCAB):
        return Nanoset(folders, weights, 3, 10, seed=1, vocab_size=vocab)

    with pytest.raises(UserError, match=r"dataset_folder '.*missing' does not exist"):
        nanoset([tmp_path / "missing"])
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "x.bin").write_bytes(b"12")
    with pytest.raises(UserError, match=r"'.*none' has no \*.ds files.*mesh3d.data.tokenize"):
        nanoset([tmp_path / "none"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.ds").write_bytes(b"")
    with pytest.raises(UserError, match=r"e.ds is empty \(0 bytes\)"):
        nanoset([tmp_path / "empty"])
    write_ds(tmp_path / "trunc", "t.ds", np.arange(9), meta=False)
    with open(tmp_path / "trunc" / "t.ds", "ab") as f:
        f.write(b"\x01")
    with pytest.raises(UserError, match=r"t.ds has 19 bytes, not a multiple of the token size \(2"):
        nanoset([tmp_path / "trunc"])
    write_ds(tmp_path / "oov", "o.ds", np.array([1, 2, 3, 900, 4, 5, 6, 7]))
    with pytest.raises(
        UserError, match=r"o.ds: token 3 is id 900.*vocab_size\).*tokenizer.*at least 901"
    ):
        nanoset([tmp_path / "oov"])
    good = labelled_folder(tmp_path / "good", 0, 10, seq=3)
    with pytest.raises(UserError, match=r"dataset_weights has 3 values .* dataset_folder has 2"):
        nanoset([good, good], [1, 2, 3])
    with pytest.raises(UserError, match=r"sum to 0.0; give a positive sum"):
        nanoset([good, good], [0, 0])
    write_ds(tmp_path / "short", "s.ds", np.arange(3))
    with pytest.raises(UserError, match=r"no file has the 4 tokens"):
        nanoset([tmp_path / "short"])
    with pytest.raises(UserError, match=r"'x' has 10 samples .* fewer than one global batch \(16"):
        check_enough(10, 16, "'x'")
    check_enough(16, 16, "'x'")


def test_greedy_blend_is_fast_enough():
    """Nanotron's loop is numba-jitted; ours must still do a large epoch quickly."""
    import time

    t = time.perf_counter()
    out = greedy_blend([0.7, 0.3], 200_000)
    assert time.perf_counter() - t < 2.0
    assert abs(np.bincount(out)[0] / 200_000 - 0.7) < 1e-4


# ---------------------------------------------------------------- the HF datasets path


def test_hf_path_packs_local_jsonl(tmp_path, tok_path, docs):
    pytest.importorskip("datasets")
    data = write_jsonl(tmp_path / "d.jsonl", docs[:60])
    S = 31
    args = PretrainDatasetsArgs(hf_dataset_or_datasets=str(data))
    want = expected_stream(tok_path, docs[:60])[0]
    E = len(want) // (S + 1)
    ds = load_pretrain_dataset(
        args, str(tok_path.parent), S, 7, 2 * E, VOCAB, cache_dir=str(tmp_path / "c")
    )
    assert len(ds) == 2 * E
    windows = want[: E * (S + 1)].reshape(E, S + 1)
    got = [torch.cat([ds[i][0], ds[i][1][-1:]]).numpy() for i in range(E)]
    assert sorted(map(tuple, got)) == sorted(map(tuple, windows))
    assert sorted(ds.sample_source(i)[1] for i in range(E, 2 * E)) == list(range(E))
    # the {path: fraction} form takes the first rows of each
    half = load_pretrain_dataset(
        PretrainDatasetsArgs(hf_dataset_or_datasets={str(data): 0.5}),
        str(tok_path),
        S,
        7,
        1,
        VOCAB,
        cache_dir=str(tmp_path / "c"),
    )
    assert len(half.sources[0].tokens) == len(expected_stream(tok_path, docs[:30])[0])


def test_hf_path_bad_inputs(tmp_path, tok_path, docs):
    pytest.importorskip("datasets")
    data = write_jsonl(tmp_path / "d.jsonl", docs[:5], column="content")
    cache = str(tmp_path / "c")
    args = PretrainDatasetsArgs(hf_dataset_or_datasets=str(data))
    with pytest.raises(
        UserError, match=r"no column 'text' \(it has: content, id\).*text_column_name"
    ):
        load_pretrain_dataset(args, str(tok_path), 7, 1, 10, VOCAB, cache_dir=cache)
    args = PretrainDatasetsArgs(hf_dataset_or_datasets="HuggingFaceFW/fineweb")
    with pytest.raises(
        UserError, match=r"'HuggingFaceFW/fineweb' is not a local.*download it first"
    ):
        load_pretrain_dataset(args, str(tok_path), 7, 1, 10, VOCAB, cache_dir=cache)
    with pytest.raises(UserError, match=r"tokenizer 'org/tok' is not a local.*download it first"):
        load_pretrain_dataset(args, "org/tok", 7, 1, 10, VOCAB, cache_dir=cache)


def test_tokenizer_vocab_larger_than_model(tok_path):
    check_tokenizer_vocab(str(tok_path), VOCAB)
    msg = re.escape(f"has {VOCAB} ids (with added tokens) but model.model_config.vocab_size is 500")
    with pytest.raises(UserError, match=msg + ".*at least 800"):
        check_tokenizer_vocab(str(tok_path), 500)


def test_consumed_lines_agree_after_resuming_at_another_batch_size():
    """Resumed from step 5 of a run with 32 samples per step, now at 16: the data line counts
    what the checkpoint's run consumed (160), as the start line does, not 5 x 16."""
    from mesh3d.data.stages import consumed_in_stage

    assert consumed_in_stage([1], 6, 16, resumed=(5, 160)) == 160
    assert consumed_in_stage([1], 9, 16, resumed=(5, 160)) == 160 + 3 * 16
    assert consumed_in_stage([1, 10], 12, 16, resumed=(5, 160)) == 2 * 16  # a later stage
    assert consumed_in_stage([1], 6, 16) == 80  # not resumed: steps x batch


@pytest.mark.parametrize("train_steps, step, remaining", [(3, 1, 3), (20, 1, 9), (20, 10, 11)])
def test_the_training_plan_line_counts_the_steps_the_run_will_train(train_steps, step,
                                                                    remaining, caplog):  # fmt: skip
    """Stages from steps 1 and 10: a run of 3 steps said its first stage "has 9 remaining
    training steps" (to the next stage's start); it has 3 (a fresh clone's first hour)."""
    from mesh3d.data.build import StagedData

    data = StagedData.__new__(StagedData)  # the line needs only the stage table
    data.names, data.starts, data.train_steps, data.gbs = ["a", "b"], [1, 10], train_steps, 4
    data._logged, data.resumed = None, None
    with caplog.at_level(logging.INFO, logger="mesh3d"):
        data.log_stage(step)
    assert f"has {remaining} remaining training steps" in caplog.text, caplog.text
