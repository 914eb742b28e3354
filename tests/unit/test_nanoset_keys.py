"""Nanotron HEAD's Nanoset keys: `dataset_max_tokens` (a cap per folder, datatrove's
arithmetic), `dataset_read_path` (a local copy read first), and the two flags that change
nothing (`skip_in_stream`, `pad_samples_to_global_batch_size`)."""

import numpy as np
import pytest
from test_data import write_ds

from mesh3d.data.datatrove import DatatroveFolder
from mesh3d.data.nanoset import Nanoset
from mesh3d.errors import UserError

S = 7  # samples are S + 1 = 8 tokens
VOCAB = 1000


def numbered_file(folder, name: str, file_id: int, tokens: int):
    """A .ds file of `tokens` tokens whose window i starts with (file_id, i)."""
    t = np.zeros(tokens, dtype=np.int64)
    t[0 :: S + 1] = file_id
    t[1 :: S + 1] = np.arange(len(t[1 :: S + 1]))
    return write_ds(folder, name, t)


def capped_lengths(file_tokens: list[int], max_tokens: int) -> list[int]:
    """Nanotron's (datatrove's) cap, written out: files in sorted order, each min(left, its
    tokens) // (S+1) samples; `left` drops by samples * (S+1); stop once left <= 0."""
    out, left = [], max_tokens
    for n in file_tokens:
        out.append(min(left, n) // (S + 1))
        left -= out[-1] * (S + 1)
        if left <= 0:
            break
    return out


def test_max_tokens_caps_the_folder_like_nanotron(tmp_path):
    sizes = [50, 30, 100, 64]  # tokens of files a..d (sorted order)
    for k, n in enumerate(sizes):
        numbered_file(tmp_path, f"{'abcd'[k]}.ds", k + 1, n)
    whole = DatatroveFolder(tmp_path, S, vocab_size=VOCAB)
    assert len(whole) == sum(n // (S + 1) for n in sizes) == 6 + 3 + 12 + 8
    with pytest.raises(
        UserError,
        match=r"dataset_max_tokens 7 of dataset_folder .* less than one sample \(8 tokens",
    ):
        DatatroveFolder(tmp_path, S, vocab_size=VOCAB, max_tokens=7)
    for cap in (8, 20, 48, 60, 85, 1000):
        want = capped_lengths(sizes, cap)
        folder = DatatroveFolder(tmp_path, S, vocab_size=VOCAB, max_tokens=cap)
        assert sorted(len(f) for f in folder.files) == sorted(want), cap
        assert len(folder) == sum(want), cap
        # the kept files are the first ones in sorted order, each from its start
        seen = {(int(w[0]), int(w[1])) for w in map(folder.window, range(len(folder)))}
        assert seen == {(k + 1, i) for k, n in enumerate(want) for i in range(n)}, cap
    # 60 tokens: a gives 6 samples (48 tokens), b min(12, 30) // 8 = 1 sample, then 4 left
    # for c: 0 samples, and d: 0 samples; the list ends when the files do
    assert capped_lengths(sizes, 60) == [6, 1, 0, 0]


def test_max_tokens_caps_the_samples_a_blend_draws(tmp_path):
    for k, n in enumerate([400, 400]):
        numbered_file(tmp_path / "big", f"{k}.ds", 10 + k, n)
    numbered_file(tmp_path / "small", "0.ds", 20, 160)
    folders = [tmp_path / "big", tmp_path / "small"]
    uncapped = Nanoset(folders, None, S, 200, seed=5, vocab_size=VOCAB)
    assert uncapped.sizes == [100, 20]
    ds = Nanoset(folders, None, S, 200, seed=5, vocab_size=VOCAB, max_tokens=[80, 10**6])
    assert ds.sizes == [10, 20] and ds.weights == [1 / 3, 2 / 3]  # weights follow the cap
    drawn = [ds[i][0][:2].tolist() for i in range(200)]
    big = {tuple(x) for x in drawn if x[0] in (10, 11)}
    assert big == {(10, i) for i in range(10)}  # only file 0's first 10 windows, repeated
    assert sum(x[0] == 20 for x in drawn) > sum(x[0] in (10, 11) for x in drawn)


def test_read_path_reads_the_local_copy_and_falls_back(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    numbered_file(remote, "a.ds", 1, 40)
    numbered_file(remote, "b.ds", 2, 40)
    numbered_file(local, "a.ds", 9, 40)  # the copy of a.ds (marked 9 to tell them apart)
    folder = DatatroveFolder(remote, S, vocab_size=VOCAB, read_path=local)
    paths = sorted(f.path for f in folder.files)
    assert paths == [str(local / "a.ds"), str(remote / "b.ds")]
    marks = {int(folder.window(i)[0]) for i in range(len(folder))}
    assert marks == {9, 2}
    # no copy of anything: everything from the folder
    empty = tmp_path / "empty"
    empty.mkdir()
    folder = DatatroveFolder(remote, S, vocab_size=VOCAB, read_path=empty)
    assert {int(folder.window(i)[0]) for i in range(len(folder))} == {1, 2}
    # a copy of another size (a partial download) is refused, not read
    numbered_file(empty, "b.ds", 2, 24)
    with pytest.raises(
        UserError, match=r"b.ds has 48 bytes but .*remote/b.ds has 80: the local copy"
    ):
        DatatroveFolder(remote, S, vocab_size=VOCAB, read_path=empty)
    # a folder that is not local (Nanotron's s3:// case): the copy lists and holds the files
    folder = DatatroveFolder("s3://bucket/data", S, vocab_size=VOCAB, read_path=local)
    assert [f.path for f in folder.files] == [str(local / "a.ds")] and len(folder) == 5


def test_nanoset_keys_in_a_config_build_that_dataset(tmp_path):
    from test_config import base, check

    from mesh3d.data.build import build_dataset

    numbered_file(tmp_path / "remote", "a.ds", 1, 4000)
    numbered_file(tmp_path / "remote", "b.ds", 2, 4000)
    numbered_file(tmp_path / "local", "a.ds", 3, 4000)
    d = base()
    d["model"]["model_config"]["vocab_size"] = VOCAB
    d["tokens"].update(sequence_length=S, train_steps=4)
    d["data_stages"][0]["data"]["dataset"] = {
        "dataset_folder": str(tmp_path / "remote"), "dataset_read_path": str(tmp_path / "local"),
        "dataset_max_tokens": [4000 + 8 * 10], "skip_in_stream": True,
        "pad_samples_to_global_batch_size": True,
    }  # fmt: skip
    cfg = check(d)
    ds = build_dataset(cfg, 0)
    assert ds.sizes == [500 + 10]  # a.ds (from the copy) whole, then 10 samples of b.ds
    marks = {int(ds.window_sample(0, i)[0][0]) for i in range(510)}
    assert marks == {3, 2}


def test_a_stage_with_its_own_sequence_length_cuts_its_samples_at_it(tmp_path):
    from test_config import base, check

    from mesh3d.data.build import StagedData, build_dataset

    numbered_file(tmp_path, "a.ds", 1, 4000)
    d = base()
    d["model"]["model_config"].update(vocab_size=VOCAB, max_position_embeddings=64)
    d["tokens"].update(sequence_length=S, train_steps=6)
    dataset = {"dataset_folder": str(tmp_path)}
    d["data_stages"] = [
        {"name": "short", "start_training_step": 1, "data": {"dataset": dataset}},
        {"name": "long", "start_training_step": 4, "sequence_length": 31, "data": {"dataset": dataset}},
    ]  # fmt: skip
    cfg = check(d)
    short, long = build_dataset(cfg, 0), build_dataset(cfg, 1)
    assert short[0][0].shape == (S,) and long[0][0].shape == (31,)
    assert long.epoch_len == 4000 // 32 and short.epoch_len == 4000 // 8
    data = StagedData(cfg)
    assert [data.sequence_length_at(s) for s in range(1, 7)] == [S] * 3 + [31] * 3
    gbs = data.gbs
    assert data.tokens_through(5, gbs) == 3 * gbs * S + 2 * gbs * 31
    assert data.tokens_through(2, 3) == 2 * 3 * S


def test_a_blend_of_empty_sources_is_one_line_naming_them():
    """Blending by size with every source empty is a `UserError` (it was a ZeroDivisionError)."""
    from mesh3d.data.nanoset import BlendedSamples

    class Empty:
        def __len__(self) -> int:
            return 0

    with pytest.raises(UserError, match="all 2 data sources to blend are empty"):
        BlendedSamples([Empty(), Empty()], None, num_samples=4, seed=0)
