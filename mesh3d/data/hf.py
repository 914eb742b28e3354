"""The `PretrainDatasetsArgs` path: local text datasets through Hugging Face `datasets`.

mesh3d runs offline, so `hf_dataset_or_datasets` names local data only: a `.json`/`.jsonl`
(JSON Lines), `.parquet`, `.arrow` (as `save_to_disk` writes them), `.txt` (one row per line)
or `.csv` file, a folder of such files (loaded with
`datasets.load_dataset(folder, name=hf_dataset_config_name)`), or a folder written by
`save_to_disk` (`load_from_disk`; a saved `DatasetDict` is split by `hf_dataset_splits`, a
saved `Dataset` is taken whole). A hub id that is not a local path is a `UserError` saying to
download it first. Several splits are concatenated. The `{path: fraction}` form takes the first
int(fraction * rows) rows of each, concatenates them and shuffles the rows with seed 42, as
Nanotron does; a list of paths is concatenated (Nanotron does not handle lists).

Tokenization: `text_column_name` is tokenized with the `tokenizers` Tokenizer of
`tokenizer.tokenizer_name_or_path`, in `datasets.map` batches on
`dataset_processing_num_proc_per_process` processes. As in `mesh3d.data.tokenize` (and
datatrove), the tokenizer's own special tokens (e.g. BOS) are not added and EOS (`</s>`,
`<|endoftext|>`, `<|end_of_text|>` or `<eos>`, the first the tokenizer has; none if it has
none) follows every document. Packing differs from Nanotron's `clm_process`, on purpose: all
documents are concatenated once and cut into NON-overlapping windows of S+1 tokens (the tail is
dropped), like a Nanoset file, instead of per-1000-document chunks overlapping by one token.
The tokens are held in memory (the path is meant for small local datasets; tokenize large
corpora with `python -m mesh3d.data.tokenize` and use a Nanoset). Samples are then served by
`BlendedSamples`: shuffled per epoch from `data.seed`, repeated when the run needs more.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mesh3d.config.schema import PretrainDatasetsArgs
from mesh3d.data.nanoset import BlendedSamples
from mesh3d.data.tokenizer import check_tokenizer_vocab, find_eos, load_tokenizer  # noqa: F401
from mesh3d.errors import UserError

_FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
    ".csv": "csv",
}
_MAP_BATCH = 1000  # documents per datasets.map batch


class TokenWindows:
    """Non-overlapping windows of S+1 tokens over one in-memory token array (tail dropped)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // (self.seq_len + 1)

    def window(self, index: int) -> np.ndarray:
        w = self.seq_len + 1
        return self.tokens[index * w : (index + 1) * w]


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError(
            "hf_dataset_or_datasets needs the `datasets` package: pip install datasets "
            "(or tokenize into a folder with `python -m mesh3d.data.tokenize` and use dataset_folder)"
        ) from None
    return datasets


def _splits(args: PretrainDatasetsArgs) -> list[str]:
    s = args.hf_dataset_splits
    return [s] if isinstance(s, str) else list(s)


