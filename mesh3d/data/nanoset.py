"""Nanoset: pretraining samples from datatrove-tokenized folders (`data/datatrove.py`), blended
as Nanotron's index (docs/nanotron-layout.md#nanoset-index). On purpose, unlike Nanotron (which
repeats epoch 0's `RandomState(seed)` shuffle), each later epoch e is shuffled with
`default_rng([seed, e])`. `ds[i]` is (input_ids [S], label_ids [S]) int64, like `DummyTokens`.
"""

from __future__ import annotations

import operator
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from mesh3d.checks.data_checks import weight_problem
from mesh3d.data.datatrove import DatatroveFolder, WindowSource
from mesh3d.errors import UserError

_EPOCHS_CACHED = 2  # a global batch can straddle two epochs


def check_weights(weights: Sequence[float] | None, num_folders: int) -> None:
    """Raise `UserError` unless `weights` is None or one finite, >= 0 weight per folder, sum > 0."""
    problem = weight_problem(None if weights is None else list(weights), num_folders)
    if problem:
        raise UserError(problem)


def greedy_blend(weights: Sequence[float], length: int) -> np.ndarray:
    """Nanotron's blend order (uint16): entry j is argmax_k(w_k * max(j, 1) - c_k), c_k the
    picks of k so far, ties to the lowest k. Nanotron's float64 arithmetic, in a plain loop
    (each pick depends on the earlier ones): about 0.4 s per million entries for two folders.
    """
    if len(weights) == 1:
        return np.zeros(length, dtype=np.uint16)
    w = [float(x) for x in weights]
    rest = range(1, len(w))
    counts = [0] * len(w)
    out = array("H", bytes(2 * length))
    for j in range(length):
        x = j if j > 1 else 1
        best, top = 0, w[0] * x - counts[0]
        for k in rest:
            e = w[k] * x - counts[k]
            if e > top:
                best, top = k, e
        out[j] = best
        counts[best] += 1
    return np.frombuffer(out, dtype=np.uint16)


