"""What makes a training run fail safe, around its step loop (docs/faults.md): the folder
lock, a `Watchdog` per rank, and stop signals that only set a flag `stop_requested()` agrees on
across ranks at the end of every step, so every rank stops after the same step."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from mesh3d import extensions
from mesh3d.checkpoint.folder import latest_step
from mesh3d.checkpoint.lock import STALE_S
from mesh3d.checkpoint.run_folder import claim_folder, clear_steps
from mesh3d.errors import Interrupted, NonFiniteError, RunStopped, UserError, on_every_rank, report
from mesh3d.log import logger
from mesh3d.mesh import collective_timeout, share
from mesh3d.train.signals import StopSignals
from mesh3d.train.watchdog import Watchdog, heartbeat_interval, is_collective_failure

NONFINITE = "non-finite"  # a step's verdict when its loss or gradient norm is not finite


class RunGuard:
    """The lock, watchdog and signal handling of one run.

    Example:

        with RunGuard(cfg, device) as guard:
            start = resume(guard.resume_path)
            for step in ...:
                guard.at(step, "step"); ...
                if guard.stop_requested(): save; raise Preempted(...)
    """

    def __init__(self, cfg, device: torch.device):
        self.cfg, self.device = cfg, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.lock, self.resume_path, self.watchdog = None, None, None
        self.stale_steps: list[int] = []  # to delete before training (existing_checkpoints)
        spike = cfg.mesh3d.loss_spike
        self.spikes = extensions.load("loss_spike").SpikeGuard(spike) if spike else None
        self.signals: StopSignals | None = None
        self.skipped = 0  # non-finite steps skipped so far (resumed runs continue the count)
        self.losses: list[str] = []  # the last finite steps' losses, for the non-finite line
        self._verdict: tuple = ((), None)  # ((loss, grad_norm), the step's verdict)
        self.fail_at = _injected_failure(self.rank)
        self.leave_wait_s = 0.0  # how long world rank 0 may still upload as the run ends

    def __enter__(self) -> RunGuard:
        self.run_id = run_id = share(uuid.uuid4().hex[:12] if self.rank == 0 else None)
        if self.cfg.checkpoints is not None:
            outcome = None
            if self.rank == 0:
                try:
                    claim = claim_folder(self.cfg, run_id)
                    self.lock = claim.lock
                    outcome = ("ok", (claim.resume, claim.stale_steps))
                except UserError as e:
                    outcome = ("error", str(e))
            m = self.cfg.mesh3d  # a resume from s3:// downloads on rank 0 meanwhile
            slow = str(self.cfg.checkpoints.resume_checkpoint_path or "").startswith("s3://")
            wait_s = m.checkpoint_timeout_s if slow else m.collective_timeout_s
            with collective_timeout(None, wait_s, m.collective_timeout_s):
                kind, value = share(outcome)
            if kind == "error":
                raise on_every_rank(UserError(value))
            self.resume_path, self.stale_steps = value
        interval = heartbeat_interval(self.cfg.mesh3d.collective_timeout_s)
        self.watchdog = Watchdog(self.rank, self.world, interval, run_id, self.lock,
                                 self.last_checkpoint).__enter__()  # fmt: skip
        self.signals = StopSignals(self._first_signal, self._second_signal).__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            expected = isinstance(exc, (RunStopped, UserError, KeyboardInterrupt))
            if exc is not None and not expected and self.world > 1 and is_collective_failure(exc):
                peer_error = self.watchdog.diagnose(exc)
                report(peer_error)
                raise peer_error from exc
            if isinstance(exc, (RunStopped, UserError)):
                report(exc)  # now, while SIGTERM from the launcher only sets a flag
        finally:
            if self.watchdog is not None:
                self.watchdog.exited(_exit_reason(exc))
            if self.signals is not None:
                self.signals.__exit__(None, None, None)
            if self.watchdog is not None:
                self.watchdog.__exit__(None, None, None)
            if self.lock is not None:
                self.lock.release()
            self._leave_together(exc)

    def _leave_together(self, exc: BaseException | None) -> None:
        """When every rank ends at the same point, no rank leaves before the others: a launcher
        ends the ranks still running once one exits with an error, and world rank 0 may still
        be uploading (`leave_wait_s`)."""
        if self.world == 1 or not (exc is None or getattr(exc, "same_on_every_rank", False)):
            return
        m = self.cfg.mesh3d
        try:
            with collective_timeout(None, self.leave_wait_s + m.collective_timeout_s,
                                    m.collective_timeout_s):  # fmt: skip
                dist.barrier()
        except Exception as e:  # noqa: BLE001 - the run is over; say so and go
            logger.warning(f"a rank did not reach the end of the run: {str(e).splitlines()[0]}")

    def _first_signal(self, signum: int) -> None:
        ck = self.cfg.checkpoints
        then = (
            "saving a checkpoint" if ck is not None else "(no checkpoints section) saving nothing"
        )
        logger.warning(
            f"received {signal.Signals(signum).name}: finishing step {self.watchdog.step}, then "
            f"{then} and exiting (Ctrl-C again, a second later, exits at once)"
        )

    def _second_signal(self, signum: int) -> None:
        """Stop now (the process exits after this): one line, the lock let go, peers told."""
        name, dog = signal.Signals(signum).name, self.watchdog
        report(Interrupted(
            f"{name} received a second time: stopped at once in step {dog.step} ({dog.phase}); "
            f"nothing of this step was saved. {self.last_checkpoint()}", signum,
        ))  # fmt: skip
        dog.exited(f"stopped by a second {name}")
        for child in multiprocessing.active_children():  # the loader's workers, whose parent is
            child.kill()  # the forkserver: they and it would outlive the process's os._exit
        if self.lock is not None:
            self.lock.release()

    def stop_requested(self) -> str | None:
        """The stop signal any rank received by now (same answer on every rank), or None."""
        flag = torch.tensor([self.signals.received or 0], dtype=torch.int64, device=self.device)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return signal.Signals(value).name if value else None

    def clear_stale_steps(self) -> None:
        """Delete the old step folders `mesh3d.existing_checkpoints: overwrite` replaces, once
        the resume (if any) loaded. Rank 0 deletes; every rank gets the outcome."""
        if not self.stale_steps:
            return
        problem = None
        if self.rank == 0:
            try:
                clear_steps(Path(self.cfg.checkpoints.checkpoints_path), self.stale_steps)
            except OSError as e:
                problem = f"mesh3d.existing_checkpoints=overwrite could not delete {e.filename}: {e.strerror}; delete the old step folders yourself"
        problem = share(problem)
        self.stale_steps = []
        if problem:
            raise on_every_rank(UserError(problem))

    def accepts(self, loss: float, grad_norm: float) -> bool:
        """Whether the step's update is applied (`train_step` asks before the optimizer step)."""
        return self.verdict(loss, grad_norm) is None

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """The step's one decision, taken once and kept for `after_step`: None when healthy,
        else why not (`NONFINITE`, or the loss spike's reason)."""
        values, kept = self._verdict
        if values == (loss, grad_norm):
            return kept
        why = NONFINITE
        if math.isfinite(loss) and math.isfinite(grad_norm):
            why = None if self.spikes is None else self.spikes.reason(loss, grad_norm)
        self._verdict = ((loss, grad_norm), why)
        return why

    def after_step(self, step: int, loss: float, grad_norm: float,
                   name_latest: Callable[[Path], None]) -> None:  # fmt: skip
        """Act on step `step`'s verdict: a non-finite step or a spike is skipped or stops the
        run; with the loss-spike guard the checkpoint waiting for this step is named (through
        `name_latest`) or marked."""
        why = self.verdict(loss, grad_norm)
        self.check_finite(step, loss, grad_norm)
        if self.spikes is None:
            return
        try:
            spike = None if why == NONFINITE else why
            self.spikes.check(step, loss, grad_norm, lambda: self.last_checkpoint("healthy"), spike)
        finally:
            self.spikes.settle(why is None, name_latest, writes=self.rank == 0)

    def step_metrics(self) -> dict:
        """The guard's counts for the metrics line: steps skipped so far, each kind."""
        out = {"skipped_steps": self.skipped} if self.skipped else {}
        if self.spikes is not None and self.spikes.total:
            out["loss_spikes"] = self.spikes.total
        return out

    def checkpoint_metas(self) -> dict:
        """What a checkpoint keeps of the guard (`custom_metas`): counts, spike history, mark."""
        out = {"skipped_nonfinite_steps": self.skipped} if self.skipped else {}
        return out | (self.spikes.metas() if self.spikes is not None else {})

    def names_latest(self, step_dir: Path, last_step: bool) -> bool:
        """Whether the checkpoint about to be saved goes into `latest.txt` at once."""
        return self.spikes is None or self.spikes.names_at_once(step_dir, last_step)

    def resumed(self, custom: dict) -> None:
        """Continue the counts and history kept in the resumed checkpoint's `custom_metas`."""
        self.skipped = int(custom.get("skipped_nonfinite_steps", 0) or 0)
        if self.spikes is not None and isinstance(custom.get("loss_spike_guard"), dict):
            self.spikes.load(custom["loss_spike_guard"])

    def check_folder_owner(self, step: int) -> None:
        """Before writing step `step`: stop every rank if another run took this run's folder
        (across hosts after `STALE_S` without a refresh), so two runs never write into one."""
        if self.cfg.checkpoints is None:
            return
        taken = share(self.lock.taken_by() if self.lock is not None else None)
        if taken is None:
            return
        if self.lock is not None:
            self.lock.held = False  # not ours: never refreshed nor removed again
        root = self.cfg.checkpoints.checkpoints_path
        raise on_every_rank(UserError(
            f"checkpoints folder {root} now belongs to {taken}: it was taken over while this run "
            f"did not refresh its lock for over {STALE_S:.0f} s (suspended or stopped on another "
            f"host). This run stops before writing step {step}, so the two runs do not mix "
            "their checkpoints; stop one of them or give them different checkpoints_path"
        ))  # fmt: skip

    def at(self, step: int, phase: str) -> None:
        """Tell the watchdog where this rank is; the step of `MESH3D_FAIL_AT` fails here."""
        self.watchdog.at(step, phase)
        if phase == "step":
            self._verdict = ((), None)  # a new step has no verdict yet
            if step == self.fail_at:
                raise RuntimeError(
                    f"MESH3D_FAIL_AT: injected failure on rank {self.rank} at step {step}"
                )

    def last_checkpoint(self, kind: str = "complete") -> str:
        """One sentence: the checkpoint a restart would resume from (the last `kind` one)."""
        ck = self.cfg.checkpoints
        if ck is None:
            return "No checkpoints are configured: a restart starts from step 0."
        step = latest_step(Path(ck.checkpoints_path))
        if step is None:
            return f"No complete checkpoint in {ck.checkpoints_path} yet."
        return f"The last {kind} checkpoint is {Path(ck.checkpoints_path) / str(step)}."

    def check_finite(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when the update was applied; a non-finite step is skipped or stops the run."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.losses = [*self.losses[-2:], f"{step}: {loss:.4g}"]
            return True
        allowed = self.cfg.mesh3d.skip_nonfinite_steps
        what = f"lm_loss {loss}, grad_norm {grad_norm}"
        if self.skipped < allowed:
            self.skipped += 1
            logger.warning(
                f"step {step}: non-finite ({what}); update skipped "
                f"({self.skipped} of mesh3d.skip_nonfinite_steps={allowed})"
            )
            return False
        skipped = f" after skipping {self.skipped} such step(s)" if self.skipped else ""
        raise NonFiniteError(
            f"step {step}: non-finite values ({what}){skipped}; the update was not applied and "
            f"nothing was saved. {self.last_checkpoint()}{self._rising()} Lower the learning rate "
            "(optimizer.learning_rate_scheduler.learning_rate) or clip_grad, check the data, "
            "or set mesh3d.skip_nonfinite_steps to skip a few such steps"
        )

    def _rising(self) -> str:
        """The last losses before a non-finite step: a rise may have reached the checkpoint."""
        if not self.losses:
            return ""
        return (f" The loss before it (step: lm_loss) was {', '.join(self.losses)}; if it was "
                "already rising, that checkpoint may hold diverging weights: resume from an "
                "earlier one.")  # fmt: skip


def _injected_failure(rank: int) -> int | None:
    """`MESH3D_FAIL_AT=RANK:STEP` makes that rank raise at that step (the fault tests)."""
    spec = os.environ.get("MESH3D_FAIL_AT")
    if not spec:
        return None
    r, s = (int(x) for x in spec.split(":"))
    return s if r == rank else None


def _exit_reason(exc: BaseException | None) -> str:
    """Why this rank ends its run, for its last heartbeat."""
    if exc is None:
        return "it finished"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:200]
