"""Streamed HF text (`mesh3d.hf_streaming: true`): local json/jsonl/parquet/arrow files read
row by row and tokenized on the fly in the loader's workers, never held whole in memory.

The samples of a step depend only on the data config and the seed, never on dp or the number of
loading workers, so any layout reads what one process reads and a resume at another dp or
worker count continues the same stream:

1. logical shards: a stage's rows are split into N = `mesh3d.stream_shards` logical shards
   (default: the stage's global batch size; N divides it): shard k holds the rows r with
   r % N == k of every file of every source (a file's rows counted from 0; a source is an entry
   of `hf_dataset_or_datasets`, a file or a folder's files in name order); empty texts are
   skipped;
2. tokens: per shard and source, `text_column_name` tokenized without the tokenizer's special
   tokens, EOS after every document (as `mesh3d.data.hf` and datatrove do), concatenated and cut
   into samples of sequence_length + 1 tokens;
3. blend: per shard, sample j comes from source argmax_k(w_k * max(j, 1) - c_k) (Nanotron's
   rule; `{path: weight}` gives the weights, a list or one path weighs them equally);
4. shuffle: per shard, blocks of B = max(4, 256 // N) samples, each permuted by
   `default_rng([seed, shard, block])`;
5. steps: a step takes the next GBS / N samples of every shard; its global batch is shard 0's
   samples, then shard 1's, and so on.

Dp rank d owns the shards [d N / dp, (d + 1) N / dp) (so dp must divide N), which are exactly
its slice of the global batch; of its W = min(max(num_loading_workers, 1), N / dp) workers,
worker w reads the rank's i-th shard when i % W == w, each file once for all its shards, and
yields that part of every step; the loader puts the parts back in shard order (`assemble`).

The position is per logical shard: the block being served, how much of it was taken, and at
the block's start each source's file, next row and leftover tokens and the blend counts (a
block is re-read and re-shuffled on resume). Each dp rank saves its shards' positions in each
checkpoint (`data/stream_dp-<r>-of-<dp>.pt`); a resume at any dp and W gathers every saved file
and hands each shard its position, so the steps after it read the samples the uninterrupted run
would have. Data is read once: a stream that ends before the stage's last step is a `UserError`
naming the source.
"""

from __future__ import annotations

import copy
from collections import deque
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from mesh3d.data.text_files import check_file, read_rows, source_files
from mesh3d.data.worker_failure import Failed
from mesh3d.errors import UserError
from mesh3d.log import logger

_BLOCK = 256  # samples shuffled together: the bounded shuffle buffer
_ROWS = 32  # rows tokenized per call


class _Rows:
    """One worker's rows of one source for the logical shards it owns: each file read once,
    every row handed to its shard's queue; `pos[k]`: the (file, row) shard k reads next."""

    def __init__(self, files: list[Path], column: str, shards: list[int], n: int):
        self.files, self.column, self.n = files, column, n
        self.pos = {k: (0, 0) for k in shards}
        self.queues: dict[int, deque] = {k: deque() for k in shards}
        self._file, self._rows = -1, None  # -1: start at the earliest position

    def restart(self) -> None:
        """Read again from the earliest shard position (after `pos` was restored)."""
        self._file, self._rows = -1, None
        for q in self.queues.values():
            q.clear()

    def take(self, k: int, n: int) -> list[str]:
        """Up to n texts of shard k, in row order; [] at the end of the last file."""
        q = self.queues[k]
        while len(q) < n and self._read():
            pass
        got = [q.popleft() for _ in range(min(n, len(q)))]
        if got:
            self.pos[k] = (got[-1][0], got[-1][1] + 1)
        return [text for _, _, text in got]

    def _read(self) -> bool:
        """Up to `_ROWS` x shards more rows into the queues; False when every file is read."""
        if self._rows is None:
            if self._file == -1:
                self._file, row = min(self.pos.values())
            else:
                self._file, row = self._file + 1, 0
            if self._file >= len(self.files):
                self._file = len(self.files)
                return False
            owned = self.queues.keys()
            self._rows = read_rows(self.files[self._file], self.column, row,
                                   lambda r: r % self.n in owned)  # fmt: skip
        f = self._file
        for i, (row, text) in enumerate(self._rows):
            k = row % self.n
            if k in self.queues and text and (f, row) >= self.pos[k]:
                self.queues[k].append((f, row, text))
            if i + 1 == _ROWS * len(self.queues):
                return True
        self._rows = None
        return True


