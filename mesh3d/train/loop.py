"""The training run: each step, then its metrics, evaluation, finite and spike checks, save,
and the stop check. `train(cfg)` is what `mesh3d train` calls on every rank."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mesh3d import extensions
from mesh3d.errors import Interrupted, Preempted, RunStopped, UserError, decided_alike
from mesh3d.log import logger
from mesh3d.mesh import share
from mesh3d.train.evaluate import evaluate, is_evaluation_step
from mesh3d.train.guard import RunGuard
from mesh3d.train.metrics import iteration_metrics, memory_metrics, peak_memory, peak_tflops
from mesh3d.train.profiling import step_profiler
from mesh3d.train.run import Run
from mesh3d.train.sinks import MetricSinks


@dataclass
class RunResult:
    """What a run returns: one metrics dict per step (and, with `KeepModel`, the model)."""

    metrics: list[dict] = field(default_factory=list)
    model: torch.nn.Module | None = None  # the model, or a ModuleList of this rank's stages
    optimizer: torch.optim.Optimizer | None = None
    mesh: DeviceMesh | None = None
    start_step: int = 0  # the step the run resumed from (0: it started fresh)
    saved_dir: Path | None = None  # the step folder this run saved last (None: it saved none)
    uploads: object | None = None  # `s3_upload`'s `upload.UploadReport` (None: no upload)
    evals: list[dict] = field(default_factory=list)  # each in-run evaluation's scores (lighteval:)


def _resume(run: Run, guard: RunGuard) -> tuple[int, int, str | None]:
    """(last step, consumed samples, W&B run id) from where `guard` decided the run starts."""
    cfg, ck = run.cfg, run.cfg.checkpoints
    if guard.resume_path is None:
        guard.clear_stale_steps()
        if ck is not None and ck.save_initial_state:
            _save(run, guard, 0, 0, None)
        return 0, 0, None
    guard.at(0, "load")
    start, consumed, custom = run.load(guard.resume_path)
    if start > cfg.tokens.train_steps:
        raise UserError(
            f"checkpoint {guard.resume_path} is at step {start}, past tokens.train_steps "
            f"({cfg.tokens.train_steps}): nothing to train. Raise tokens.train_steps to train on"
        )
    from mesh3d.checkpoint.resume_notes import resume_change  # a resumed run's only

    change = resume_change(guard.resume_path, cfg, run.layout, start, run.data.gbs)  # or refused
    guard.clear_stale_steps()  # overwrite: only now that the checkpoint loaded
    logger.info(
        f"Resumed from {guard.resume_path} at step {start}" + (f": {change}" if change else "")
    )
    guard.resumed(custom)
    return start, consumed, custom.get("wandb_id") if ck.load_lr_scheduler else None


def _save(run: Run, guard: RunGuard, step: int, consumed: int, wandb_id: str | None,
          last_step: bool = False) -> Path:  # fmt: skip
    """Save step `step`, return its folder; `last_step`: no step follows (the end, or a stop
    signal), so it is written before the run ends, never in the background."""
    extra = ({"wandb_id": wandb_id} if wandb_id else {}) | guard.checkpoint_metas()
    guard.check_folder_owner(step)
    guard.at(step, "save")
    step_dir = Path(run.cfg.checkpoints.checkpoints_path) / str(step)
    background = run.cfg.mesh3d.async_checkpoint and not last_step
    run.save(step, consumed, extra, guard.names_latest(step_dir, last_step), background=background)
    return step_dir


def _stopped(signal_name: str, step: int, cfg, saved: int, spiked: str) -> Preempted | Interrupted:
    """What a stop signal ends the run with: `Preempted` (exit 75) when step `saved` was saved,
    else `Interrupted` (exit 128 + the signal). `spiked`: the sentence naming the checkpoint a
    restart resumes from, when the loss spiked (`saved` is then marked, not in latest.txt)."""
    ck = cfg.checkpoints
    if ck is None:
        return Interrupted(
            f"{signal_name} received: stopped after step {step}; no checkpoints section, so "
            "nothing was saved and a restart begins at step 1",
            signal.Signals[signal_name],
        )
    where = f"{ck.checkpoints_path}/{saved}"
    if spiked:
        where += (
            f" while the loss spiked, so it is marked and latest.txt does not name it ({spiked})"
        )
    again = ("Launch the same command to continue" if cfg.mesh3d.existing_checkpoints == "resume"
             else "To continue, launch the command again with mesh3d.existing_checkpoints=resume "
             f"(or checkpoints.resume_checkpoint_path={ck.checkpoints_path})")  # fmt: skip
    return Preempted(
        f"{signal_name} received: stopped after step {step} and saved {where}. {again}"
    )


def train(cfg, metrics_file: str | None = None, hooks: Sequence = ()) -> RunResult:
    """Train `cfg` on the current process group (started here if needed); rank-local result.
    `hooks`: opt-in observers of each step and of the end (`train/hooks.py`), or one of them.

    Example:

        result = mesh3d.train(mesh3d.load_config("cfg.yaml"))   # under torchrun
        [m["lm_loss"] for m in result.metrics]
    """
    hooks = (hooks,) if hasattr(hooks, "on_step") or hasattr(hooks, "on_end") else tuple(hooks)
    run = Run.start(cfg)
    cfg = run.cfg  # a fault-tolerant replica group's own (its checkpoint folder)
    with RunGuard(cfg, run.device) as guard:  # the folder first: a refusal builds no model
        run.build()
        n = run.n_params
        logger.info(f"Total number of parameters: {n} ({n * 4 / 2**20:.2f}MiB fp32)")
        error = None
        try:
            result = _train(run, guard, metrics_file, hooks)
        except BaseException as e:
            error = e
            raise
        finally:
            # a save in flight committed (or abandoned), then the uploads waited for on rank 0,
            # outside any collective; the guard's exit makes the ranks leave together
            guard.leave_wait_s = upload_wait_s(cfg, error)
            try:
                run.checkpoints.close(error, guard.leave_wait_s)
                report = run.checkpoints.report
                if isinstance(error, RunStopped) and report is not None:  # its one line says it
                    error.args = (f"{error.args[0]} (s3_upload: {report.line()})",)
            finally:
                run.feed.close()  # the loader's workers, if any
                if run.replicas is not None:
                    run.replicas.close()
        result.uploads = run.checkpoints.report
        return result


def upload_wait_s(cfg, error: BaseException | None) -> float:
    """How long world rank 0 waits for the uploads at the end: the checkpoint timeout after the
    last step, `mesh3d.upload_wait_on_stop_s` after a stop or an error (a launcher kills the
    ranks after its own grace time)."""
    if cfg.s3_upload is None:
        return 0.0
    m = cfg.mesh3d
    return m.checkpoint_timeout_s if error is None else m.upload_wait_on_stop_s


def start_notes(cfg, device: torch.device, start: int) -> list[str]:
    """The lines before the first step (how to read the iteration line, compiling); none when
    no step is left to run."""
    if start >= cfg.tokens.train_steps:
        return []
    notes = ["grad_norm in the iteration line is the global gradient norm before clipping"]
    if device.type == "cpu":
        notes.append(
            "on CPU: the iteration line's *_per_gpu items (Nanotron's names) are per process"
        )
    if cfg.mesh3d.compile:
        from mesh3d.parallel.compile import compile_notice

        notes.append(compile_notice())
    return notes


def _in_run_evaluation(cfg, metrics_file: str | None, checkpoints):
    """The `lighteval:` section's evaluation, checked on every rank alike (None without one)."""
    if cfg.lighteval is None:
        return None
    folder = Path(metrics_file or cfg.checkpoints.checkpoints_path).parent
    if cfg.mesh3d.eval_mode == "slurm_job":  # sbatch jobs submitted after commits, no pause
        return extensions.load("evaluation_jobs").attach(cfg, folder, checkpoints)
    with decided_alike():
        return extensions.load("evaluation_in_run").InRunEvaluation(cfg, folder)