def _load_one(args: PretrainDatasetsArgs, path: str, cache_dir: str | None):
    """The rows of one local dataset, its configured splits concatenated."""
    datasets = _datasets()
    p = Path(path)
    if not p.exists():
        raise UserError(
            f"hf_dataset_or_datasets {path!r} is not a local file or folder; mesh3d runs offline: "
            "download it first (e.g. `huggingface-cli download --repo-type dataset <id> "
            "--local-dir <dir>`, or `datasets.load_dataset(...).save_to_disk(<dir>)`) and give "
            "the local path"
        )
    splits = _splits(args)
    try:
        if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
            if args.hf_dataset_config_name is not None:
                raise UserError(
                    f"hf_dataset_config_name {args.hf_dataset_config_name!r} does not apply to "
                    f"{path!r}, a folder saved with save_to_disk; remove it"
                )
            ds = datasets.load_from_disk(path)
            if not isinstance(ds, datasets.DatasetDict):
                return ds
            missing = [s for s in splits if s not in ds]
            if missing:
                raise UserError(
                    f"{path!r} has splits {', '.join(ds)}; hf_dataset_splits asks for "
                    f"{', '.join(missing)}"
                )
            parts = [ds[s] for s in splits]
        else:
            if p.is_dir():
                builder, kwargs = path, {"name": args.hf_dataset_config_name}
            else:
                builder = _FILE_BUILDERS.get(p.suffix.lower())
                if builder is None:
                    raise UserError(
                        f"hf_dataset_or_datasets {path!r}: unsupported file type {p.suffix!r}; "
                        f"use one of {', '.join(_FILE_BUILDERS)} or a folder"
                    )
                if splits != ["train"]:
                    raise UserError(
                        f"{path!r} is a single data file, whose only split is 'train'; set "
                        f"hf_dataset_splits to train (it is {args.hf_dataset_splits!r})"
                    )
                if args.hf_dataset_config_name is not None:
                    raise UserError(
                        f"hf_dataset_config_name {args.hf_dataset_config_name!r} does not apply "
                        f"to {path!r}, a single data file; remove it"
                    )
                kwargs = {"data_files": path}
            mode = "force_redownload" if args.dataset_overwrite_cache else None
            parts = [
                datasets.load_dataset(
                    builder, split=s, cache_dir=cache_dir, download_mode=mode, **kwargs
                )
                for s in splits
            ]
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for unreadable or misnamed data
        raise UserError(f"cannot load {path!r} with datasets ({type(e).__name__}: {e})") from None
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def load_rows(args: PretrainDatasetsArgs, cache_dir: str | None = None):
    """The text rows `args` names, as one `datasets.Dataset` (see the module docstring)."""
    datasets = _datasets()
    spec = args.hf_dataset_or_datasets
    if isinstance(spec, str):
        return _load_one(args, spec, cache_dir)
    if isinstance(spec, dict):
        parts = []
        for path, fraction in spec.items():
            if not 0 <= fraction <= 1:
                raise UserError(
                    f"hf_dataset_or_datasets[{path!r}] is {fraction}; a fraction in [0, 1] of "
                    "the rows to use"
                )
            ds = _load_one(args, path, cache_dir)
            parts.append(ds.select(range(int(fraction * len(ds)))))
        return datasets.concatenate_datasets(parts).shuffle(seed=42)
    return datasets.concatenate_datasets([_load_one(args, p, cache_dir) for p in spec])


def tokenize_rows(rows, text_column: str, tokenizer_path: str, num_proc: int | None) -> np.ndarray:
    """All documents of `rows` tokenized and concatenated, EOS after each (see module docstring)."""
    if text_column not in rows.column_names:
        raise UserError(
            f"the dataset has no column {text_column!r} (it has: {', '.join(rows.column_names)}); "
            "set text_column_name to the column holding the text"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    eos = find_eos(tokenizer)
    tail = [] if eos is None else [eos]

    def encode(batch: dict) -> dict:
        texts = [t for t in batch[text_column] if t]
        encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
        return {"ids": [e.ids + tail for e in encoded]}

    tokenized = rows.map(
        encode,
        batched=True,
        batch_size=_MAP_BATCH,
        remove_columns=rows.column_names,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        keep_in_memory=True,
        desc="tokenizing",
    )
    dtype = np.uint32 if tokenizer.get_vocab_size() > 65536 else np.uint16
    chunks = [c.flatten().to_numpy() for c in tokenized.data.column("ids").chunks]
    return np.concatenate(chunks).astype(dtype) if chunks else np.zeros(0, dtype)


def load_pretrain_dataset(
    args: PretrainDatasetsArgs,
    tokenizer_path: str | None,
    seq_len: int,
    seed: int,
    num_samples: int,
    vocab_size: int,
    *,
    cache_dir: str | None = None,
) -> BlendedSamples:
    """A map-style dataset of `num_samples` samples: `ds[i]` -> (input_ids [S], label_ids [S]).

    `cache_dir` is `datasets`' cache for files it parses (None: its default, ~/.cache).
    """
    if not tokenizer_path:
        raise UserError(
            "hf_dataset_or_datasets needs a tokenizer: set tokenizer.tokenizer_name_or_path to a "
            "local folder with tokenizer.json"
        )
    check_tokenizer_vocab(tokenizer_path, vocab_size)
    rows = load_rows(args, cache_dir)
    tokens = tokenize_rows(
        rows, args.text_column_name, tokenizer_path, args.dataset_processing_num_proc_per_process
    )
    windows = TokenWindows(tokens, seq_len)
    if len(windows) == 0:
        raise UserError(
            f"hf_dataset_or_datasets {args.hf_dataset_or_datasets!r} has {len(tokens)} tokens, "
            f"fewer than the {seq_len + 1} (tokens.sequence_length + 1) of one sample; add data "
            "or lower tokens.sequence_length"
        )
    return BlendedSamples([windows], None, num_samples, seed)


def build_stage(s) -> BlendedSamples:
    """A map-style Hugging Face stage (`data/build.py`'s `StageData` `s`), at least one global
    batch of samples."""
    from mesh3d.data.nanoset import check_enough

    ds = load_pretrain_dataset(s.dataset, s.tokenizer(), s.seq, s.seed, s.num_samples,
                               s.vocab_size)  # fmt: skip
    check_enough(ds.epoch_len, s.gbs, f"{s.where} hf_dataset_or_datasets")
    return ds
