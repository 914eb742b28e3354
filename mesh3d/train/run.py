"""A prepared training run on this rank: what every step needs, built once, and the step.
`start` and `build` are two phases so that `train()` takes the checkpoints folder between
them (a refused one builds no model)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mesh3d import extensions
from mesh3d.checkpoint.manager import Checkpointer
from mesh3d.checkpoint.training import save_checkpoint
from mesh3d.checks import validate, warn_once
from mesh3d.data.build import StagedData
from mesh3d.data.loader import Feed
from mesh3d.errors import UserError, decided_alike
from mesh3d.layout import RunLayout
from mesh3d.log import setup_logging
from mesh3d.mesh import (
    build_mesh,
    collective_timeout,
    init_distributed,
    resolve_device,
    set_collective_timeout,
)
from mesh3d.train.build import ModelParts, build_model_parts
from mesh3d.train.optim import build_optimizer
from mesh3d.train.step import total_params, train_step


@dataclass
class StepOutput:
    """One step's result: this rank's microbatches, the loss and the grad norm."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss: float
    grad_norm: float
    committed: bool = True  # False: a fault-tolerant step a replica group's failure voided
    metrics: dict = field(default_factory=dict)  # the step's own items (DoReMi's weights)


@dataclass
class Run:
    """One rank's run (see the module doc). After `build()`, every field is set."""

    cfg: object
    data: StagedData
    device: torch.device
    layout: RunLayout
    mesh: DeviceMesh | None = None
    parts: ModelParts | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object = None
    logger_rank: int = 0  # the global rank that owns the metrics (last stage, dp 0, tp 0)
    n_params: int = 0
    checkpoints: Checkpointer | None = None  # every save's lifecycle (`build`)
    feed: Feed | None = None  # this rank's loader of each step's batches (`build`)
    share: object | None = None  # `stream_share.ReplicaShare` for streamed data (`build`)
    replicas: object | None = None  # `fault_tolerance.Replicas` (mesh3d.fault_tolerance)
    doremi: object | None = None  # `train/doremi.py::DoReMi` with a doremi: section (`build`)

    @classmethod
    def prepare(cls, cfg) -> Run:
        """`start` then `build`: a run ready to step."""
        return cls.start(cfg).build()

    @classmethod
    def start(cls, cfg) -> Run:
        """Validate, read the data, start the process group and the logging."""
        env_world = int(os.environ.get("WORLD_SIZE", 1))
        world = dist.get_world_size() if dist.is_initialized() else env_world
        with decided_alike():
            validate(cfg, world_size=world)  # before any process-group work: never a hang
            _check_sft_tokenizer(cfg)
            if cfg.doremi is not None:  # the domains sampled by their weights (docs/doremi.md)
                cfg = extensions.load("doremi").sampling_config(cfg)
            data_cfg = cfg
            if cfg.mesh3d.fault_tolerance is not None:  # a replica group's folder and data
                ft = extensions.load("fault_tolerance")
                cfg = ft.group_config(cfg)
                data_cfg = ft.data_config(cfg)
            data = StagedData(data_cfg)  # every stage's dataset checked before any collective
            device = resolve_device(cfg.mesh3d.device)
        if not dist.is_initialized():
            init_distributed(timeout_s=cfg.mesh3d.collective_timeout_s, device=cfg.mesh3d.device)
        layout = RunLayout.resolve(cfg, dist.get_world_size(), dist.get_rank())
        level = cfg.logging.log_level if dist.get_rank() == 0 else cfg.logging.log_level_replica
        setup_logging(layout.coords, level, cp=layout.dims.cp)  # `build` adds the metrics owner
        warn_once(cfg)  # rank 0, unless the launcher printed them
        return cls(cfg, data, device, layout)

    def build(self) -> Run:
        """The mesh, model parts, optimizer and LR schedule of a started run; returns it."""
        cfg, layout, dims = self.cfg, self.layout, self.layout.dims
        self.mesh = build_mesh(dims, self.device.type)
        set_collective_timeout(self.mesh, cfg.mesh3d.collective_timeout_s)  # sub-groups too
        torch.manual_seed(cfg.general.seed)
        build = (
            extensions.load("hf_parts").build_hf_parts if cfg.mesh3d.hf_model else build_model_parts
        )
        self.parts = build(cfg, layout, self.mesh, self.device)
        self.optimizer, self.scheduler = build_optimizer(
            self.parts.named_parameters(), cfg, layout, self.device
        )
        # the metrics owner logs at `log_level` like rank 0, so the iteration line shows even
        # when log_level_replica is quieter (Nanotron needs INFO there)
        owner = {"pp": self.parts.head_rank, "dp": 0, "cp": 0, "tp": 0}
        self.logger_rank = next(r for r in range(dims.world_size) if dims.coords(r) == owner)
        primary = dist.get_rank() in (0, self.logger_rank)
        level = cfg.logging.log_level if primary else cfg.logging.log_level_replica
        setup_logging(layout.coords, level, cp=dims.cp)
        self.n_params = total_params(self.parts, self.mesh)
        if cfg.doremi is not None:  # a proxy run builds its reference model here
            self.doremi = extensions.load("doremi").DoReMi(self)
        self.checkpoints = Checkpointer(cfg, self.mesh)
        slot, slots = layout.coords["dp"], dims.dp
        if cfg.mesh3d.fault_tolerance is not None:
            slot, slots = extensions.load("fault_tolerance").data_slot(cfg, slot, slots)
        self.feed = Feed(self.data, slot, slots, layout.microbatch_size,
                         timeout_s=cfg.mesh3d.collective_timeout_s,
                         pin=self.device.type == "cuda")  # fmt: skip
        if any(getattr(ds, "streamed", False) for ds in self.data.datasets):
            from mesh3d.train.stream_share import ReplicaShare, needs_share

            if needs_share(self.data, dims):
                self.share = ReplicaShare(dims, dist.get_rank())
        if cfg.mesh3d.fault_tolerance is not None:
            self.replicas = extensions.load("fault_tolerance").Replicas(self)
        return self

    def batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches of step `step`. Middle pipeline stages read nothing unless
        their attention needs the positions (document masking, context parallelism)."""
        parts, layout = self.parts, self.layout
        reads = parts.has_first or parts.has_last or layout.positions_everywhere
        if not self.feed.streams(step):
            return self.feed.batches(step) if reads else []
        from mesh3d.train.data_errors import agree_on_data_error

        batches, error = [], None
        share = self.share  # None: every reading rank reads (a replica of one rank)
        reader = share.reader if share is not None else reads
        try:  # a bad streamed row: one line on every rank, printed once (`data_errors.py`)
            batches = self.feed.batches(step) if reader else []
        except UserError as e:
            error = e
        agree_on_data_error(error, self.device)
        if share is not None:  # the replica's reader tokenized it; the others receive it
            seq = self.layout_at(step).sequence_length
            batches = share.share(batches, self.data.gbs // layout.dims.dp, seq,
                                  layout.microbatch_size)  # fmt: skip
        return batches if reads else []

    def layout_at(self, step: int) -> RunLayout:
        """The run's layout at the sequence length of the data stage active at step `step`."""
        seq = self.data.sequence_length_at(step)
        if seq == self.layout.sequence_length:
            return self.layout
        return replace(self.layout, sequence_length=seq)

    def flops_at(self, step: int) -> float:
        """Model FLOPs of step `step`, at the active stage's sequence length."""
        layout = self.layout_at(step)
        return layout.spec.step_flops(layout.shape, layout.sequence_length, layout.global_batch)

    def step_metric_sources(self) -> list[Callable[[], dict]]:
        """What optional parts add to every step's metrics, one call each, on every rank."""
        sources = []
        if self.layout.shape.moe_layers:
            sources.append(extensions.load("moe").step_metrics_of(self))
        if self.replicas is not None:
            sources.append(lambda: self.replicas.metrics(self.layout.global_batch))
        return sources

    def step(self, step: int, accepts=None) -> StepOutput:
        """Read step `step`'s batches and train on them (`accepts`: the loss-spike guard)."""
        if self.doremi is not None:  # domain losses; a proxy's weighted excess loss
            batches, loss, grad_norm, metrics = self.doremi.step(self, step, accepts)
            return StepOutput(batches, loss, grad_norm, metrics=metrics)
        batches = self.batches(step)
        if self.layout.shape.moe_layers:  # what validation forwards left
            extensions.load("moe").clear_stats(self.parts.modules, self.layout)
        loss, grad_norm = train_step(
            self.parts, self.optimizer, self.scheduler, batches, layout=self.layout_at(step),
            clip_grad=self.cfg.optimizer.clip_grad, mesh=self.mesh, device=self.device,
            accepts=accepts, step=step, across=self.replicas,
        )  # fmt: skip
        committed = self.replicas is None or self.replicas.committed
        return StepOutput(batches, loss, grad_norm, committed)

    def save(self, step: int, consumed: int, extra: dict | None = None,
             latest: bool = True, background: bool = False) -> None:  # fmt: skip
        """Save step `step` (`consumed`: samples so far; `latest`: whether latest.txt may name
        it). `background`: copy the state now and write it while training goes on;
        `checkpoints` (`checkpoint/manager.py`) commits it either way."""
        if self.cfg.checkpoints is None:
            raise UserError("Run.save needs a `checkpoints` section (checkpoints_path, "
                            "checkpoint_interval, ...) in the config; add one")  # fmt: skip
        c = self.layout.coords  # one rank per dp rank writes its stream position
        writes = c["pp"] == 0 and c["tp"] == 0 and c.get("cp", 0) == 0

        def write(background: bool):
            return save_checkpoint(
                self.cfg.checkpoints.checkpoints_path, step, self.cfg, self.parts,
                self.optimizer, self.scheduler, self.mesh, consumed, layout=self.layout,
                extra={**(extra or {}), **(self.doremi.metas() if self.doremi else {})},
                latest=latest, background=background,
                data_state=self.feed.data_state(step) if writes else None,
            )  # fmt: skip

        self.checkpoints.save(step, write, background)

    def load(self, path: Path) -> tuple[int, int, dict]:
        """Resume from the step folder `path`: (its step, consumed samples, its custom metas)."""
        from mesh3d.checkpoint.load import checkpoint_custom_metas, load_checkpoint, load_data_state

        cfg, ck = self.cfg, self.cfg.checkpoints
        m = cfg.mesh3d
        with collective_timeout(self.mesh, m.checkpoint_timeout_s, m.collective_timeout_s):
            start, consumed = load_checkpoint(
                path, self.parts, self.optimizer, self.scheduler, cfg, layout=self.layout,
                load_optimizer=ck.load_optimizer, load_lr_scheduler=ck.load_lr_scheduler,
            )  # fmt: skip
        self.feed.resume(start, load_data_state(path), str(path))  # a stream goes on, or refused
        custom = checkpoint_custom_metas(path) or {}
        if self.doremi is not None:
            self.doremi.resumed(custom)
        return start, consumed, custom

    def model(self) -> torch.nn.Module:
        """The model, or a ModuleList of this rank's pipeline stages."""
        modules = self.parts.modules
        return modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)


def _check_sft_tokenizer(cfg) -> None:
    """SFT from `init_method.path`: the tokenizer's ids within the checkpoint's vocabulary."""
    from mesh3d.config import ExistingCheckpointInit, SFTDatasetsArgs

    init = cfg.model.init_method
    tok = cfg.tokenizer.tokenizer_name_or_path if cfg.tokenizer else None
    sft = any(isinstance(s.data.dataset, SFTDatasetsArgs) for s in cfg.data_stages or [])
    if sft and isinstance(init, ExistingCheckpointInit) and tok and Path(tok).exists():
        extensions.load("hf_init").check_init_tokenizer(init.path, tok)
