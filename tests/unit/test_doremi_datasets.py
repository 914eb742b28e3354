"""Nanotron's DoReMi data (`data/domain_datasets.py`, docs/doremi.md): with a `doremi:` section,
`hf_dataset_or_datasets` is a folder holding one dataset per domain, saved by `datasets`'
`save_to_disk` in a subfolder named as the domain, with an `input_ids` column. Such a stage
reads exactly the samples, in the same order and from the same domains, as the same tokens in
one Nanoset folder per domain, whatever the weights (given, uniform for a proxy, the domains'
sizes); rows of S+1 tokens, Nanotron's form, are the samples as they are; Nanotron's four
example configs build their data from such a folder; and each bad input is one line naming
the folder or key (a `UserError`: exit 2). The runs are in
`tests/ranks/test_doremi_datasets_ranks.py`."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
from parity import TINY

from mesh3d.checks import validation_errors
from mesh3d.checks.doremi_checks import domain_names
from mesh3d.config import apply_overrides, config_from_dict, load_config
from mesh3d.data.build import StagedData
from mesh3d.data.token_writer import TokenFileWriter
from mesh3d.errors import UserError
from mesh3d.train.doremi import sampling_config

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

CONFIGS = Path(__file__).parents[1] / "configs"
EXAMPLES = sorted(CONFIGS.glob("nanotron_doremi_*.yaml"))
VOCAB = TINY["model"]["model_config"]["vocab_size"]
SEQ = TINY["tokens"]["sequence_length"]
NAMES = ["Github", "ArXiv", "Wikipedia (en)"]
EOS = 0


def write_domain_datasets(root: Path, names: list[str], rows_per_domain: list[list[list[int]]],
                          shards: int = 1) -> Path:  # fmt: skip
    """Nanotron's layout: `root/<name>` saved by save_to_disk, `input_ids` and `domain_ids`."""
    for k, (name, rows) in enumerate(zip(names, rows_per_domain, strict=True)):
        ds = datasets.Dataset.from_dict({"input_ids": rows, "domain_ids": [k] * len(rows)})
        ds.save_to_disk(str(root / name), num_shards=min(shards, len(rows)))
    return root