class BlendedSamples:
    """`num_samples` samples drawn from several `WindowSource`s, blended and shuffled per epoch.

    `self[i]` -> (window[:-1], window[1:]) int64. The index is built one epoch at a time, cut to
    the positions the run uses; at most two epochs are kept.
    """

    def __init__(self, sources: Sequence[WindowSource], weights: Sequence[float] | None,
                 num_samples: int, seed: int):  # fmt: skip
        if not 0 <= seed < 2**32:
            raise UserError(f"data.seed is {seed}; use an integer in [0, 2**32)")
        if num_samples < 0:
            raise UserError(f"the run needs {num_samples} samples; expected a count >= 0")
        self.sources = list(sources)
        self.sizes = [len(s) for s in self.sources]
        check_weights(weights, len(self.sizes))  # weights None: proportional to the sizes
        if weights is None and self.sizes and not sum(self.sizes):
            raise UserError(
                f"all {len(self.sizes)} data sources to blend are empty (0 samples); point the "
                "data stage at token files that hold samples"
            )
        w = np.asarray(self.sizes if weights is None else weights, dtype=np.float64)
        self.weights = (w / w.sum()).tolist()  # summing to 1
        self.num_samples, self.seed = num_samples, seed
        self.epoch_len = sum(self.sizes)
        self._base: tuple[np.ndarray, np.ndarray] | None = None
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return self.num_samples

    def _base_order(self) -> tuple[np.ndarray, np.ndarray]:
        """The unshuffled epoch: (source index, sample index within the source) per position."""
        if self._base is None:
            which = greedy_blend(self.weights, self.epoch_len)
            sample = np.empty(self.epoch_len, dtype=np.min_scalar_type(max(self.sizes)))
            for k, n in enumerate(self.sizes):
                at = np.flatnonzero(which == k)
                sample[at] = np.arange(len(at)) % n
            self._base = (which, sample)
        return self._base

    def _permutation(self, epoch: int) -> np.ndarray:  # see the module doc
        if epoch == 0:
            return np.random.RandomState(self.seed).permutation(self.epoch_len)
        return np.random.default_rng([self.seed, epoch]).permutation(self.epoch_len)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample) per position of `epoch`, cut to the positions the run uses."""
        if epoch not in self._epochs:
            which, sample = self._base_order()
            used = min(self.epoch_len, self.num_samples - epoch * self.epoch_len)
            perm = self._permutation(epoch)[:used]
            self._epochs[epoch] = (which[perm], sample[perm])
            if self.num_samples <= self.epoch_len:
                self._base = None  # a single (partial) epoch: the unshuffled order is not needed
            while len(self._epochs) > _EPOCHS_CACHED:
                self._epochs.popitem(last=False)
        self._epochs.move_to_end(epoch)
        return self._epochs[epoch]

    def sample_source(self, index: int) -> tuple[int, int]:
        """(source index, sample index within that source) of global sample `index`."""
        index = operator.index(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        epoch, pos = divmod(index, self.epoch_len)
        which, sample = self._epoch(epoch)
        return int(which[pos]), int(sample[pos])

    def epoch_sources(self, epoch: int, whole: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample within it) at each position of `epoch` the dataset serves, or with
        `whole` at every position (not cached: validation reads the epoch's tail)."""
        if not whole:
            return self._epoch(epoch)
        which, sample = self._base_order()
        perm = self._permutation(epoch)
        return which[perm], sample[perm]

    def window_sample(self, source: int, sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [S], label_ids [S]) int64 of window `sample` of source `source`."""
        window = torch.from_numpy(self.sources[source].window(sample).astype(np.int64))
        return window[:-1], window[1:]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.window_sample(*self.sample_source(index))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_base"], state["_epochs"] = None, OrderedDict()  # rebuilt on first use
        return state


class Nanoset(BlendedSamples):
    """Nanotron's Nanoset over datatrove folders: `num_samples` (= train_steps * GBS) samples.

    `weights` None weighs folders by their sample counts. `read_paths` and `max_tokens` hold one
    entry per folder (see `DatatroveFolder`). Construction validates every folder and file.

    Example:

        ds = mesh3d.Nanoset(["data/a", "data/b"], [0.7, 0.3], seq_len=2048, num_samples=steps * gbs,
                           seed=42, vocab_size=50257)
        input_ids, labels = ds[0]
    """

    def __init__(self, folders: Sequence[str | os.PathLike], weights: Sequence[float] | None,
                 seq_len: int, num_samples: int, seed: int, vocab_size: int, *,
                 token_size_in_bytes: int | None = None, check_token_ids: bool = True,
                 read_paths: Sequence[str | os.PathLike] | None = None,
                 max_tokens: Sequence[int] | None = None):  # fmt: skip
        folders = [folders] if isinstance(folders, str | os.PathLike) else folders  # one folder
        check_weights(weights, len(folders))  # before the (slower) folder checks
        self.folders = [
            DatatroveFolder(f, seq_len, vocab_size=vocab_size, token_size_in_bytes=token_size_in_bytes,
                            check_token_ids=check_token_ids, read_path=read_paths[k] if read_paths else None,
                            max_tokens=max_tokens[k] if max_tokens else None)
            for k, f in enumerate(folders)
        ]  # fmt: skip
        self.seq_len = seq_len
        super().__init__(self.folders, weights, num_samples, seed)


def check_enough(dataset_len: int, global_batch_size: int, where: str) -> None:
    """Raise `UserError` if a dataset of `dataset_len` samples cannot fill one global batch."""
    if dataset_len < global_batch_size:
        raise UserError(
            f"{where} has {dataset_len} samples of sequence_length + 1 tokens, fewer than "
            f"one global batch ({global_batch_size} samples = dp * micro_batch_size * "
            "batch_accumulation_per_replica); add data, or lower the batch size or the "
            "sequence_length (the stage's own, else tokens.sequence_length)"
        )
