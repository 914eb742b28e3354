"""The loader: each step's microbatches read ahead by `num_loading_workers` worker processes.

One `StatefulDataLoader` per data stage (docs/data.md). A map-style stage is a dataset over steps
(`StepDataset`): workers change when a batch is read, never what it holds, so a resume needs no
loader state. A streamed stage's position is saved per dp rank (`data_state`) and taken up at any
dp (`Feed.resume`). Workers start from a 'forkserver': a fork of a rank running gloo can hang.
"""

from __future__ import annotations

import copy
import multiprocessing
import multiprocessing.connection
import signal
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from mesh3d.data.dummy import microbatches
from mesh3d.data.worker_failure import Failed, by_value
from mesh3d.errors import DataWorkerError, UserError, on_every_rank
from mesh3d.torch_private import loader_workers, set_loader_timeout, shutdown_loader_workers

_PREFETCH = 2  # steps each worker reads ahead
_POLL = 2.0  # seconds between checks that the workers are alive while waiting for a batch


class StepDataset(Dataset):
    """Map-style over steps: `self[step]` -> (step, this dp rank's microbatches of `step`)."""

    def __init__(self, dataset, start: int, gbs: int, dp_rank: int, dp: int, mbs: int):
        self.dataset, self.start, self.gbs = dataset, max(start, 1), gbs
        self.dp_rank, self.dp, self.mbs = dp_rank, dp, mbs

    def __getitem__(self, step: int):
        try:
            return step, by_value(microbatches(self.dataset, step - self.start + 1, self.gbs,
                                               self.dp_rank, self.dp, self.mbs))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - carried to the training process, raised there
            return step, Failed(e)


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)  # the ranks' cores are for the step; a worker stacks small tensors
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle


