"""Streamed HF text (`mesh3d.hf_streaming: true`): local json/jsonl/parquet/arrow files read
row by row and tokenized on the fly in the loader's workers, never held whole in memory.

The stream of one shard (one dp rank's worker: shard = dp_rank * W + worker of dp * W, W =
max(num_loading_workers, 1)) is:

1. rows: each source (an entry of `hf_dataset_or_datasets`: a file, or a folder's files in
   name order) gives the shard rows r with r % shards == shard of each file, so the shards
   split the data without duplicates; empty texts are skipped;
2. tokens: `text_column_name` tokenized without the tokenizer's special tokens, EOS after every
   document (as `mesh3d.data.hf` and datatrove do; `mesh3d.data.documents` finds documents by
   it), concatenated per source and cut into samples of sequence_length + 1 tokens;
3. blend: sample j comes from source argmax_k(w_k * max(j, 1) - c_k) (Nanotron's rule;
   `{path: weight}` gives the weights, a list or one path weighs them equally);
4. shuffle: blocks of `_BLOCK` samples, each permuted by `default_rng([seed, shard, block])`;
5. steps: the shard's workers take the stage's steps in turn (worker w: steps first + w, first
   + w + W, ...), each GBS / dp samples cut into microbatches.

So the data of a step depends on the step, the data config, dp and W. The position is small: the
block being served and how much of it was taken, plus, at the block's start, each source's file,
next row and leftover tokens; a block is re-read and re-shuffled on resume. The loader saves it
per dp rank in each checkpoint (`data/stream_dp-<r>-of-<dp>.pt`); a resume at the same dp and W
continues exactly, at another dp or W it is refused (`Feed.resume`). Data is read once: a
stream that ends before the stage's last step is a `UserError` naming the source.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from mesh3d.data.text_files import check_file, read_rows, source_files
from mesh3d.data.worker_failure import Failed, by_value
from mesh3d.errors import UserError
from mesh3d.log import logger

_BLOCK = 256  # samples shuffled together: the bounded shuffle buffer
_ROWS = 32  # rows tokenized per call


class _Source:
    """One source's rows of one shard, tokenized and cut into windows of S + 1 tokens."""

    def __init__(self, files: list[Path], stream: StreamedText, shard: int, shards: int):
        self.files, self.stream, self.shard, self.shards = files, stream, shard, shards
        self.file, self.row, self.tokens = 0, 0, np.zeros(0, np.int64)
        self._rows: Iterator | None = None

    def position(self) -> list:
        return [self.file, self.row, torch.from_numpy(self.tokens.copy())]

    def restore(self, position: list) -> None:
        self.file, self.row = int(position[0]), int(position[1])
        self.tokens, self._rows = position[2].numpy().astype(np.int64), None

    def _next_texts(self) -> list[str]:
        """Up to `_ROWS` texts of this shard; [] at the end of the last file."""
        texts: list[str] = []
        while len(texts) < _ROWS and self.file < len(self.files):
            if self._rows is None:
                self._rows = read_rows(self.files[self.file], self.stream.column, self.row,
                                       lambda row: row % self.shards == self.shard)  # fmt: skip
            for row, text in self._rows:
                self.row = row + 1
                if row % self.shards == self.shard and text:
                    texts.append(text)
                    if len(texts) == _ROWS:
                        return texts
            self.file, self.row, self._rows = self.file + 1, 0, None
        return texts

    def window(self) -> np.ndarray | None:
        """The next S + 1 tokens; None when the source has no more."""
        w = self.stream.seq_len + 1
        while len(self.tokens) < w:
            texts = self._next_texts()
            if not texts:
                return None
            ids = self.stream.encode(texts)
            self.tokens = np.concatenate([self.tokens, ids])
        out, self.tokens = self.tokens[:w], self.tokens[w:]
        return out


class _Shard:
    """A shard's blended, block-shuffled samples, and its position."""

    def __init__(self, stream: StreamedText, shard: int, shards: int):
        self.stream, self.shard, self.shards = stream, shard, shards
        self.sources = [_Source(f, stream, shard, shards) for f in stream.files]
        self.counts = [0] * len(self.sources)
        self.block_index, self.taken, self.block = -1, 0, []
        self.at_block: dict | None = None

    def _blend_pick(self) -> int:
        j = max(sum(self.counts), 1)
        tops = [w * j - c for w, c in zip(self.stream.weights, self.counts)]
        return int(np.argmax(tops))  # ties to the lowest index, as Nanotron's

    def _fill(self) -> None:
        """Read the next block (its start position kept for the checkpoint)."""
        self.block_index += 1
        self.at_block = {"sources": [s.position() for s in self.sources],
                         "counts": list(self.counts)}  # fmt: skip
        samples = []
        for _ in range(_BLOCK):
            k = self._blend_pick()
            w = self.sources[k].window()
            if w is None:
                self.ended = k
                break
            self.counts[k] += 1
            samples.append(w)
        rng = np.random.default_rng([self.stream.seed, self.shard, self.block_index])
        self.block = [samples[i] for i in rng.permutation(len(samples))]
        self.taken = 0

    def sample(self) -> np.ndarray | None:
        if self.taken == len(self.block):
            if self.block_index >= 0 and len(self.block) < _BLOCK:
                return None  # the last block was short: a source ended
            self._fill()
            if not self.block:
                return None
        self.taken += 1
        return self.block[self.taken - 1]

    def state(self) -> dict:
        return {"shard": self.shard, "shards": self.shards, "block": self.block_index,
                "taken": self.taken, "at_block": self.at_block}  # fmt: skip

    def restore(self, state: dict) -> None:
        if (state["shard"], state["shards"]) != (self.shard, self.shards):
            raise UserError(
                f"the saved stream position is of shard {state['shard']} of {state['shards']}, "
                f"this worker reads shard {self.shard} of {self.shards}; resume with the dp and "
                "num_loading_workers the checkpoint was saved with"
            )
        if state["at_block"] is None:
            return
        for s, pos in zip(self.sources, state["at_block"]["sources"]):
            s.restore(pos)
        self.counts = list(state["at_block"]["counts"])
        self.block_index = int(state["block"]) - 1
        self._fill()
        self.taken = int(state["taken"])


