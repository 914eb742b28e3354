"""The training run: config -> mesh -> model -> optimizer -> data -> steps -> metrics.

`train(cfg)` is what `recipes/train.py` calls on every rank after torchrun started it, and what
tests call inside forked ranks. Every check that the config and the world size allow runs in
`validate()` before the first collective.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mesh3d.checkpoint.resume import load_checkpoint, save_checkpoint
from mesh3d.config import global_batch_size, padded_vocab_size, validate
from mesh3d.data.build import StagedData
from mesh3d.log import logger, setup_logging
from mesh3d.mesh import ParallelDims, build_mesh, init_distributed, resolve_device
from mesh3d.parallel.parallelize import dp_mode
from mesh3d.train.build import build_model_parts, param_and_compute_dtypes
from mesh3d.train.metrics import (
    JsonlWriter,
    format_iteration_line,
    iteration_metrics,
    llama_flops,
    memory_metrics,
)
from mesh3d.train.optim import build_optimizer
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


def train(cfg, metrics_file: str | None = None, keep_model: bool = False) -> RunResult:
    """Train `cfg` on the current process group (started here if needed); rank-local result."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    validate(cfg, world_size=world)  # before any process-group work: a bad config never hangs
    data = StagedData(cfg)  # every stage's dataset checked before the first collective too
    device = resolve_device(cfg.mesh3d.device)
    if not dist.is_initialized():
        init_distributed(device=cfg.mesh3d.device)
    p = cfg.parallelism
    dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp)
    rank = dist.get_rank()
    coords = dims.coords(rank)
    mesh = build_mesh(dims, device.type)
    torch.manual_seed(cfg.general.seed)

    mode = dp_mode(cfg.optimizer.zero_stage, cfg.mesh3d.full_shard)
    parts = build_model_parts(cfg, mesh, device, dp_scale=dims.dp if mode != "replicate" else 1)
    _, autocast_dtype = param_and_compute_dtypes(cfg)
    optimizer, scheduler = build_optimizer(parts.named_parameters(), cfg, device)
    # the metrics owner (pp = last stage, dp 0, tp 0) logs at `log_level` like rank 0, so the
    # iteration line shows even when log_level_replica is quieter (Nanotron needs INFO there)
    is_logger_rank = coords == {"pp": parts.head_rank, "dp": 0, "tp": 0}
    primary = rank == 0 or is_logger_rank
    setup_logging(coords, cfg.logging.log_level if primary else cfg.logging.log_level_replica)
    n_params = total_params(parts, mesh)
    logger.info(f"Total number of parameters: {n_params} ({n_params * 4 / 2**20:.2f}MiB fp32)")

    mc, tok = cfg.model.model_config, cfg.tokens
    gbs = global_batch_size(cfg)
    step_flops = llama_flops(
        mc.num_hidden_layers,
        mc.hidden_size,
        mc.num_attention_heads,
        mc.num_key_value_heads or mc.num_attention_heads,
        mc.intermediate_size,
        padded_vocab_size(cfg),
        tok.sequence_length,
        gbs,
    )
    writer = JsonlWriter(metrics_file) if metrics_file and is_logger_rank else None
    logger.info(
        f"[Start training] mbs: {tok.micro_batch_size} | grad_accum: "
        f"{tok.batch_accumulation_per_replica} | global_batch_size: {gbs} | sequence_length: "
        f"{tok.sequence_length} | train_steps: {tok.train_steps} | start_iteration_step: 1"
    )
    result = RunResult()
    ck = cfg.checkpoints
    start, consumed = 0, 0
    if ck is not None and ck.resume_checkpoint_path is not None:
        start, consumed = load_checkpoint(
            ck.resume_checkpoint_path, parts, optimizer, scheduler, cfg,
            load_optimizer=ck.load_optimizer, load_lr_scheduler=ck.load_lr_scheduler,
        )  # fmt: skip
        logger.info(f"Resumed from {ck.resume_checkpoint_path} at step {start}")
    elif ck is not None and ck.save_initial_state:
        save_checkpoint(ck.checkpoints_path, 0, cfg, parts, optimizer, scheduler, mesh, 0)
    fail_at = _fault_injection(rank)
    for step in range(start + 1, tok.train_steps + 1):
        t0 = time.time()
        if step == fail_at:
            raise RuntimeError(f"MESH3D_FAIL_AT: injected failure on rank {rank} at step {step}")
        # middle pipeline stages take activations, not tokens: they read no data
        reads = parts.has_first or parts.has_last
        batches = data.batches(step, coords["dp"], dims.dp, tok.micro_batch_size) if reads else []
        result.batch_hashes.append(batch_hash(batches))
        loss, grad_norm = train_step(
            parts,
            optimizer,
            scheduler,
            batches,
            vocab_size=mc.vocab_size,
            global_tokens=gbs * tok.sequence_length,
            clip_grad=cfg.optimizer.clip_grad,
            mesh=mesh,
            dp_mode=mode,
            autocast_dtype=autocast_dtype,
            device=device,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()
        consumed += gbs
        m = iteration_metrics(
            iteration=step,
            consumed_samples=consumed,
            seq_len=tok.sequence_length,
            elapsed_s=time.time() - t0,
            global_batch_size=gbs,
            world_size=world,
            lm_loss=loss,
            lr=scheduler.get_last_lr()[0],
            step_flops=step_flops,
            grad_norm=grad_norm,
        )
        result.metrics.append(m)
        if is_logger_rank and (step - 1) % cfg.logging.iteration_step_info_interval == 0:
            extra = memory_metrics() if step < 5 else {}
            logger.info(format_iteration_line({**m, **extra}, tok.train_steps))
            if writer:
                writer.write(m)
        if ck is not None and step % ck.checkpoint_interval == 0:
            save_checkpoint(
                ck.checkpoints_path, step, cfg, parts, optimizer, scheduler, mesh, consumed
            )
    if ck is not None and ck.save_final_state and tok.train_steps % ck.checkpoint_interval:
        save_checkpoint(
            ck.checkpoints_path, tok.train_steps, cfg, parts, optimizer, scheduler, mesh, consumed
        )
    if writer:
        writer.close()
    if keep_model:
        model = parts.modules[0] if len(parts.modules) == 1 else torch.nn.ModuleList(parts.modules)
        result.model, result.optimizer, result.mesh = model, optimizer, mesh
    return result