class StageLoader:
    """The batches of one data stage from step `first` on, through `workers` processes.

    `dataset`: a `StepDataset`, or an `IterableDataset` yielding one step's microbatches per item
    from `first`; `where`: the stage and its files (for errors).
    """

    def __init__(self, dataset, first: int, last: int, workers: int, *, where: str,
                 timeout_s: float, pin: bool = False):  # fmt: skip
        self.next_step, self.last = first, last
        self.where, self.workers, self.timeout_s, self.pin = where, workers, timeout_s, pin
        self.streamed = isinstance(dataset, IterableDataset)
        self.dataset, self.parts = dataset, getattr(dataset, "workers", 1)
        kwargs = dict(multiprocessing_context=_context(), prefetch_factor=_PREFETCH,
                      timeout=timeout_s, persistent_workers=False,
                      worker_init_fn=_worker_init) if workers > 0 else {}  # fmt: skip
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            self.loader = StatefulDataLoader(
                dataset, batch_size=None, num_workers=workers,
                sampler=None if self.streamed else range(first, last + 1), collate_fn=_keep,
                **kwargs,
            )  # fmt: skip
        self._it: Iterator | None = None

    def next(self, step: int) -> list:
        """The microbatches of `step`, which must be the next one of this loader."""
        assert step == self.next_step <= self.last, (step, self.next_step, self.last)
        try:
            item = self._next_item()
            if self.streamed:  # one part per worker, put together in shard order
                parts = [item] + [self._next_item() for _ in range(self.parts - 1)]
                failed = [p for p in parts if isinstance(p, Failed)]
                item = failed[0] if failed else self.dataset.assemble(parts)
        except StopIteration:
            raise UserError(
                f"{self.where}: the data ended before step {step}; add data or "
                "lower tokens.train_steps"
            ) from None
        except (RuntimeError, OSError, EOFError) as e:  # a dead worker, or none answered
            raise self._dead(step, e) from None
        got, batches = (step, item) if self.streamed else item
        if isinstance(batches, Failed):
            self.close()
            who = "the training process" if batches.worker is None else f"data worker {batches.worker}"  # fmt: skip
            if batches.user:
                raise UserError(f"{batches.text} (read by {who})")
            raise DataWorkerError(
                f"{who} failed reading step {step} of {self.where}: "
                f"{batches.text}; fix or replace the file, or set num_loading_workers: 0 to "
                "see the traceback in the training process"
            )
        batches = [tuple(_tensor(a, self.pin) for a in mb) for mb in batches]
        assert got == step, (got, step)
        self.next_step += 1
        return batches

    def _next_item(self):
        """The loader's next item, waited for in `_POLL`-second waits up to `timeout_s`: workers
        are the forkserver's children, so no SIGCHLD tells the DataLoader one died."""
        if self._it is None:  # start the workers (the first time, the forkserver and resource
            # tracker too) with SIGUSR1 blocked: Slurm's notice is the rank's; it would kill them
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
            try:
                self._it = iter(self.loader)  # reads the first steps ahead
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if self.workers:
                set_loader_timeout(self._it, min(_POLL, self.timeout_s))  # read by each wait
        waited = 0.0
        while True:
            try:
                return next(self._it)
            except RuntimeError as e:
                waited += _POLL
                if "timed out" not in str(e) or waited >= self.timeout_s:
                    raise

    def _dead(self, step: int, error: Exception) -> DataWorkerError:
        """The one-line error for a worker that died or did not answer in time."""
        workers = loader_workers(self._it)
        if workers:  # a worker killed a moment ago may not be reaped yet
            multiprocessing.connection.wait([w.sentinel for w in workers], timeout=2.0)
        dead = [(i, w.pid, w.exitcode) for i, w in enumerate(workers) if not w.is_alive()]
        if not dead:
            for w in workers:  # hung (or stopped): they would outlive the run otherwise
                w.kill()
        self.close()
        if dead:
            i, pid, code = dead[0]
            how = f"was killed by signal {-code}" if code and code < 0 else f"exited ({code})"
            what = f"data worker {i} (pid {pid}) {how}"
            fix = "if it was killed for memory (see dmesg), lower num_loading_workers"
        elif "timed out" in str(error):
            what = f"no data worker answered within {self.timeout_s:.0f} s (a worker hung)"
            fix = "check the files are readable and not on a stalled file system"
        else:
            what = f"the data workers failed ({error})"
            fix = "check the files"
        return DataWorkerError(
            f"{what} while reading step {step} of {self.where}; {fix}, or set "
            "num_loading_workers: 0 to read in the training process; resume from the last "
            "checkpoint"
        )

    def close(self) -> None:
        """Stop the workers, if any."""
        it, self._it = self._it, None
        if it is not None:
            shutdown_loader_workers(it)


def _tensor(a, pin: bool) -> torch.Tensor:
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    return t.pin_memory() if pin else t


def _context():
    """The forkserver context, its server preloading what a worker imports (once per rank)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "mesh3d.data.loader", "mesh3d.data.build"])
    return ctx


def _keep(item):
    """No collation: an item already is one step's list of microbatches."""
    return item


def worker_pids(loader: StageLoader) -> list[int]:
    """The pids of a loader's running workers (tests kill one)."""
    return [w.pid for w in loader_workers(loader._it) if w.is_alive()]


