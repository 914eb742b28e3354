"""Held-out validation data: `tokens.limit_val_batches` global batches of the first stage's
dataset that the run never trains on, fixed by the config and the data alone (how each kind of
data is held out: `docs/data.md`)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import numpy as np
import torch

from mesh3d.config import global_batch_size
from mesh3d.data.dummy import DummyTokens, microbatches
from mesh3d.data.nanoset import BlendedSamples
from mesh3d.errors import UserError

DUMMY_OFFSET = 2**31  # first dummy index of the validation set: half the key space away
_KEYS = 2**32  # sample keys of dummy data (torch's CPU generator keeps 32 bits of a seed)
_CHUNK = 1 << 16  # epoch positions examined at a time when walking back from the end


class HeldOut:
    """Map-style validation set: `held[i]` -> (input_ids, label_ids[, positions]) of sample i;
    `ids` are dummy indices or `BlendedSamples` (source, window) pairs."""

    def __init__(self, ids: list, fetch: Callable[..., tuple], global_batch: int, num_batches: int):
        self.ids, self._fetch = ids, fetch
        self.global_batch, self.num_batches = global_batch, num_batches

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        key = self.ids[i]
        return self._fetch(*key) if isinstance(key, tuple) else self._fetch(key)

    def batches(self, batch: int, dp_rank: int, dp: int, micro_batch_size: int) -> list:
        """This dp rank's microbatches of validation batch `batch` (0-based)."""
        return microbatches(self, batch + 1, self.global_batch, dp_rank, dp, micro_batch_size)


def held_out(cfg, datasets: list, reads: list[int]) -> HeldOut | None:
    """The run's validation set from its stages' `datasets`, of which stage i trains on the
    first `reads[i]` samples (None when validation is off)."""
    tok = cfg.tokens
    if tok.val_check_interval <= 0 or tok.limit_val_batches <= 0:
        return None
    gbs = global_batch_size(cfg)
    count = tok.limit_val_batches * gbs
    first = datasets[0]
    names = [s.name for s in cfg.data_stages or []] or ["dummy"]
    if isinstance(first, DummyTokens):
        _check_dummy_keys(first, count, datasets, reads, names)
        ids = list(range(DUMMY_OFFSET, DUMMY_OFFSET + count))
        return HeldOut(ids, first.__getitem__, gbs, tok.limit_val_batches)
    if hasattr(first, "held_sample"):  # SFT data (`sft.SFTSequences`) held them out when built
        if len(first.held) != count:
            raise TypeError(f"the SFT dataset holds out {len(first.held)} sequences, not {count}")
        return HeldOut(list(range(count)), first.held_sample, gbs, tok.limit_val_batches)
    if not isinstance(first, BlendedSamples):  # a streamed stage (mesh3d.hf_streaming)
        raise UserError(
            f"tokens.limit_val_batches={tok.limit_val_batches} takes held-out samples from the "
            "first data stage, which is streamed (mesh3d.hf_streaming): a stream has no "
            "held-out windows; set tokens.limit_val_batches: 0, or make the first stage a "
            "Nanoset or map-style (mesh3d.hf_streaming: false)"
        )
    ids = _unread_windows(datasets, reads, count)
    if len(ids) < count:
        where = f"data_stages[0] ({names[0]!r})" if cfg.data_stages else "the dataset"
        raise UserError(
            f"tokens.limit_val_batches={tok.limit_val_batches} asks for {count} held-out samples "
            f"({tok.limit_val_batches} global batches of {gbs}) of {where}, but the run trains "
            f"on all but {len(ids)} of its {first.epoch_len} samples (tokens.train_steps="
            f"{tok.train_steps}); lower tokens.limit_val_batches or tokens.train_steps, or add "
            "data to that stage"
        )
    return HeldOut(ids, first.window_sample, gbs, tok.limit_val_batches)


def source_key(source) -> tuple:
    """What identifies a source's windows across stages: its folder, or its tokens' digest."""
    folder = getattr(source, "folder", None)
    if folder is not None:
        return ("folder", os.path.realpath(folder))
    return ("tokens", hashlib.sha1(np.ascontiguousarray(source.tokens).view(np.uint8)).hexdigest())


def _check_dummy_keys(first: DummyTokens, count: int, datasets, reads, names) -> None:
    """Raise `UserError` if a dummy stage's training keys meet the validation keys (arcs of the
    2**32 key circle)."""
    start = first.sample_key(DUMMY_OFFSET)
    for ds, n, name in zip(datasets, reads, names):
        if not isinstance(ds, DummyTokens):
            continue
        train = ds.sample_key(0)
        if n >= _KEYS or (start - train) % _KEYS < n or (train - start) % _KEYS < count:
            raise UserError(
                f"the {count} validation samples (tokens.limit_val_batches) of dummy data would "
                f"repeat training samples of data stage {name!r}: torch's CPU generator keeps 32 "
                f"bits of a sample's seed and that stage reads {n}; change that stage's data.seed "
                "or lower tokens.train_steps"
            )


def _read_windows(datasets: list, reads: list[int], first_order: tuple) -> dict:
    """source key -> bool mask of the windows some stage trains on (epoch 0's positions
    [0, min(reads, E)); later epochs hold the same windows)."""
    masks: dict[tuple, np.ndarray] = {}
    for i, (ds, n) in enumerate(zip(datasets, reads)):
        if not isinstance(ds, BlendedSamples):
            continue
        n = min(n, ds.epoch_len)
        # stage 0: its whole epoch, already built; others: the positions they serve (cached)
        which, sample = first_order if i == 0 else ds.epoch_sources(0)
        which, sample = which[:n], sample[:n]
        for k, src in enumerate(ds.sources):
            mask = masks.setdefault(source_key(src), np.zeros(len(src), dtype=bool))
            mask[sample[which == k]] = True
    return masks


def _unread_windows(datasets: list, reads: list[int], count: int) -> list[tuple[int, int]]:
    """Up to `count` distinct (source, window) pairs of `datasets[0]` read by no stage, from the
    end of its epoch-0 order back."""
    ds = datasets[0]
    which, sample = ds.epoch_sources(0, whole=True)
    masks = _read_windows(datasets, reads, (which, sample))
    keys = [source_key(s) for s in ds.sources]
    unique = list(dict.fromkeys(keys))  # a folder listed twice is one set of windows
    starts = np.cumsum([0] + [len(masks[k]) for k in unique])
    base = np.array([starts[unique.index(k)] for k in keys], dtype=np.int64)
    seen = np.concatenate([masks[k] for k in unique])
    picked: list[tuple[int, int]] = []
    end = len(which)
    while len(picked) < count and end > 0:
        pos = np.arange(end - 1, max(end - _CHUNK, 0) - 1, -1)  # from the end backwards
        codes = base[which[pos]] + sample[pos]
        keep = ~seen[codes]
        pos, codes = pos[keep], codes[keep]
        _, first = np.unique(codes, return_index=True)
        take = np.sort(first)[: count - len(picked)]
        pos, codes = pos[take], codes[take]
        seen[codes] = True
        picked.extend(zip(which[pos].tolist(), sample[pos].tolist()))
        end -= _CHUNK
    return picked
