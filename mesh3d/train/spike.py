"""The loss-spike guard (`mesh3d.loss_spike`): a loss that explodes without becoming NaN.

At lr 1e3 the checkpoint of step 3 was finite but already diverged (loss 3.0e6) and became
`latest`: the non-finite guard saw nothing. Here a step whose loss, or gradient norm, is more
than `factor` times the median of the last `window` healthy steps is a spike:
- its update is not applied (`train_step` asks `accepts` before the optimizer step), as for a
  non-finite step; the LR schedule and the data move on;
- `max_skipped` spikes in a row stop the run (`LossSpikeError`, exit 3) naming the last healthy
  checkpoint; a healthy step in between starts the count again (a bad batch is skipped once).
The first `warmup` healthy steps are never spikes (the median needs them). Spiking and
non-finite steps stay out of the median. Loss and gradient norm are the same on every rank (an
all-reduce gave them), so every rank takes the same decision without a collective; the history
goes into each checkpoint's metadata, so a resumed run decides as the uninterrupted one would.

Which checkpoint is healthy: the loss of step s is computed with the weights the update of step
s - 1 made, so a checkpoint's weights are judged by the next step's loss. With the guard on, a
checkpoint is named in `latest.txt` only once the step after it was healthy (`settle`); one the
next step found spiking, or one saved while the loss spiked (its weights made that loss), is
marked in its metadata (`custom_metas.loss_spike`) and never named. A checkpoint saved at the
end of the run or on a preemption signal has no next step: it is named at once unless the loss
was spiking (a restart must not lose the work since the last interval).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

from mesh3d.checkpoint.training import add_custom_metas
from mesh3d.config.schema import LossSpikeArgs
from mesh3d.errors import LossSpikeError
from mesh3d.log import logger


class SpikeGuard:
    """The running medians, the spikes in a row, the checkpoint waiting to be judged.

    Example:

        spikes = SpikeGuard(LossSpikeArgs(factor=3.0))
        if spikes.accepts(loss, grad_norm): optimizer.step()
        spikes.check(step, loss, grad_norm, last_checkpoint)   # warns, or raises
    """

    def __init__(self, args: LossSpikeArgs):
        self.args = args
        self.losses: deque[float] = deque(maxlen=args.window)
        self.norms: deque[float] = deque(maxlen=args.window)
        self.in_a_row = 0  # spikes since the last healthy step
        self.total = 0  # spiking steps skipped in this run, resumes included
        self.pending: Path | None = None  # a saved step folder the next step judges

    @property
    def spiking(self) -> bool:
        """The last step spiked: the weights now are those that made its loss."""
        return self.in_a_row > 0

    def reason(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is a spike, None when it is not (or cannot be judged yet)."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if len(self.losses) < self.args.warmup or not finite:
            return None
        k, window = self.args.factor, len(self.losses)
        for name, value, history in (("lm_loss", loss, self.losses),
                                     ("grad_norm", grad_norm, self.norms)):  # fmt: skip
            median = statistics.median(history)
            if value > k * median:
                return f"{name} {value:.6g} > {k:g} x {median:.6g}, the median of the last {window} healthy steps"
        return None

    def accepts(self, loss: float, grad_norm: float) -> bool:
        """Whether `train_step` applies this step's update (False for a spike)."""
        return self.reason(loss, grad_norm) is None

    def check(self, step: int, loss: float, grad_norm: float, last: Callable[[], str],
              why: str | None = "") -> None:  # fmt: skip
        """Count step `step`, whose update `train_step` did not apply if it spiked: a warning,
        or after `max_skipped` spikes in a row a `LossSpikeError`; `last()` names the checkpoint
        a restart resumes from. `why`: the step's `reason`, when the caller already took it."""
        why = self.reason(loss, grad_norm) if why == "" else why
        if why is None:
            if math.isfinite(loss) and math.isfinite(grad_norm):
                self.in_a_row = 0
                self.losses.append(loss)
                self.norms.append(grad_norm)
            return
        self.in_a_row += 1
        self.total += 1
        allowed, n = self.args.max_skipped, self.in_a_row
        if n <= allowed:
            logger.warning(
                f"step {step}: loss spike ({why}); update skipped ({n} in a row of "
                f"mesh3d.loss_spike.max_skipped={allowed})"
            )
            return
        raise LossSpikeError(
            f"step {step}: the loss spiked {n} step(s) in a row ({why}); their updates were not "
            f"applied. {last()} Checkpoints whose weights made a spiking loss are marked "
            "(custom_metas.loss_spike) and never named in latest.txt. Lower the learning rate "
            "(optimizer.learning_rate_scheduler.learning_rate) or clip_grad, check the data, "
            "or raise mesh3d.loss_spike.factor or max_skipped"
        )

    # ------------------------------------------------------------------ healthy checkpoints

    def metas(self) -> dict:
        """What a checkpoint saved now keeps (`custom_metas`): the history, and the mark when
        the loss is spiking."""
        out = {"loss_spike_guard": self.state()}
        if self.spiking:
            out["loss_spike"] = {"saved_while_spiking": self.in_a_row}
        return out

    def names_at_once(self, step_dir: Path, last_step: bool) -> bool:
        """Whether the checkpoint `step_dir`, about to be saved, goes into `latest.txt` now;
        else it waits for the next step to judge it (`settle`)."""
        if self.spiking:
            return False
        if last_step:
            return True
        self.pending = step_dir
        return False

    def settle(self, healthy: bool, name_latest: Callable[[Path], None], writes: bool) -> None:
        """After a step was checked: the waiting checkpoint is named in `latest.txt` if the step
        was `healthy` (finite, no spike) through `name_latest` (the checkpointer's: the bucket
        follows), else marked. `writes`: this rank writes (rank 0)."""
        step_dir, self.pending = self.pending, None
        if step_dir is None or not writes:
            return
        try:
            if healthy:
                name_latest(step_dir)
            else:
                add_custom_metas(step_dir, {"loss_spike": {"next_step_unhealthy": True}})
                logger.warning(f"{step_dir}: the next step's loss spiked or was not finite; "
                               "marked, not named in latest.txt")  # fmt: skip
        except Exception as e:  # a full disk: the folder stays unnamed, training goes on
            logger.warning(f"could not settle {step_dir}: {e}")

    def state(self) -> dict:
        """The history (JSON), so that a resumed run decides the same."""
        return {"losses": list(self.losses), "grad_norms": list(self.norms),
                "in_a_row": self.in_a_row, "total": self.total}  # fmt: skip

    def load(self, state: dict) -> None:
        self.losses.clear()
        self.norms.clear()
        self.losses.extend(float(x) for x in state.get("losses", []))
        self.norms.extend(float(x) for x in state.get("grad_norms", []))
        self.in_a_row = int(state.get("in_a_row", 0))
        self.total = int(state.get("total", 0))