class Feed:
    """This rank's batches of every step, stage after stage (`Run.batches` asks it). A step out
    of order reopens its stage's loader at it (a stream re-reads from the stage's first step)."""

    def __init__(self, data, dp_rank: int, dp: int, micro_batch_size: int, *,
                 timeout_s: float, pin: bool = False):  # fmt: skip
        self.data, self.dp_rank, self.dp, self.mbs = data, dp_rank, dp, micro_batch_size
        self.timeout_s, self.pin = timeout_s, pin
        self.loader: StageLoader | None = None
        self.stage: int | None = None
        self._resume: tuple[int, int, dict] | None = None  # (stage, next step, positions)

    def batches(self, step: int) -> list:
        data = self.data
        data.log_stage(step)
        i = data.stage_at(step)
        if data.workers[i] == 0 and not _streamed(data.datasets[i]):
            self.close()
            return data.read(step, self.dp_rank, self.dp, self.mbs)
        if self.loader is None or self.stage != i or self.loader.next_step != step:
            self.close()
            self.loader, self.stage = self._open(i, step), i
        return self.loader.next(step)

    def streams(self, step: int) -> bool:
        """Whether the stage active at `step` is streamed (read while training)."""
        return _streamed(self.data.datasets[self.data.stage_at(step)])

    def _open(self, i: int, step: int) -> StageLoader:
        data = self.data
        ds, first, workers = data.datasets[i], step, data.workers[i]
        if _streamed(ds):
            ds = ds.for_rank(self.dp_rank, self.dp, self.mbs, workers)
            workers = ds.workers if workers > 0 else 0
            first = max(data.starts[i], 1)
            if self._resume is not None and self._resume[:2] == (i, step):
                ds.resume_from(self._resume[2])
                first = step
        else:
            ds = StepDataset(ds, data.starts[i], data.gbs, self.dp_rank, self.dp, self.mbs)
        loader = StageLoader(ds, first, data.last_step(i), workers, where=data.sources[i],
                             timeout_s=self.timeout_s, pin=self.pin)  # fmt: skip
        while loader.next_step < step:  # a stream opened past its start reads up to `step`
            loader.next(loader.next_step)
        return loader

    def resume(self, step: int, saved: list[dict], checkpoint: str) -> None:
        """Continue after checkpoint `checkpoint` of step `step` from `saved`, its stream
        positions (one per dp rank it was saved with): this rank takes the shards it owns now."""
        data = self.data
        if step >= data.train_steps:
            return
        i = data.stage_at(step + 1)
        ds = data.datasets[i]
        if not _streamed(ds) or step + 1 <= max(data.starts[i], 1):
            return  # map-style data, or a stream that starts afresh at the next step
        fix = f"or start a new data stage at step {step + 1} (a stage's stream starts afresh)"
        positions: dict[int, dict] = {}
        for got in saved:
            if "positions" not in got:  # written per dp rank and worker, before logical shards
                raise on_every_rank(UserError(
                    f"checkpoint {checkpoint} holds a stream position of {data.sources[i]} from "
                    "before logical shards (split by dp and workers); it cannot continue "
                    f"exactly: resume it with the mesh3d version that saved it, {fix}"))  # fmt: skip
            if (got["stage"], got["shards"]) != (i, ds.shards):
                raise on_every_rank(UserError(
                    f"checkpoint {checkpoint} streamed data stage {got['stage']} in "
                    f"{got['shards']} logical shards (mesh3d.stream_shards); this run streams "
                    f"stage {i} in {ds.shards}: set mesh3d.stream_shards: {got['shards']}, {fix}"))  # fmt: skip
            positions.update(got["positions"])
        missing = sorted(set(range(ds.shards)) - positions.keys())
        if missing:
            raise on_every_rank(UserError(
                f"checkpoint {checkpoint} holds no stream position of {data.sources[i]} for "
                f"logical shard(s) {missing[:8]} of {ds.shards} (a data/stream_dp-*.pt file is "
                f"missing, or it was saved without mesh3d.hf_streaming); the stream cannot "
                f"continue exactly: copy the checkpoint whole, {fix}"))  # fmt: skip
        self._resume = (i, step + 1, positions)

    def data_state(self, step: int) -> dict | None:
        """This dp rank's stream positions after `step` (None: that stage is not streamed)."""
        i = self.data.stage_at(step)
        ds = self.data.datasets[i]
        if not _streamed(ds):
            return None
        if self.loader is not None and self.stage == i and self.loader.next_step == step + 1:
            positions = self.loader.dataset.state()  # per logical shard, after the last step
        elif self._resume is not None and self._resume[:2] == (i, step + 1):
            per = ds.shards // self.dp  # saved again before any step read
            owned = range(self.dp_rank * per, (self.dp_rank + 1) * per)
            positions = {k: copy.deepcopy(self._resume[2][k]) for k in owned}
        else:
            return None
        return {"stage": i, "shards": ds.shards, "positions": positions}

    def close(self) -> None:
        """Stop the active loader's workers (at the end of a run, or a stage switch)."""
        if self.loader is not None:
            self.loader.close()
        self.loader = self.stage = None


def _streamed(dataset) -> bool:
    return getattr(dataset, "streamed", False)  # `streaming.StreamedText`