def _train(run: Run, guard: RunGuard, metrics_file: str | None, hooks: Sequence) -> RunResult:
    """The step loop of `train`, inside the run's guard."""
    cfg, rank, world = run.cfg, dist.get_rank(), dist.get_world_size()
    tok, ck, gbs = cfg.tokens, cfg.checkpoints, run.layout.global_batch
    start, consumed, wandb_id = _resume(run, guard)
    run.data.resumed = (start, consumed)  # its data lines count samples as this line does
    tokens = run.data.tokens_through(start, consumed // start if start else gbs)
    logger.info(
        f"[Start training] mbs: {tok.micro_batch_size} | grad_accum: "
        f"{tok.batch_accumulation_per_replica} | global_batch_size: {gbs} | sequence_length: "
        f"{run.data.sequence_length_at(start + 1)} | train_steps: {tok.train_steps} | start_iteration_step: "
        f"{start + 1} | consumed_train_samples: {consumed}"
    )
    if start == tok.train_steps:
        logger.info(
            f"nothing to train: the checkpoint is at tokens.train_steps ({start}); raise "
            "tokens.train_steps to train on, or set mesh3d.existing_checkpoints=overwrite to "
            "start again from step 1"
        )
    for line in start_notes(cfg, run.device, start):
        logger.info(line)
    sinks = MetricSinks(cfg, rank == run.logger_rank, metrics_file, wandb_id, start_step=start)
    error, wandb_id = share((sinks.error, sinks.wandb_id), src=run.logger_rank)
    if error:  # a metrics path that cannot be written: every rank stops alike
        with decided_alike():
            raise UserError(error)
    peak = peak_tflops(
        torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else None
    )
    result, step_seconds = RunResult(start_step=start), []
    if guard.resume_path is None and ck is not None and ck.save_initial_state:
        result.saved_dir = Path(ck.checkpoints_path) / "0"  # `_resume` saved it
    on_step = [h.on_step for h in hooks if hasattr(h, "on_step")]
    metric_sources = run.step_metric_sources()
    evals = _in_run_evaluation(cfg, metrics_file, run.checkpoints)
    saved, step, replicas = start, start, run.replicas
    if replicas is not None:  # consumed samples count every group's slots (run.data.gbs)
        replicas.start_at(start, consumed, tokens)
    with step_profiler(cfg.profiler, rank) as profiler:
        while step < tok.train_steps:
            step += 1
            t0 = time.time()
            if replicas is not None:  # the quorum; a group behind heals and jumps ahead
                step, healed = replicas.begin(step)
                if healed is not None:
                    consumed, tokens = healed
                if step > tok.train_steps:
                    break
            guard.at(step, "step")
            out = run.step(step, guard.accepts)
            if not out.committed:  # a replica group failed during the step: train it again
                logger.warning(
                    f"[FT] step {step} was not applied (a replica group failed during it); "
                    "training it again with the groups alive now"
                )
                step -= 1
                continue
            loss, grad_norm = out.loss, out.grad_norm
            if cfg.mesh3d.compile and step == start + 1:
                from mesh3d.parallel.compile import compile_cache_text

                logger.info(compile_cache_text())
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            stop = guard.stop_requested()  # every rank ends the step together
            profiler.step()
            consumed += run.data.gbs
            seq = run.data.sequence_length_at(step)
            tokens += run.data.gbs * seq
            if replicas is not None:
                replicas.progress = (consumed, tokens)
            step_seconds.append(time.time() - t0)
            m = iteration_metrics(
                iteration=step, consumed_samples=consumed, seq_len=seq,
                elapsed_s=step_seconds[-1], global_batch_size=gbs, world_size=world,
                lm_loss=loss, lr=run.scheduler.get_last_lr()[0], step_flops=run.flops_at(step),
                grad_norm=grad_norm, peak=peak, consumed_tokens=tokens,
            )  # fmt: skip
            for source in metric_sources:  # every rank: collectives inside
                m.update(source())
            m.update(out.metrics)
            m.update(peak_memory())
            if step < 5 or (ck is not None and (step - 1) % ck.checkpoint_interval == 0):
                m.update(memory_metrics())  # Nanotron's extra items of the first steps
            if is_evaluation_step(tok, step):  # validation after the update; not in the step time
                guard.at(step, "validation")
                m.update(evaluate(run.parts, run.data.validation, run.layout, run.mesh, run.device))
            run.checkpoints.poll()  # a background save every rank finished writing is committed
            unusual = guard.verdict(loss, grad_norm) is not None  # non-finite, or a loss spike
            if unusual or guard.spikes is not None:  # committed before this step is judged: a
                run.checkpoints.finish()  # stop names it, the spike guard names or marks it
            try:  # skipped (counted), or the run stops; the waiting checkpoint named or marked
                guard.after_step(step, loss, grad_norm, run.checkpoints.name_latest)
            finally:
                m.update(guard.step_metrics())
                result.metrics.append(m)
                every = cfg.logging.iteration_step_info_interval  # and the last step, for the plot
                logged = (step - 1) % every == 0 or step == tok.train_steps
                sinks.progress(m, step_seconds)  # the compact console line, every step
                if unusual or logged or "val_loss" in m:
                    sinks.write(m, step_seconds)  # skipped and evaluation steps always shown
                for hook in on_step:
                    hook(run, step, out, m)
            if ck is not None and (step % ck.checkpoint_interval == 0 or stop):
                last = bool(stop) or step == tok.train_steps
                result.saved_dir = _save(run, guard, step, consumed, wandb_id, last_step=last)
                saved = step
                if evals is not None and not stop and step % evals.interval == 0:
                    guard.at(step, "evaluation")  # scores the checkpoint just saved
                    scores = evals.after_save(run, step)
                    if scores:
                        result.evals.append({"iteration": step, **scores})
                        sinks.scores(result.evals[-1])
            if stop:
                sinks.close()
                spiking = guard.spikes is not None and guard.spikes.spiking
                raise _stopped(stop, step, cfg, saved, guard.last_checkpoint() if spiking else "")
    final = ck is not None and ck.save_final_state and start < tok.train_steps
    if final and saved != tok.train_steps:
        result.saved_dir = _save(run, guard, tok.train_steps, consumed, wandb_id, last_step=True)
    run.checkpoints.finish()
    sinks.close()
    for hook in hooks:
        if hasattr(hook, "on_end"):
            hook.on_end(run, result)
    return result
