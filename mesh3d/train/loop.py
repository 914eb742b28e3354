"""The training run: config -> mesh -> model -> optimizer -> data -> steps -> metrics.

`train(cfg)` is what `recipes/train.py` calls on every rank after torchrun started it, and what
tests call inside forked ranks. Every check that the config and the world size allow runs in
`validate()` before the first collective.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mesh3d.checkpoint.training import (
    checkpoint_custom_metas,
    load_checkpoint,
    save_checkpoint,
)
from mesh3d.checks import validate
from mesh3d.data.build import StagedData
from mesh3d.errors import Interrupted, Preempted, UserError
from mesh3d.layout import RunLayout
from mesh3d.log import logger, setup_logging
from mesh3d.mesh import (
    build_mesh,
    collective_timeout,
    init_distributed,
    replica_mesh,
    resolve_device,
    set_collective_timeout,
)
from mesh3d.parallel.parallelize import compile_cache_text
from mesh3d.train.build import build_model_parts
from mesh3d.train.evaluate import evaluate, is_evaluation_step
from mesh3d.train.experts import clear_stats
from mesh3d.train.experts import step_metrics as moe_step_metrics
from mesh3d.train.guard import RunGuard, share
from mesh3d.train.metrics import (
    iteration_metrics,
    memory_metrics,
    peak_memory,
    peak_tflops,
)
from mesh3d.train.optim import build_optimizer
from mesh3d.train.profiling import step_profiler
from mesh3d.train.sinks import MetricSinks
from mesh3d.train.step import total_params, train_step


@dataclass
class RunResult:
    """What a run returns to its caller (tests, benchmarks): one metrics dict per step."""

    metrics: list[dict] = field(default_factory=list)
    model: torch.nn.Module | None = None  # the model, or a ModuleList of this rank's stages
    optimizer: torch.optim.Optimizer | None = None
    mesh: DeviceMesh | None = None
    batch_hashes: list[str] = field(default_factory=list)  # this rank's input tokens, per step


def batch_hash(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """A short digest of a step's microbatches (inputs and labels), to compare runs."""
    h = hashlib.sha1()
    for inputs, labels in batches:
        h.update(inputs.numpy().tobytes())
        h.update(labels.numpy().tobytes())
    return h.hexdigest()[:16]


def _fault_injection(rank: int) -> int | None:
    """`MESH3D_FAIL_AT=RANK:STEP` makes that rank raise at that step (tests the no-hang path)."""
    spec = os.environ.get("MESH3D_FAIL_AT")
    if not spec:
        return None
    r, s = (int(x) for x in spec.split(":"))
    return s if r == rank else None


@dataclass
class _Run:
    """What the step loop needs, built once by `_setup`."""

    cfg: object
    data: StagedData
    device: torch.device
    layout: RunLayout
    mesh: DeviceMesh
    parts: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    logger_rank: int
    step_flops: float = 0.0
    n_params: int = 0


def _setup(cfg) -> _Run:
    """Validate, read the data, start the process group, build model, optimizer, schedule."""
    return _build(cfg, *_start(cfg))