class _Source:
    """One source's rows of one logical shard, tokenized and cut into windows of S + 1 tokens."""

    def __init__(self, rows: _Rows, stream: StreamedText, shard: int):
        self.rows, self.stream, self.shard = rows, stream, shard
        self.tokens = np.zeros(0, np.int64)

    def position(self) -> list:
        file, row = self.rows.pos[self.shard]
        return [file, row, self.tokens.copy()]

    def restore(self, position: list) -> None:
        self.rows.pos[self.shard] = (int(position[0]), int(position[1]))
        self.tokens = np.asarray(position[2], dtype=np.int64)

    def window(self) -> np.ndarray | None:
        """The next S + 1 tokens; None when the source has no more."""
        w = self.stream.seq_len + 1
        while len(self.tokens) < w:
            texts = self.rows.take(self.shard, _ROWS)
            if not texts:
                return None
            self.tokens = np.concatenate([self.tokens, self.stream.encode(texts)])
        out, self.tokens = self.tokens[:w], self.tokens[w:]
        return out


class _Shard:
    """A logical shard's blended, block-shuffled samples, and its position."""

    def __init__(self, stream: StreamedText, shard: int, rows: list[_Rows]):
        self.stream, self.shard = stream, shard
        self.sources = [_Source(r, stream, shard) for r in rows]
        self.counts = [0] * len(self.sources)
        self.block_index, self.taken, self.block = -1, 0, []
        self.at_block: dict | None = None
        self.ended: int | None = None

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
        for _ in range(self.stream.block):
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
            if self.block_index >= 0 and len(self.block) < self.stream.block:
                return None  # the last block was short: a source ended
            self._fill()
            if not self.block:
                return None
        self.taken += 1
        return self.block[self.taken - 1]

    def state(self) -> dict:
        return {"block": self.block_index, "taken": self.taken, "at_block": self.at_block,
                "counts": list(self.counts)}  # fmt: skip

    def restore_position(self, state: dict) -> None:
        """Phase one of a resume: the sources' positions (the rows are read again after)."""
        if state["at_block"] is None:
            return
        for s, pos in zip(self.sources, state["at_block"]["sources"]):
            s.restore(pos)
        self.counts = list(state["at_block"]["counts"])

    def restore_block(self, state: dict) -> None:
        """Phase two: the block being served, read again, and how much of it was taken."""
        if state["at_block"] is None:
            return
        self.block_index = int(state["block"]) - 1
        self._fill()
        self.taken = int(state["taken"])


