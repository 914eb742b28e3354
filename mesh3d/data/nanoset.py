"""Nanoset: pretraining samples from datatrove-tokenized folders (spec §5.1, §5.2).

On disk (datatrove's `DocumentTokenizer` output, or `python -m mesh3d.data.tokenize`): a folder
of `*.ds` files, each the raw little-endian token ids of many documents (uint16, or uint32 when
the vocabulary has more than 65,536 entries; no header), with `.ds.index` (document ends) and
`.ds.metadata` (`<tokenizer>|<bytes per token>` on line 1) beside it. Reading follows datatrove:
the folder's `*.ds` files (not recursive) are sorted, then shuffled at file level with
`numpy.random.default_rng(42).permutation`; file f holds floor(n_tokens_f / (S+1)) samples, sample
i being the non-overlapping window of tokens [i*(S+1), (i+1)*(S+1)) (the tail is dropped); the
folder is its files' samples one after the other. Files are memory-mapped, never read whole.

Blending follows Nanotron's index: one epoch has E = sum of the folders' sample counts, and
position j of the epoch takes a sample from folder argmax_k(w_k * max(j, 1) - c_k) (c_k: samples
taken from k so far, ties to the lowest k), namely that folder's sample c_k mod n_k. The one
difference, on purpose: Nanotron shuffles that epoch once (`RandomState(seed)`) and repeats the
same order for every epoch; mesh3d shuffles epoch 0 exactly like Nanotron (so a run shorter than
an epoch reads Nanotron's samples in Nanotron's order) and every later epoch e with its own
permutation from `default_rng([seed, e])`, so repeated data does not come back in the same order.

`ds[i]` returns (input_ids [S], label_ids [S]) int64 for global sample i, like `DummyTokens`, so
`mesh3d.data.dummy.microbatches` serves both.
"""

from __future__ import annotations

import bisect
import operator
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from mesh3d.config.data_checks import weight_problem
from mesh3d.errors import UserError
from mesh3d.log import Progress

DATATROVE_FILE_SEED = 42  # datatrove's default seed for the file-level shuffle
TOKEN_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_SCAN_TOKENS = 1 << 22  # tokens per block when scanning a file for out-of-vocabulary ids
_EPOCHS_CACHED = 2  # a global batch can straddle two epochs


def token_size_for_vocab(vocab_size: int) -> int:
    """Bytes per token datatrove uses for a vocabulary: 4 above 65,536 entries, else 2."""
    return 4 if vocab_size > 65536 else 2


def metadata_token_size(ds_path: str | os.PathLike) -> int | None:
    """Token size from `<file>.ds.metadata` line 1 (`<tokenizer>|<bytes>`), or None if absent.

    Older datatrove versions write only the tokenizer name on line 1; that also gives None.
    """
    meta = Path(f"{ds_path}.metadata")
    if not meta.is_file():
        return None
    first = meta.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0].strip()
    if "|" not in first:
        return None
    size = first.rsplit("|", 1)[1].strip()
    if size not in ("2", "4"):
        raise UserError(
            f"{meta}: line 1 is {first!r}; expected '<tokenizer>|2' or '<tokenizer>|4' (bytes per "
            "token). Fix or delete the metadata file and set token_size_in_bytes instead"
        )
    return int(size)


class WindowSource(Protocol):
    """What `BlendedSamples` blends: a list of token windows of S+1 tokens each."""

    def __len__(self) -> int: ...

    def window(self, index: int) -> np.ndarray: ...