def _start(cfg) -> tuple[StagedData, torch.device, RunLayout]:
    """Validate, read the data, start the process group and the logging: (data, device,
    layout). A mistake found here is the same on every rank (printed once, by rank 0)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    try:
        validate(cfg, world_size=world)  # before any process-group work: a bad config never hangs
        data = StagedData(cfg)  # every stage's dataset checked before the first collective too
        device = resolve_device(cfg.mesh3d.device)
    except UserError as e:
        e.same_on_every_rank = True
        raise
    if not dist.is_initialized():
        init_distributed(timeout_s=cfg.mesh3d.collective_timeout_s, device=cfg.mesh3d.device)
    layout = RunLayout.resolve(cfg, dist.get_world_size(), dist.get_rank())
    level = cfg.logging.log_level if dist.get_rank() == 0 else cfg.logging.log_level_replica
    setup_logging(layout.coords, level, cp=layout.dims.cp)  # `_build` adds the metrics owner
    return data, device, layout


def _build(cfg, data: StagedData, device: torch.device, layout: RunLayout) -> _Run:
    """The mesh, model parts, optimizer and schedule of a started process group."""
    timeout_s = cfg.mesh3d.collective_timeout_s
    dims = layout.dims
    mesh = build_mesh(dims, device.type)
    set_collective_timeout(mesh, timeout_s)  # the mesh's sub-groups too (torch: 30 min)
    torch.manual_seed(cfg.general.seed)
    parts = build_model_parts(cfg, layout, mesh, device)
    optimizer, scheduler = build_optimizer(parts.named_parameters(), cfg, device)
    # the metrics owner (pp = last stage, dp 0, tp 0) logs at `log_level` like rank 0, so the
    # iteration line shows even when log_level_replica is quieter (Nanotron needs INFO there)
    owner = {"pp": parts.head_rank, "dp": 0, "cp": 0, "tp": 0}
    logger_rank = next(r for r in range(dims.world_size) if dims.coords(r) == owner)
    primary = dist.get_rank() in (0, logger_rank)
    level = cfg.logging.log_level if primary else cfg.logging.log_level_replica
    setup_logging(layout.coords, level, cp=dims.cp)
    step_flops = layout.spec.step_flops(layout.shape, layout.sequence_length, layout.global_batch)
    return _Run(cfg, data, device, layout, mesh, parts, optimizer, scheduler, logger_rank,
                step_flops)  # fmt: skip


def _run_step(run: _Run, step: int, accepts=None) -> tuple[list, float, float]:
    """Read step `step`'s batches and train on them: (batches, loss, grad norm).

    The whole per-step work of `train()` but its timing and metrics; benchmarks/throughput.py
    drives it directly to interleave mesh3d's steps with other training loops.
    """
    cfg, tok = run.cfg, run.cfg.tokens
    # middle pipeline stages take activations, not tokens: they read no data, unless their
    # attention needs the positions (document masking, context parallelism)
    reads = run.parts.has_first or run.parts.has_last or run.layout.positions_everywhere
    dp_rank, dp = run.layout.coords["dp"], run.layout.dims.dp
    batches = run.data.batches(step, dp_rank, dp, tok.micro_batch_size) if reads else []
    if run.layout.shape.moe_layers:
        clear_stats(run.parts.modules, run.layout)  # what validation forwards left
    loss, grad_norm = train_step(
        run.parts, run.optimizer, run.scheduler, batches, layout=run.layout,
        clip_grad=cfg.optimizer.clip_grad, mesh=run.mesh, device=run.device, accepts=accepts,
    )  # fmt: skip
    return batches, loss, grad_norm


def _resume(run: _Run, guard: RunGuard) -> tuple[int, int, str | None]:
    """(last step, consumed samples, W&B run id) from where `guard` decided the run starts."""
    cfg, ck = run.cfg, run.cfg.checkpoints
    if guard.resume_path is None:
        guard.clear_stale_steps()
        if ck is not None and ck.save_initial_state:
            _save(run, guard, 0, 0, None)
        return 0, 0, None
    guard.at(0, "load")
    with collective_timeout(
        run.mesh, cfg.mesh3d.checkpoint_timeout_s, cfg.mesh3d.collective_timeout_s
    ):
        start, consumed = load_checkpoint(
            guard.resume_path, run.parts, run.optimizer, run.scheduler, cfg, layout=run.layout,
            load_optimizer=ck.load_optimizer, load_lr_scheduler=ck.load_lr_scheduler,
        )  # fmt: skip
    custom = checkpoint_custom_metas(guard.resume_path) or {}
    if start > cfg.tokens.train_steps:
        raise UserError(
            f"checkpoint {guard.resume_path} is at step {start}, past tokens.train_steps "
            f"({cfg.tokens.train_steps}): nothing to train. Raise tokens.train_steps to train on"
        )
    guard.clear_stale_steps()  # overwrite: only now that the checkpoint loaded
    logger.info(f"Resumed from {guard.resume_path} at step {start}")
    guard.resumed(custom)
    wandb_id = custom.get("wandb_id")
    return start, consumed, wandb_id if ck.load_lr_scheduler else None


def _save(run: _Run, guard: RunGuard, step: int, consumed: int, wandb_id: str | None,
          last_step: bool = False) -> None:  # fmt: skip
    """Save step `step`; `last_step`: no step follows (the end, or a stop signal)."""
    ck = run.cfg.checkpoints
    extra = {"wandb_id": wandb_id} if wandb_id else {}
    extra.update(guard.checkpoint_metas())
    guard.check_folder_owner(step)
    guard.at(step, "save")
    latest = guard.names_latest(Path(ck.checkpoints_path) / str(step), last_step)
    save_checkpoint(ck.checkpoints_path, step, run.cfg, run.parts, run.optimizer, run.scheduler,
                    run.mesh, consumed, layout=run.layout, extra=extra, latest=latest)  # fmt: skip


def _stopped(signal_name: str, step: int, ck, saved: int, spiked: str) -> Preempted | Interrupted:
    """What a stop signal ends the run with: `Preempted` (exit 75) when step `saved` was saved,
    else `Interrupted` (exit 128 + the signal): no exit code claims a save that did not happen.
    `spiked`: the sentence naming the checkpoint a restart resumes from, when the loss spiked
    (`saved` is then marked and not in latest.txt)."""
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
    return Preempted(
        f"{signal_name} received: stopped after step {step} and saved "
        f"{where}. Launch the same command to continue (with "
        f"checkpoints.resume_checkpoint_path={ck.checkpoints_path} or "
        "mesh3d.existing_checkpoints=resume)"
    )


def train(cfg, metrics_file: str | None = None, keep_model: bool = False) -> RunResult:
    """Train `cfg` on the current process group (started here if needed); rank-local result.

    Example:

        result = mesh3d.train(mesh3d.load_config("cfg.yaml"))   # under torchrun
        [m["lm_loss"] for m in result.metrics]
    """
    data, device, layout = _start(cfg)
    with RunGuard(cfg, device) as guard:  # the folder first: a refusal builds no model
        run = _build(cfg, data, device, layout)
        run.n_params = total_params(run.parts, run.mesh)
        n = run.n_params
        logger.info(f"Total number of parameters: {n} ({n * 4 / 2**20:.2f}MiB fp32)")
        return _train(run, guard, metrics_file, keep_model)


def _train(run: _Run, guard: RunGuard, metrics_file: str | None, keep_model: bool) -> RunResult:
    """The step loop of `train`, inside the run's guard."""
    cfg, parts, rank, world = run.cfg, run.parts, dist.get_rank(), dist.get_world_size()
    tok, ck, gbs = cfg.tokens, cfg.checkpoints, run.layout.global_batch
    start, consumed, wandb_id = _resume(run, guard)
    run.data.resumed = (start, consumed)  # its data lines count samples as this line does
    logger.info(
        f"[Start training] mbs: {tok.micro_batch_size} | grad_accum: "
        f"{tok.batch_accumulation_per_replica} | global_batch_size: {gbs} | sequence_length: "
        f"{tok.sequence_length} | train_steps: {tok.train_steps} | start_iteration_step: "
        f"{start + 1} | consumed_train_samples: {consumed}"
    )
    if start == tok.train_steps:
        logger.info(f"nothing to train: the checkpoint is at tokens.train_steps ({start})")
    logger.info("grad_norm in the iteration line is the global gradient norm before clipping")
    sinks = MetricSinks(cfg, rank == run.logger_rank, metrics_file, wandb_id, start_step=start)
    wandb_id = share(sinks.wandb_id, src=run.logger_rank)
    peak = peak_tflops(
        torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else None
    )
    result, step_seconds = RunResult(), []
    fail_at = _fault_injection(rank)
    saved = start
    with step_profiler(cfg.profiler, rank) as profiler:
        for step in range(start + 1, tok.train_steps + 1):
            t0 = time.time()
            guard.at(step, "step")
            if step == fail_at:
                raise RuntimeError(
                    f"MESH3D_FAIL_AT: injected failure on rank {rank} at step {step}"
                )
            batches, loss, grad_norm = _run_step(run, step, guard.accepts)
            if cfg.mesh3d.compile and step == start + 1:
                logger.info(compile_cache_text())
            result.batch_hashes.append(batch_hash(batches))
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            stop = guard.stop_requested()  # every rank ends the step together
            profiler.step()
            consumed += gbs
            step_seconds.append(time.time() - t0)
            m = iteration_metrics(
                iteration=step, consumed_samples=consumed, seq_len=tok.sequence_length,
                elapsed_s=step_seconds[-1], global_batch_size=gbs, world_size=world,
                lm_loss=loss, lr=run.scheduler.get_last_lr()[0], step_flops=run.step_flops,
                grad_norm=grad_norm, peak=peak,
            )  # fmt: skip
            if run.layout.shape.moe_layers:  # every rank: collectives inside
                tp_group = run.mesh["tp"].get_group() if run.layout.sequence_parallel else None
                m.update(moe_step_metrics(run.parts.modules, run.layout, replica_mesh(run.mesh).get_group(),
                                          run.mesh["pp"].get_group(), run.device, tp_group))  # fmt: skip
            m.update(peak_memory())
            if step < 5 or (ck is not None and (step - 1) % ck.checkpoint_interval == 0):
                m.update(memory_metrics())  # Nanotron's extra items of the first steps
            if is_evaluation_step(tok, step):  # validation after the update; not in the step time
                guard.at(step, "validation")
                m.update(evaluate(run.parts, run.data.validation, run.layout, run.mesh, run.device))
            unusual = not (math.isfinite(loss) and math.isfinite(grad_norm))
            unusual = unusual or not guard.accepts(loss, grad_norm)  # a loss spike
            try:
                guard.check_finite(step, loss, grad_norm)  # skips (counted) or stops the run
                guard.check_spike(step, loss, grad_norm)  # the same for a loss spike
            finally:
                m.update(guard.step_metrics())
                result.metrics.append(m)
                logged = (step - 1) % cfg.logging.iteration_step_info_interval == 0
                if unusual or logged or "val_loss" in m:
                    sinks.write(m, step_seconds)  # skipped and evaluation steps always shown
            if ck is not None and (step % ck.checkpoint_interval == 0 or stop):
                last = bool(stop) or step == tok.train_steps
                _save(run, guard, step, consumed, wandb_id, last_step=last)
                saved = step
            if stop:
                sinks.close()
                spiking = guard.spikes is not None and guard.spikes.spiking
                raise _stopped(stop, step, ck, saved, guard.last_checkpoint() if spiking else "")
    if (
        ck is not None
        and ck.save_final_state
        and saved != tok.train_steps
        and start < tok.train_steps
    ):
        _save(run, guard, tok.train_steps, consumed, wandb_id, last_step=True)
    sinks.close()
    if keep_model:
        model = parts.modules[0] if len(parts.modules) == 1 else torch.nn.ModuleList(parts.modules)
        result.model, result.optimizer, result.mesh = model, run.optimizer, run.mesh
    return result
