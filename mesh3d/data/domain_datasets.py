"""Nanotron's DoReMi data: one pre-tokenized Hugging Face dataset per domain (docs/doremi.md).

Nanotron's `examples/doremi` reads, for each name of `doremi.domain_names`, the dataset saved
with `datasets`' `save_to_disk` in the folder `<hf_dataset_or_datasets>/<name>` (its scripts
build exactly that path), and takes each row's `input_ids` (token ids) as one sample. A stage
with `hf_dataset_or_datasets` in a run with a `doremi:` section is read that way here: domain k
is the folder of `domain_names[k]`, and the domains are blended like Nanoset folders
(`BlendedSamples`, so `data/domains.py` knows each sample's domain). Each domain's rows are
concatenated and cut into non-overlapping windows of S+1 tokens (the tail dropped), as a
Nanoset folder is: rows of S+1 tokens, Nanotron's form, are the samples as they are, and a
shorter `sequence_length` still reads the same data. The token ids stay in the memory-mapped
Arrow files. Other columns (Nanotron's `domain_ids`) and the text keys (`text_column_name`,
`hf_dataset_config_name`) are not read, as in Nanotron; a saved `DatasetDict` gives the splits
of `hf_dataset_splits`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mesh3d.checks.doremi_checks import domain_names, sampling_weights
from mesh3d.config.schema import PretrainDatasetsArgs
from mesh3d.data.hf import _datasets
from mesh3d.data.nanoset import BlendedSamples, check_enough
from mesh3d.errors import UserError

KEY = "hf_dataset_or_datasets"


class DomainRows:
    """One domain's `input_ids` rows, concatenated, as windows of S+1 tokens (a `WindowSource`).
    `folder` identifies the windows for held-out validation (`data/validation.py`)."""

    def __init__(self, folder: Path, column, seq_len: int):
        self.folder, self.seq_len = str(folder), seq_len
        values = [chunk.flatten() for chunk in column.chunks]  # zero-copy views of the rows
        if any(v.null_count for v in values):
            raise UserError(f"{folder}: `input_ids` has missing (null) token ids; drop those rows")
        self.parts = [v.to_numpy(zero_copy_only=True) for v in values if len(v)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])  # token offset of each part
        self.tokens = int(self.starts[-1])

    def __len__(self) -> int:
        return self.tokens // (self.seq_len + 1)

    def window(self, index: int) -> np.ndarray:
        begin = index * (self.seq_len + 1)
        end = begin + self.seq_len + 1
        k = int(np.searchsorted(self.starts, begin, side="right")) - 1
        pieces = []
        while begin < end:  # a window may straddle the Arrow chunks
            part, offset = self.parts[k], begin - int(self.starts[k])
            piece = part[offset : offset + end - begin]
            pieces.append(piece)
            begin, k = begin + len(piece), k + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def max_id(self) -> int:
        return max((int(p.max()) for p in self.parts), default=-1)


def _load(datasets, folder: Path, name: str, splits: list[str]):
    """The rows saved in `folder` (domain `name`), the splits of a saved `DatasetDict` joined."""
    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # datasets raises many types for a folder it cannot read
        raise UserError(
            f"{folder} (domain {name!r}) is not a dataset saved with save_to_disk "
            f"({type(e).__name__}: {e}); save the domain's tokenized rows there with "
            "`datasets.Dataset.save_to_disk`"
        ) from None
    if not isinstance(ds, datasets.DatasetDict):
        return ds
    missing = [s for s in splits if s not in ds]
    if missing:
        raise UserError(
            f"{folder} (domain {name!r}) has splits {', '.join(ds)}; hf_dataset_splits asks "
            f"for {', '.join(missing)}"
        )
    return datasets.concatenate_datasets([ds[s] for s in splits])


def domain_rows(root: str, name: str, seq_len: int, vocab_size: int, splits: list[str],
                where: str) -> DomainRows:  # fmt: skip
    """Domain `name`'s rows under `root`, checked: the folder, the column, the ids, the size."""
    datasets = _datasets()
    folder = Path(root) / name
    if not folder.is_dir():
        there = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        raise UserError(
            f"{folder} is missing: `doremi.domain_names` names {name!r}, which {where} reads "
            f"from that folder of {KEY} (it holds: {', '.join(there) or 'no folder'}); save the "
            "domain's dataset there with save_to_disk, or spell the name as its folder"
        )
    ds = _load(datasets, folder, name, splits)
    if "input_ids" not in ds.column_names:
        raise UserError(
            f"{folder} (domain {name!r}) has no `input_ids` column (it has: "
            f"{', '.join(ds.column_names)}); DoReMi's domain datasets are pre-tokenized, one "
            "list of token ids per row: tokenize it first (or give a Nanoset stage)"
        )
    column = ds.data.column("input_ids")
    value_type = getattr(column.type, "value_type", None)
    if value_type is None or not str(value_type).startswith(("int", "uint")):
        raise UserError(
            f"{folder} (domain {name!r}): `input_ids` is {column.type}, not lists of integer "
            "token ids; tokenize the domain first"
        )
    rows = DomainRows(folder, column, seq_len)
    if rows.max_id() >= vocab_size:
        raise UserError(
            f"{folder} (domain {name!r}) has token id {rows.max_id()}, but the model's "
            f"vocabulary has {vocab_size} ids (model.model_config.vocab_size); tokenize with "
            "the model's tokenizer, or raise vocab_size"
        )
    if len(rows) == 0:
        raise UserError(
            f"{folder} (domain {name!r}) has {rows.tokens} tokens, fewer than the {seq_len + 1} "
            "(sequence_length + 1) of one sample; add data or lower sequence_length"
        )
    return rows


def load_domain_datasets(cfg, args: PretrainDatasetsArgs, seq_len: int, seed: int,
                         num_samples: int, global_batch: int, where: str) -> BlendedSamples:  # fmt: skip
    """The stage's `num_samples` samples blended from its domains by the DoReMi sampling weights
    (`doremi_checks.sampling_weights`; None: the domains' sample counts, Nanotron's
    token-count weights), at least one global batch. `ds[i]` -> (input_ids [S], label_ids [S])."""
    root = args.hf_dataset_or_datasets
    if not isinstance(root, str) or not Path(root).is_dir():
        raise UserError(
            f"`{where}.data.dataset.{KEY}` {root!r} is not a folder; with a `doremi:` section "
            "it is Nanotron's DoReMi data: a folder holding one dataset per domain, saved with "
            "save_to_disk in a subfolder named as in doremi.domain_names"
        )
    splits = args.hf_dataset_splits
    splits = [splits] if isinstance(splits, str) else list(splits)
    vocab = cfg.model.model_config.vocab_size
    sources = [domain_rows(root, n, seq_len, vocab, splits, where)
               for n in domain_names(cfg.doremi)]  # fmt: skip
    ds = BlendedSamples(sources, sampling_weights(cfg), num_samples, seed)
    check_enough(ds.epoch_len, global_batch, f"{where} {KEY} {root!r}")
    return ds


def build_stage(s) -> BlendedSamples:
    """A stage of Nanotron's DoReMi data (a `doremi:` section; `data/build.py`'s `StageData`)."""
    return load_domain_datasets(s.cfg, s.dataset, s.seq, s.seed, s.num_samples, s.gbs, s.where)