class DatatroveFile:
    """One `.ds` file: `len(f)` samples, `f.window(i)` -> the (S+1,) token window i (a memmap view)."""

    def __init__(self, path: str | os.PathLike, seq_len: int, token_size: int):
        self.path, self.seq_len, self.token_size = str(path), seq_len, token_size
        self.dtype = TOKEN_DTYPES[token_size]
        size = os.path.getsize(self.path)
        if size == 0:
            raise UserError(
                f"{self.path} is empty (0 bytes); delete it (and its .index/.metadata) or "
                "tokenize its data again"
            )
        if size % token_size:
            raise UserError(
                f"{self.path} has {size} bytes, not a multiple of the token size "
                f"({token_size} bytes, {self.dtype.name}): the file is truncated, or the token size "
                "is wrong. Tokenize its data again, or fix token_size_in_bytes / the .ds.metadata"
            )
        self.num_tokens = size // token_size
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        """All token ids of the file, memory-mapped read-only (opened on first use)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __len__(self) -> int:
        return self.num_tokens // (self.seq_len + 1)

    def window(self, index: int) -> np.ndarray:
        """Tokens [index*(S+1), (index+1)*(S+1)) of the file."""
        w = self.seq_len + 1
        return self.tokens[index * w : (index + 1) * w]

    def check_vocab(self, vocab_size: int) -> None:
        """Raise `UserError` at the first token id >= `vocab_size` (scans the file in blocks)."""
        if self.dtype.itemsize == 2 and vocab_size > 65535:
            return  # every uint16 id fits
        # read in blocks rather than through the memmap: the scan leaves no mapped pages behind
        with open(self.path, "rb") as f:
            for start in range(0, self.num_tokens, _SCAN_TOKENS):  # noqa: B007 (used below)
                block = np.fromfile(f, dtype=self.dtype, count=_SCAN_TOKENS)
                if int(block.max()) < vocab_size:
                    continue
                break
            else:
                return
        offset = int(np.argmax(block >= vocab_size))
        value = int(block[offset])
        raise UserError(
            f"{self.path}: token {start + offset} is id {value}, but the model's vocabulary "
            f"has {vocab_size} ids (model.model_config.vocab_size). The folder was tokenized "
            "with a different (larger) tokenizer: tokenize it again with the model's "
            f"tokenizer, or set model.model_config.vocab_size to at least {value + 1}"
        )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = None  # reopen the memmap after pickling, do not copy the tokens
        return state


class DatatroveFolder:
    """A folder of `.ds` files read as datatrove does: sorted, shuffled with seed 42, concatenated.

    The token size of each file comes from its `.ds.metadata` line 1 when that says it, else
    from `token_size_in_bytes`, else from `vocab_size` (4 bytes above 65,536 ids, else 2). With
    `check_token_ids`, every file is scanned once for ids >= `vocab_size`.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        seq_len: int,
        *,
        vocab_size: int | None = None,
        token_size_in_bytes: int | None = None,
        check_token_ids: bool = True,
        file_seed: int = DATATROVE_FILE_SEED,
    ):
        self.folder, self.seq_len = str(folder), seq_len
        if not os.path.exists(self.folder):
            raise UserError(f"dataset_folder {self.folder!r} does not exist; fix the path")
        if not os.path.isdir(self.folder):
            raise UserError(
                f"dataset_folder {self.folder!r} is a file; give the folder that holds the .ds files"
            )
        if token_size_in_bytes is not None and token_size_in_bytes not in TOKEN_DTYPES:
            raise UserError(f"token_size_in_bytes is {token_size_in_bytes}; use 2 or 4")
        names = sorted(p.name for p in Path(self.folder).glob("*.ds") if p.is_file())
        if not names:
            raise UserError(
                f"dataset_folder {self.folder!r} has no *.ds files (datatrove's tokenized output). "
                "Tokenize text into it with `python -m mesh3d.data.tokenize --tokenizer <dir> "
                f"--input <files> --output {self.folder}`"
            )
        order = np.random.default_rng(file_seed).permutation(len(names))
        self.files = [
            self._open(os.path.join(self.folder, names[i]), vocab_size, token_size_in_bytes)
            for i in order
        ]
        lengths = [len(f) for f in self.files]
        self.starts = [0, *np.cumsum(lengths).tolist()]  # starts[f] = first sample of file f
        if len(self) == 0:
            tokens = sum(f.num_tokens for f in self.files)
            raise UserError(
                f"dataset_folder {self.folder!r} has {tokens} tokens in {len(names)} files, and "
                f"no file has the {seq_len + 1} tokens (tokens.sequence_length + 1) of one sample; "
                "add data or lower tokens.sequence_length"
            )
        if check_token_ids and vocab_size is not None:
            progress = Progress(f"Checking token ids in {self.folder}", len(self.files))
            for f in self.files:
                f.check_vocab(vocab_size)
                progress.update()
            progress.done(f" ({sum(f.num_tokens for f in self.files):,} tokens)")

    def _open(self, path: str, vocab_size: int | None, explicit: int | None) -> DatatroveFile:
        size = metadata_token_size(path)
        if size is not None and explicit is not None and size != explicit:
            raise UserError(
                f"{path}.metadata says {size} bytes per token but token_size_in_bytes is "
                f"{explicit}; remove token_size_in_bytes or set it to {size}"
            )
        if size is None:
            size = explicit
        if size is None:
            if vocab_size is None:
                raise UserError(
                    f"cannot tell the token size of {path}: it has no .ds.metadata; set "
                    "token_size_in_bytes (2 or 4)"
                )
            size = token_size_for_vocab(vocab_size)
        return DatatroveFile(path, self.seq_len, size)

    def __len__(self) -> int:
        return self.starts[-1]

    def window(self, index: int) -> np.ndarray:
        """Sample `index` of the folder: the (S+1,) token window, from the file that holds it."""
        f = bisect.bisect_right(self.starts, index) - 1
        return self.files[f].window(index - self.starts[f])


