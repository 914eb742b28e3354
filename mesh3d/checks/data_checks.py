"""Checks of `data_stages`; part of `validate` (no torch import)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from mesh3d.config.schema import Config, NanosetDatasetsArgs, PretrainDatasetsArgs, SFTDatasetsArgs
from mesh3d.errors import not_divisible, not_supported_yet

MAX_LOADING_WORKERS = 256  # data-loading worker processes per rank


def data_stage_errors(cfg: Config) -> Iterator[str]:
    """`data_stages`: one starting at step 1, unique names and start steps, sane values."""
    stages = cfg.data_stages or []
    names, starts = [s.name for s in stages], [s.start_training_step for s in stages]
    if stages and 1 not in starts:
        yield f"`data_stages` must have a stage with start_training_step: 1; the stages start at {starts}"
    for name in sorted({n for n in names if names.count(n) > 1}):
        yield f"`data_stages` has two stages named {name!r}; stage names must be unique"
    for start in sorted({s for s in starts if starts.count(s) > 1}):
        yield f"`data_stages` has two stages with start_training_step {start}; each stage needs its own start step"
    for s in stages:
        where = stage_key(s)
        if s.start_training_step < 1:
            yield (
                f"`{where}.start_training_step` must be >= 1 (steps count from 1: a stage "
                f"starting before 1 never trains), got {s.start_training_step}"
            )
        yield from _weight_errors(where, s.data.dataset)
        workers = s.data.num_loading_workers
        if workers < 0:
            yield f"`{where}.data.num_loading_workers` must be >= 0, got {workers}"
        elif workers > MAX_LOADING_WORKERS:
            yield (
                f"`{where}.data.num_loading_workers` ({workers}) must be at most "
                f"{MAX_LOADING_WORKERS} (worker processes per rank); lower it"
            )


def weight_problem(weights: list[float] | None, num_folders: int) -> str | None:
    """What is wrong with Nanoset `dataset_weights` for `num_folders` folders, or None."""
    if weights is None:
        return None
    if len(weights) != num_folders:
        return (
            f"dataset_weights has {len(weights)} values {list(weights)} but dataset_folder has "
            f"{num_folders} folders; give one weight per folder (or drop dataset_weights to weigh "
            "folders by size)"
        )
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        return f"dataset_weights {list(weights)} must be finite and >= 0"
    total = float(sum(weights))
    if total <= 0:
        return f"dataset_weights {list(weights)} sum to {total}; give a positive sum"
    return None


def _weight_errors(where: str, dataset) -> Iterator[str]:
    if isinstance(dataset, NanosetDatasetsArgs):
        n = len(dataset.dataset_folder)
        if problem := weight_problem(dataset.dataset_weights, n):
            yield f"`{where}.data.dataset`: {problem}"
        for key in ("dataset_read_path", "dataset_max_tokens"):
            value = getattr(dataset, key)
            if value is not None and len(value) != n:
                yield (
                    f"`{where}.data.dataset.{key}` has {len(value)} entries {value} but "
                    f"dataset_folder has {n} folders; give one per folder (or drop {key})"
                )
        for k, cap in enumerate(dataset.dataset_max_tokens or []):
            if cap < 1:
                yield (
                    f"`{where}.data.dataset.dataset_max_tokens[{k}]` is {cap!r}; give a token "
                    "count >= 1 (or drop dataset_max_tokens to read the whole folder)"
                )
    elif isinstance(dataset, PretrainDatasetsArgs) and isinstance(
        dataset.hf_dataset_or_datasets, dict
    ):
        for path, fraction in dataset.hf_dataset_or_datasets.items():
            if not 0 <= fraction <= 1:
                yield (
                    f"`{where}.data.dataset.hf_dataset_or_datasets[{path!r}]` is {fraction}; a "
                    "fraction in [0, 1] of the rows to use"
                )


def stage_key(stage) -> str:
    """A stage by `name`: load sorts data_stages by start step, so YAML indices may differ."""
    return f"data_stages[name={stage.name!r}]"


def sequence_split_errors(key: str, seq: int, p, why: str = "") -> Iterator[str]:
    """`seq` (at `key`) split over cp (2·cp chunks) and, under REDUCE_SCATTER, over tp."""
    cp = max(p.context_parallel_size, 1)
    if cp > 1:
        yield from not_divisible(key, seq, "2 x parallelism.context_parallel_size", 2 * cp,
                                 "each cp rank holds one head and one tail chunk of every "
                                 f"sample{why}; change one of them")  # fmt: skip
    if p.tp_mode == "REDUCE_SCATTER" and p.tp > 1 and seq % (2 * cp if cp > 1 else 1) == 0:
        yield from not_divisible(f"{key} / context_parallel_size" if cp > 1 else key,
                                 seq // cp, "parallelism.tp", p.tp,
                                 "tp_mode REDUCE_SCATTER splits the sequence over tp ranks; "
                                 "change one or use ALL_REDUCE")  # fmt: skip


def stage_length_errors(cfg: Config) -> Iterator[str]:
    """A stage's own `sequence_length`: >= 1, split like tokens.sequence_length, no validation."""
    t = cfg.tokens
    for s in cfg.data_stages or []:
        seq = s.sequence_length
        if seq is None or seq == t.sequence_length:
            continue
        key = f"{stage_key(s)}.sequence_length"
        if seq < 1:
            yield f"`{key}` must be >= 1 (null: tokens.sequence_length), got {seq}"
            continue
        yield from sequence_split_errors(key, seq, cfg.parallelism)
        if t.val_check_interval > 0 and t.limit_val_batches > 0:
            yield not_supported_yet(
                key,
                f"{seq}, other than tokens.sequence_length {t.sequence_length}, with validation: "
                "the held-out set is cut at one length; set tokens.val_check_interval to -1, or "
                "this sequence_length to null",
            )


def unsupported_data(stage) -> Iterator[str]:
    """A data stage's settings mesh3d does not implement yet (HEAD-only Nanoset keys).

    `shuffle_files` is not refused: files are always shuffled with seed 42, as CLASSIC does.
    `skip_in_stream` and `pad_samples_to_global_batch_size` change nothing, as in Nanotron."""
    where = stage_key(stage)
    kind = stage.data.dataset
    if kind is None or isinstance(kind, (PretrainDatasetsArgs, SFTDatasetsArgs)):
        return
    if not isinstance(kind, NanosetDatasetsArgs):
        yield f"`{where}.data.dataset` ({type(kind).__name__}) is not supported by mesh3d yet; use a Nanoset (dataset_folder), an HF dataset (hf_dataset_or_datasets) or `dataset: null`"
    elif kind.use_old_brrr_dataloader != False:  # noqa: E712 (any value but false)
        yield not_supported_yet(f"{where}.data.dataset.use_old_brrr_dataloader", "set it to false")