def _documents(seed: int) -> list[list[list[int]]]:
    """Each domain's documents, of uneven lengths (windows straddle documents and shards)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(1, VOCAB, int(rng.integers(5, 40))).tolist() for _ in range(6 + 5 * k)]
            for k in range(len(NAMES))]  # fmt: skip


def _cfg(dataset: dict, doremi: dict, names: list[str] = NAMES):
    d = copy.deepcopy(TINY)
    d["data_stages"][0]["data"]["dataset"] = dataset
    d["doremi"] = dict(domain_names=", ".join(names), **doremi)
    d["tokens"]["train_steps"] = 6
    return config_from_dict(d)


def _hf(root: Path, doremi: dict, names: list[str] = NAMES, *overrides: str):
    cfg = _cfg(dict(hf_dataset_or_datasets=str(root)), doremi, names)
    return apply_overrides(cfg, list(overrides))


WEIGHTS = {
    "given": dict(domain_weights="0.2, 0.5, 0.3"),
    "proxy-uniform": dict(ref_model_resume_checkpoint_path="/ref"),
    "sizes": {},
}


@pytest.mark.parametrize("doremi", WEIGHTS.values(), ids=WEIGHTS.keys())
def test_domain_datasets_read_the_samples_of_the_same_nanoset_folders(tmp_path, doremi):
    docs = _documents(1)
    rows = [[d + [EOS] for d in domain] for domain in docs]  # TokenFileWriter adds the EOS
    hf_root = write_domain_datasets(tmp_path / "hf", NAMES, rows, shards=2)
    folders = []
    for name, documents in zip(NAMES, docs, strict=True):
        (tmp_path / "ds" / name).mkdir(parents=True)
        with TokenFileWriter(tmp_path / "ds" / name / "0.ds", "t", VOCAB, eos=EOS) as w:
            w.add(documents)
        folders.append(str(tmp_path / "ds" / name))
    nanoset_cfg = _cfg(dict(dataset_folder=folders), doremi)
    hf_cfg = _hf(hf_root, doremi)
    assert validation_errors(hf_cfg) == [] and validation_errors(nanoset_cfg) == []
    hf = StagedData(sampling_config(hf_cfg)).datasets[0]
    nanoset = StagedData(sampling_config(nanoset_cfg)).datasets[0]
    assert hf.sizes == nanoset.sizes and min(hf.sizes) > 0
    assert hf.weights == pytest.approx(nanoset.weights, abs=1e-15)
    assert len(hf) == len(nanoset) == 6 * 8  # train_steps * global batch
    for i in range(len(hf)):
        assert hf.sample_source(i) == nanoset.sample_source(i)
        for a, b in zip(hf[i], nanoset[i], strict=True):
            assert a.tolist() == b.tolist()


def test_rows_of_s_plus_1_tokens_are_the_samples(tmp_path):
    """Nanotron's form: every row is one sample; domain k's sample j is its row j."""
    rng = np.random.default_rng(2)
    rows = [[rng.integers(0, VOCAB, SEQ + 1).tolist() for _ in range(4 + k)]
            for k in range(len(NAMES))]  # fmt: skip
    root = write_domain_datasets(tmp_path, NAMES, rows, shards=2)
    ds = StagedData(sampling_config(_hf(root, {}))).datasets[0]
    assert ds.sizes == [4, 5, 6]
    assert ds.weights == pytest.approx([4 / 15, 5 / 15, 6 / 15])  # Nanotron's count weights
    seen = set()
    for i in range(len(ds)):
        k, j = ds.sample_source(i)
        inputs, labels = ds[i]
        assert inputs.tolist() + labels.tolist()[-1:] == rows[k][j]
        seen.add((k, j))
    assert len(seen) == 15  # 48 samples: the whole epoch of 15 rows, then again


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_nanotrons_example_configs_read_a_local_folder(tmp_path, path):
    names = domain_names(load_config(str(path)).doremi)
    rows = [[list(range(k, k + 17)) for _ in range(4)] for k in range(len(names))]
    root = write_domain_datasets(tmp_path, names, rows)
    cfg = apply_overrides(load_config(str(path)), [
        f"data_stages[0].data.dataset.hf_dataset_or_datasets={root}", "tokens.sequence_length=16",
        "tokens.micro_batch_size=4", "parallelism.dp=1", "parallelism.tp=1",
        "tokens.train_steps=2", "model.model_config.vocab_size=64"])  # fmt: skip
    assert validation_errors(cfg) == []
    ds = StagedData(sampling_config(cfg)).datasets[0]
    assert ds.sizes == [4] * 22 and len(ds) == 8
    k, j = ds.sample_source(0)
    assert ds[0][0].tolist() == list(range(k, k + 16))  # domain k's rows start at id k


def _one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message and isinstance(e.value, UserError)  # exit 2, one line
    return message


def _two(tmp_path: Path) -> Path:
    return write_domain_datasets(tmp_path / "d", NAMES[:2], [[list(range(1, 18))] * 3] * 2)


def test_a_missing_domain_folder_names_it_and_what_is_there(tmp_path):
    root = _two(tmp_path)
    with pytest.raises(UserError) as e:
        StagedData(_hf(root, {}, ["Github", "Arxiv"]))
    assert _one_line(e) == (
        f"{root / 'Arxiv'} is missing: `doremi.domain_names` names 'Arxiv', which "
        "data_stages[0] ('s') reads from that folder of hf_dataset_or_datasets (it holds: ArXiv, "
        "Github); save the domain's dataset there with save_to_disk, or spell the name as its folder"
    )


def test_a_missing_root_folder_names_the_key(tmp_path):
    with pytest.raises(UserError) as e:
        StagedData(_hf(tmp_path / "nowhere", {}, NAMES[:2]))
    assert _one_line(e).startswith(
        f"`data_stages[0] ('s').data.dataset.hf_dataset_or_datasets` '{tmp_path / 'nowhere'}' is "
        "not a folder; with a `doremi:` section it is Nanotron's DoReMi data: a folder holding "
        "one dataset per domain"
    )


def test_a_domain_without_input_ids_names_its_columns(tmp_path):
    root = _two(tmp_path)
    datasets.Dataset.from_dict({"text": ["a b"]}).save_to_disk(str(root / "Wiki"))
    with pytest.raises(UserError) as e:
        StagedData(_hf(root, {}, ["Github", "Wiki"]))
    assert _one_line(e).startswith(
        f"{root / 'Wiki'} (domain 'Wiki') has no `input_ids` column (it has: text); DoReMi's "
        "domain datasets are pre-tokenized"
    )


BAD_DOMAINS = [
    ("not-saved", lambda p: (p.mkdir(), (p / "x.txt").write_text("x")), "is not a dataset saved with save_to_disk"),
    ("text-ids", lambda p: datasets.Dataset.from_dict({"input_ids": [["a"] * 17]}).save_to_disk(str(p)), "`input_ids` is list<item: string>, not lists of integer token ids"),
    ("too-large-id", lambda p: datasets.Dataset.from_dict({"input_ids": [[VOCAB] * 17]}).save_to_disk(str(p)), f"has token id {VOCAB}, but the model's vocabulary has {VOCAB} ids"),
    ("too-short", lambda p: datasets.Dataset.from_dict({"input_ids": [[1] * 16]}).save_to_disk(str(p)), "has 16 tokens, fewer than the 17 (sequence_length + 1) of one sample"),
]  # fmt: skip


@pytest.mark.parametrize("make, message", [b[1:] for b in BAD_DOMAINS],
                         ids=[b[0] for b in BAD_DOMAINS])  # fmt: skip
def test_a_bad_domain_dataset_is_one_line(tmp_path, make, message):
    root = _two(tmp_path)
    make(root / "Bad")
    with pytest.raises(UserError) as e:
        StagedData(_hf(root, {}, ["Github", "Bad"]))
    text = _one_line(e)
    assert text.startswith(f"{root / 'Bad'}") and message in text, text


def test_without_the_datasets_package_one_line(tmp_path, monkeypatch):
    root = _two(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(UserError) as e:
        StagedData(_hf(root, {}, NAMES[:2]))
    assert _one_line(e).startswith("hf_dataset_or_datasets needs the `datasets` package")


def test_a_list_of_folders_or_streaming_is_refused_by_the_checks(tmp_path):
    listed = _hf(
        tmp_path, {}, NAMES[:2], "data_stages[0].data.dataset.hf_dataset_or_datasets=[a, b]"
    )
    assert validation_errors(listed) == [
        "`data_stages[0] ('s').data.dataset.hf_dataset_or_datasets` is ['a', 'b']; with a "
        "`doremi:` section it is one folder holding one dataset per domain (Nanotron's DoReMi "
        "form), named as in domain_names: give that folder"
    ]
    streamed = _hf(tmp_path, {}, NAMES[:2], "mesh3d.hf_streaming=true")
    assert validation_errors(streamed) == [
        "`mesh3d.hf_streaming` streams text; `data_stages[0] ('s')` with a `doremi:` section "
        "reads pre-tokenized domain datasets: set mesh3d.hf_streaming to false"
    ]