class StreamedText:
    """A streamed `hf_dataset_or_datasets` stage, checked up front; `for_rank` binds it to a dp
    rank's loader (see the module doc)."""

    streamed = True  # what the loader asks of a stage's dataset (`loader._streamed`)

    def __init__(self, args, tokenizer_path: str, seq_len: int, seed: int, gbs: int, where: str):
        from mesh3d.data.tokenizer import find_eos, load_tokenizer

        spec = args.hf_dataset_or_datasets
        paths = [spec] if isinstance(spec, str) else list(spec)
        weights = list(spec.values()) if isinstance(spec, dict) else [1.0] * len(paths)
        if any(not w >= 0 for w in weights) or sum(weights) <= 0:
            raise UserError(f"{where} hf_dataset_or_datasets weights {weights}: give weights >= 0 "
                            "with a positive sum")  # fmt: skip
        splits = args.hf_dataset_splits
        splits = [splits] if isinstance(splits, str) else list(splits)
        self.paths, self.files = paths, [source_files(p, splits) for p in paths]
        self.weights = [w / sum(weights) for w in weights]
        self.column, self.seq_len, self.seed, self.gbs, self.where = (
            args.text_column_name, seq_len, seed, gbs, where)  # fmt: skip
        for files in self.files:
            for f in files:
                check_file(f, self.column)
        self.tokenizer_path = tokenizer_path
        tok = load_tokenizer(tokenizer_path)
        self.eos = find_eos(tok)
        self._tokenizer = None
        n = sum(map(len, self.files))
        logger.info(
            f"{where} is streamed (mesh3d.hf_streaming: true): {n} file{'s' * (n != 1)} of "
            f"{', '.join(map(str, paths))}, read row by row and tokenized in the loader"
        )

    def encode(self, texts: list[str]) -> np.ndarray:
        """Documents tokenized and concatenated, EOS after each."""
        if self._tokenizer is None:
            from mesh3d.data.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_path)
        tail = [] if self.eos is None else [self.eos]
        encoded = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return np.fromiter((t for e in encoded for t in e.ids + tail), dtype=np.int64)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": None}  # loaded again in each worker

    def for_rank(self, dp_rank: int, dp: int, micro_batch_size: int, workers: int) -> RankStream:
        return RankStream(self, dp_rank, dp, micro_batch_size, max(workers, 1))


class RankStream(IterableDataset):
    """One dp rank's stream for the loader: each item one step's microbatches (module doc)."""

    def __init__(self, stream: StreamedText, dp_rank: int, dp: int, mbs: int, workers: int):
        self.stream, self.dp_rank, self.dp, self.mbs, self.workers = (
            stream, dp_rank, dp, mbs, workers)  # fmt: skip
        self._shard: _Shard | None = None
        self._saved: dict | None = None

    def _open(self) -> _Shard:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        shard = _Shard(self.stream, self.dp_rank * self.workers + worker, self.dp * self.workers)
        if self._saved is not None:
            shard.restore(self._saved)
        return shard

    def __iter__(self):
        try:
            self._shard = shard = self._open()
        except Exception as e:  # noqa: BLE001 - carried to the training process
            yield Failed(e)
            return
        per_rank = self.stream.gbs // self.dp
        while True:
            try:
                rows = []
                for _ in range(per_rank):
                    w = shard.sample()
                    if w is None:
                        raise self._ended(shard)
                    rows.append(torch.from_numpy(w))
            except Exception as e:  # noqa: BLE001 - carried to the training process
                yield Failed(e)
                return
            t = torch.stack(rows)  # [GBS/dp, S+1]
            yield by_value([(m[:, :-1].contiguous(), m[:, 1:].contiguous())
                            for m in t.split(self.mbs)])  # fmt: skip

    def _ended(self, shard: _Shard) -> UserError:
        k = getattr(shard, "ended", 0)
        return UserError(
            f"{self.stream.where}: hf_dataset_or_datasets {self.stream.paths[k]!r} ran out "
            f"after {shard.counts[k]} samples of shard {shard.shard} of {shard.shards} (dp rank "
            f"{self.dp_rank}); streamed data is read once: add data, lower tokens.train_steps, "
            "or start the next data stage earlier"
        )

    def state_dict(self) -> dict:
        return self._shard.state() if self._shard is not None else (self._saved or {})

    def load_state_dict(self, state: dict) -> None:
        self._saved = state or None