class StreamedText:
    """A streamed `hf_dataset_or_datasets` stage, checked up front; `for_rank` binds it to a dp
    rank's loader (see the module doc)."""

    streamed = True  # what the loader asks of a stage's dataset (`loader._streamed`)

    def __init__(self, args, tokenizer_path: str, seq_len: int, seed: int, gbs: int, where: str,
                 shards: int | None = None):  # fmt: skip
        from mesh3d.data.tokenizer import find_eos, load_tokenizer

        spec = args.hf_dataset_or_datasets
        paths = [spec] if isinstance(spec, str) else list(spec)
        weights = list(spec.values()) if isinstance(spec, dict) else [1.0] * len(paths)
        if any(not w >= 0 for w in weights) or sum(weights) <= 0:
            raise UserError(f"{where} hf_dataset_or_datasets weights {weights}: give weights >= 0 "
                            "with a positive sum")  # fmt: skip
        self.shards = gbs if shards is None else shards
        if not isinstance(self.shards, int) or self.shards < 1:
            raise UserError(f"mesh3d.stream_shards must be a positive integer (or null: the global "
                            f"batch size, {gbs}), got {self.shards!r}")  # fmt: skip
        if gbs % self.shards:
            raise UserError(
                f"mesh3d.stream_shards {self.shards} does not divide {where}'s global batch of "
                f"{gbs} samples (each step takes the same number from every logical shard): "
                f"set it to a divisor of {gbs} that your dp sizes divide, e.g. {gbs}"
            )
        self.block = max(4, _BLOCK // self.shards)
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

    def check_dp(self, dp: int) -> None:
        """Every dp rank owns whole logical shards: dp must divide their number."""
        if self.shards % dp:
            raise UserError(
                f"{self.where} is streamed in {self.shards} logical shards "
                f"(mesh3d.stream_shards, default the global batch size), which dp {dp} does not "
                f"divide: choose a dp that divides {self.shards}, or set mesh3d.stream_shards "
                "to a multiple of dp that divides the global batch (a resumed stream keeps "
                "the value it was saved with)"
            )

    def for_rank(self, dp_rank: int, dp: int, micro_batch_size: int, workers: int) -> RankStream:
        self.check_dp(dp)
        return RankStream(self, dp_rank, dp, micro_batch_size, workers)


class RankStream(IterableDataset):
    """One dp rank's stream for the loader: each worker's item is its part of one step (its
    logical shards' samples); `assemble` puts a step's parts back together (module doc)."""

    def __init__(self, stream: StreamedText, dp_rank: int, dp: int, mbs: int, workers: int):
        self.stream, self.dp_rank, self.dp, self.mbs = stream, dp_rank, dp, mbs
        per_rank = stream.shards // dp
        self.owned = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        self.workers = min(max(workers, 1), per_rank)  # parts per step
        self.saved: dict[int, dict] = {}  # logical shard -> its position to resume from
        self.positions: dict[int, dict] = {}  # after the last step `assemble` returned

    def resume_from(self, positions: dict[int, dict]) -> None:
        """Start from saved positions (every shard this rank owns must have one)."""
        self.saved = {k: positions[k] for k in self.owned}
        self.positions = copy.deepcopy(self.saved)

    def _open(self, worker: int) -> tuple[list[int], dict[int, _Shard]]:
        mine = self.owned[worker :: self.workers]
        rows = [_Rows(files, self.stream.column, mine, self.stream.shards)
                for files in self.stream.files]  # fmt: skip
        shards = {k: _Shard(self.stream, k, rows) for k in mine}
        for k, shard in shards.items():
            if k in self.saved:
                shard.restore_position(_positions_to_numpy(self.saved[k]))
        for r in rows:
            r.restart()
        for k, shard in shards.items():
            if k in self.saved:
                shard.restore_block(self.saved[k])
        return mine, shards

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        try:
            mine, shards = self._open(worker)
        except Exception as e:  # noqa: BLE001 - carried to the training process
            yield Failed(e)
            return
        per = self.stream.gbs // self.stream.shards
        told = {k: None for k in mine}  # the block whose start position was last sent
        while True:
            try:
                part = []
                for k in mine:
                    rows = [shards[k].sample() for _ in range(per)]
                    if any(r is None for r in rows):
                        raise self._ended(shards[k])
                    part.append((k, np.stack(rows)))
            except Exception as e:  # noqa: BLE001 - carried to the training process
                yield Failed(e)
                return
            states = {}
            for k in mine:
                st = shards[k].state()
                if told[k] == st["block"]:
                    st = {**st, "at_block": None}  # the main process has it already
                told[k] = st["block"]
                states[k] = st
            yield (worker, part, states)

    def assemble(self, parts: list) -> list:
        """One step's microbatches from its parts (one per worker), and the positions after it."""
        samples = {}
        for _, part, states in parts:
            samples.update(part)
            for k, st in states.items():
                if st["at_block"] is None:
                    st = {**st, "at_block": self.positions[k]["at_block"]}
                self.positions[k] = st
        t = torch.from_numpy(np.concatenate([samples[k] for k in self.owned]))
        return [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in t.split(self.mbs)]

    def _ended(self, shard: _Shard) -> UserError:
        k = shard.ended or 0
        return UserError(
            f"{self.stream.where}: hf_dataset_or_datasets {self.stream.paths[k]!r} ran out "
            f"after {shard.counts[k]} samples of logical shard {shard.shard} of "
            f"{self.stream.shards} (dp rank {self.dp_rank}); streamed data is read once: add "
            "data, lower tokens.train_steps, or start the next data stage earlier"
        )

    def state(self) -> dict[int, dict]:
        """Each owned shard's position after the last assembled step (tokens as tensors)."""
        return {k: _positions_to_torch(st) for k, st in self.positions.items()}


def _positions_to_numpy(state: dict) -> dict:
    if state["at_block"] is None:
        return state
    sources = [[f, r, np.asarray(t, dtype=np.int64)] for f, r, t in state["at_block"]["sources"]]
    return {**state, "at_block": {**state["at_block"], "sources": sources}}


def _positions_to_torch(state: dict) -> dict:
    if state["at_block"] is None:
        return copy.deepcopy(state)
    sources = [[int(f), int(r), torch.as_tensor(np.asarray(t), dtype=torch.int64).clone()]
               for f, r, t in state["at_block"]["sources"]]  # fmt: skip
    return {"block": int(state["block"]), "taken": int(state["taken"]),
            "counts": list(state.get("counts", [])),
            "at_block": {"sources": sources, "counts": list(state["at_block"]["counts"])}}  # fmt: skip


def build_stage(s) -> StreamedText:
    """A streamed stage (`mesh3d.hf_streaming`; `data/build.py`'s `StageData` `s`)."""
    from mesh3d.data.tokenizer import check_tokenizer_vocab

    tokenizer = s.tokenizer()
    if not tokenizer:
        raise UserError(
            f"{s.where} streams hf_dataset_or_datasets, which needs a tokenizer: set "
            "tokenizer.tokenizer_name_or_path to a local folder with tokenizer.json"
        )
    check_tokenizer_vocab(tokenizer, s.vocab_size)
    cfg = s.cfg
    ds = StreamedText(s.dataset, tokenizer, s.seq, s.seed, s.gbs, s.where, cfg.mesh3d.stream_shards)
    ds.check_dp(cfg.parallelism.dp)
    return ds