def check_weights(weights: Sequence[float] | None, num_folders: int) -> None:
    """Raise `UserError` unless `weights` is None or one finite, >= 0 weight per folder, sum > 0."""
    problem = weight_problem(None if weights is None else list(weights), num_folders)
    if problem:
        raise UserError(problem)


def normalize_weights(weights: Sequence[float] | None, sizes: Sequence[int]) -> list[float]:
    """Blend weights summing to 1: the given ones normalized, or proportional to `sizes`."""
    check_weights(weights, len(sizes))
    if weights is None:
        total = sum(sizes)
        return [n / total for n in sizes]
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def greedy_blend(weights: Sequence[float], length: int) -> np.ndarray:
    """Nanotron's blend order: entry j is argmax_k(w_k * max(j, 1) - c_k), ties to the lowest k.

    The float arithmetic is Nanotron's (float64 `w * j - c`), so the result is identical. Each
    pick depends on all earlier ones, so this is a plain Python loop (Nanotron uses numba): about
    0.4 s per million entries for two folders, 0.7 s for four, on one CPU core; it runs once
    per dataset (not per epoch). A single folder needs no loop. Returns uint16 folder indices.
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

    `self[i]` -> (input_ids [S], label_ids [S]) int64: window[:-1], window[1:]. The index is
    built one epoch (E = total samples of the sources) at a time, cut to the positions the run
    uses, and at most two epochs are kept: a few bytes per sample, O(min(E, num_samples)) plus
    the unshuffled epoch when the run needs more than one (then E < num_samples). Building an
    epoch briefly needs O(E) memory (epoch 0 is Nanotron's full `RandomState` permutation).
    """

    def __init__(
        self,
        sources: Sequence[WindowSource],
        weights: Sequence[float] | None,
        num_samples: int,
        seed: int,
    ):
        if not 0 <= seed < 2**32:
            raise UserError(f"data.seed is {seed}; use an integer in [0, 2**32)")
        if num_samples < 0:
            raise UserError(f"the run needs {num_samples} samples; expected a count >= 0")
        self.sources = list(sources)
        self.sizes = [len(s) for s in self.sources]
        self.weights = normalize_weights(weights, self.sizes)
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

    def _permutation(self, epoch: int) -> np.ndarray:
        """Epoch 0: Nanotron's `RandomState(seed)` shuffle; epoch e > 0: `default_rng([seed, e])`."""
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
        """(source index, sample index within it) at each position of `epoch`: the positions
        the dataset serves (cut to `num_samples`), or with `whole` every position of the epoch
        (built afresh, not cached: held-out validation data reads the epoch's tail)."""
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

    `weights` None weighs folders by their sample counts. Construction validates every folder
    and file (see `DatatroveFolder`) and raises `UserError` naming what to fix.



    Example:



        ds = mesh3d.Nanoset(["data/a", "data/b"], [0.7, 0.3], seq_len=2048, num_samples=steps * gbs,


                           seed=42, vocab_size=50257)


        input_ids, labels = ds[0]


    """

    def __init__(
        self,
        folders: Sequence[str | os.PathLike],
        weights: Sequence[float] | None,
        seq_len: int,
        num_samples: int,
        seed: int,
        vocab_size: int,
        *,
        token_size_in_bytes: int | None = None,
        check_token_ids: bool = True,
    ):
        check_weights(weights, len(folders))  # before the (slower) folder checks
        self.folders = [
            DatatroveFolder(
                f,
                seq_len,
                vocab_size=vocab_size,
                token_size_in_bytes=token_size_in_bytes,
                check_token_ids=check_token_ids,
            )
            for f in folders
        ]
        self.seq_len = seq_len
        super().__init__(self.folders, weights, num_samples, seed)


def check_enough(dataset_len: int, global_batch_size: int, where: str) -> None:
    """Raise `UserError` if a dataset of `dataset_len` samples cannot fill one global batch."""
    if dataset_len < global_batch_size:
        raise UserError(
            f"{where} has {dataset_len} samples of tokens.sequence_length + 1 tokens, fewer than "
            f"one global batch ({global_batch_size} samples = dp * micro_batch_size * "
            "batch_accumulation_per_replica); add data, or lower the batch size or "
            "tokens.sequence_length"
        )
