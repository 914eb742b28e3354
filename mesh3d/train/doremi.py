"""DoReMi: domain weights tuned by a small proxy model against a reference (docs/doremi.md).

Nanotron's examples/doremi in three runs of one config with a `doremi:` section:

1. reference: an ordinary run on the domains (the folders of a Nanoset stage, or Nanotron's
   one saved dataset per domain under `hf_dataset_or_datasets`) sampled by `domain_weights`
   (null: the stage's `dataset_weights`, else the domains' sizes);
2. proxy (`ref_model_resume_checkpoint_path` set): the same model trained from scratch on
   uniformly sampled domains (or `domain_weights`), with the reference frozen beside it;
3. final: a reference-style run with `domain_weights` set to the proxy's average weights
   (`python -m mesh3d.train.doremi <proxy step folder>` prints the section to paste).

Each proxy step t, over the whole global batch (every microbatch, every dp rank):

    excess_d  = sum over the tokens of domain d of max(proxy loss - reference loss, 0)
                / tokens of domain d in the batch                (0 for a domain with none)
    a_t       = (1 - c) * softmax(log a_{t-1} + step_size * excess) + c / k   (c: smoothing_param)
    loss      = sum_d a_t[d] * excess_d                                         (a_t constant)

with Nanotron's constants (step_size 1.0, smoothing_param 1e-3), the paper's Algorithm 1. The
weights weigh the loss; they never change the sampling. Two choices differ from Nanotron's
example, for layout invariance: its weights come from one microbatch of one dp replica and
each step starts again from the initial weights (its context never keeps the update); here
they come from the global batch and carry over, as in the paper. So that a_t is known before
the backward, the step first runs the proxy and the reference forward only (no grad) over the
step's batches, then the usual training step (`train/step.py::train_step`) backpropagates the
loss above through the run's loss function (`StepLoss.instead`). The two extra forwards make
a proxy step about 5/3 of a plain one in FLOPs.

Layouts: every token's loss is computed on the last pipeline stage (vocab-parallel under tp:
each tp rank holds the same losses); the per-domain sums are added over pp (zeros off the
last stage) and dp in float64, so every rank updates the same weights: the weights at any
(dp, tp, pp) are one process's. Labels travel with their row number in an extra last column,
so the loss function finds each microbatch's reference losses and domains under any schedule.
The domain of each sample comes from the stage's blend index (`data/domains.py`).
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mesh3d.checkpoint.training import resolve_step_dir
from mesh3d.checks.doremi_checks import domain_names, domain_weights, sampling_weights
from mesh3d.config.schema import ExistingCheckpointInit, NanosetDatasetsArgs
from mesh3d.data.documents import IGNORE
from mesh3d.data.domains import check_domains, stage_domains
from mesh3d.errors import UserError
from mesh3d.log import logger
from mesh3d.mesh import groups_of
from mesh3d.parallel.pipeline import is_v_schedule, run_schedule
from mesh3d.parallel.pipeline_forward import forward_walk
from mesh3d.train.build import ModelParts, build_model_parts
from mesh3d.train.evaluate import _reshard
from mesh3d.train.loss import StepLoss
from mesh3d.train.step import _autocast, _loss_ctx, train_step
from mesh3d.train.vocab_parallel import _local_padding, _vocab_parallel, sharded_softmax

REF_KEY = "`doremi.ref_model_resume_checkpoint_path`"


def is_proxy(cfg) -> bool:
    return cfg.doremi is not None and cfg.doremi.ref_model_resume_checkpoint_path is not None


def sampling_config(cfg):
    """`cfg` with each Nanoset stage sampling its folders by the domain weights: `domain_weights`
    when given, uniform in a proxy run without them, else the stage's own (unchanged). A stage of
    per-domain datasets takes the same weights when it is built (`data/domain_datasets.py`)."""
    weights = sampling_weights(cfg)
    if weights is None:
        return cfg
    cfg = copy.deepcopy(cfg)
    for stage in cfg.data_stages or []:
        if isinstance(stage.data.dataset, NanosetDatasetsArgs):
            stage.data.dataset.dataset_weights = list(weights)
    return cfg


def update_weights(weights: torch.Tensor, excess: torch.Tensor, step_size: float,
                   smoothing: float) -> torch.Tensor:  # fmt: skip
    """One DoReMi update: (1 - c) * softmax(log w + step_size * excess) + c / k."""
    new = torch.softmax(weights.log() + step_size * excess, dim=0)
    return (1 - smoothing) * new + smoothing / len(weights)


class _TokenCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy [N] of vocab-sharded logits (this rank's columns start..,
    fp32 [N, W]): `train/vocab_parallel.py::_VocabParallelCrossEntropy` with one loss per row instead of
    their sum, so that each row's gradient can have its own weight."""

    @staticmethod
    def forward(ctx, logits, labels, group, start):
        probs, rows = sharded_softmax(logits, labels, group, start)
        ctx.start = start
        ctx.save_for_backward(probs, labels)
        return rows * (labels != IGNORE)

    @staticmethod
    def backward(ctx, grad):
        probs, labels = ctx.saved_tensors
        width = probs.shape[-1]
        local = labels - ctx.start
        g = grad * (labels != IGNORE)
        hit = (local >= 0) & (local < width)
        out = probs * g[:, None]
        out.scatter_add_(-1, local.clamp(0, width - 1)[:, None], -(hit * g)[:, None])
        return out, None, None, None


def token_losses(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B·S] fp32 cross-entropy of each token (0 where the label is IGNORE); logits [B, S, Vp],
    plain or vocab-sharded over tp (then the same on every tp rank)."""
    labels = labels.reshape(-1)
    if isinstance(logits, DTensor):
        sharded = _vocab_parallel(logits)
        if sharded is not None:
            group, start = sharded
            local = logits.to_local().float()
            if logits.shape[-1] > vocab_size:
                local = local + _local_padding(start, local.shape[-1], vocab_size, local.device)
            return _TokenCrossEntropy.apply(local.reshape(-1, local.shape[-1]), labels, group,
                                            start)  # fmt: skip
        logits = logits.full_tensor()
    flat = logits.float()[..., :vocab_size].reshape(-1, vocab_size)
    return F.cross_entropy(flat, labels, reduction="none", ignore_index=IGNORE)


def _tag(batches: list[tuple], mbs: int) -> list[tuple]:
    """Each microbatch's labels [mbs, S] with its rows' numbers as one more column [mbs, S+1]."""
    out = []
    for m, (inputs, labels, *rest) in enumerate(batches):
        rows = torch.arange(m * mbs, (m + 1) * mbs, dtype=labels.dtype)[:, None]
        out.append((inputs, torch.cat([labels, rows], dim=1), *rest))
    return out


class _Record:
    """A forward-only pass's loss function: each token's loss into `table` [rows, S]."""

    def __init__(self, table: torch.Tensor, vocab_size: int):
        self.table, self.vocab_size = table, vocab_size

    def __call__(self, logits: torch.Tensor, tagged: torch.Tensor) -> torch.Tensor:
        rows, labels = tagged[:, -1], tagged[:, :-1]
        self.table[rows] = token_losses(logits, labels, self.vocab_size).view(len(rows), -1)
        return torch.zeros((), device=self.table.device)


class _WeightedExcess:
    """The proxy's training loss function: sum over its tokens of coef[domain] * max(loss -
    reference, 0), times `scale` (the run's backward_scale); coef = weight / domain tokens."""

    def __init__(self, ref: torch.Tensor, domains: torch.Tensor, coef: torch.Tensor,
                 vocab_size: int, scale: float):  # fmt: skip
        self.ref, self.domains, self.coef = ref, domains, coef
        self.vocab_size, self.scale = vocab_size, scale

    def __call__(self, logits: torch.Tensor, tagged: torch.Tensor) -> torch.Tensor:
        rows, labels = tagged[:, -1], tagged[:, :-1]
        excess = token_losses(logits, labels, self.vocab_size) - self.ref[rows].reshape(-1)
        coef = self.coef[self.domains[rows]].repeat_interleave(labels.shape[1])
        return (coef * (excess.detach() > 0) * excess).sum() * self.scale


class _DomainSums:
    """A reference (or final) run's loss function: the run's own loss (`plain`, a `StepLoss`),
    with each token's loss, no gradient, added to its domain's sum in `sums` [k] (float64)."""

    def __init__(self, plain: StepLoss, sums: torch.Tensor, domains: torch.Tensor):
        self.plain, self.sums, self.domains = plain, sums, domains

    def __call__(self, logits: torch.Tensor, tagged: torch.Tensor) -> torch.Tensor:
        rows, labels = tagged[:, -1], tagged[:, :-1]
        with torch.no_grad():
            losses = token_losses(logits.detach(), labels, self.plain.vocab_size)
        self.sums.index_add_(0, self.domains[rows], losses.view(len(rows), -1).double().sum(1))
        return self.plain(logits, labels)


class DoReMi:
    """A run's DoReMi state: the domains and, in a proxy run, the reference model and the
    weights (`step` trains one proxy step; `metas`/`resumed` keep the weights in checkpoints)."""

    def __init__(self, run):
        d = run.cfg.doremi
        check_domains(run.data)  # every rank alike, before any collective of the run's own
        self.names = domain_names(d)
        self.step_size, self.smoothing = d.step_size, d.smoothing_param
        self.proxy = is_proxy(run.cfg)
        k = len(self.names)
        start = domain_weights(d) or [1.0 / k] * k
        self.weights = torch.tensor(start, dtype=torch.float64)
        self.weights /= self.weights.sum()
        self.weight_sum = torch.zeros(k, dtype=torch.float64)
        self.steps = 0
        self.ref: ModelParts | None = self._reference(run) if self.proxy else None

    def _reference(self, run) -> ModelParts:
        """The reference model at the run's layout, read from its step folder, frozen."""
        path = resolve_step_dir(run.cfg.doremi.ref_model_resume_checkpoint_path, REF_KEY)
        cfg = copy.copy(run.cfg)
        cfg.model = replace(cfg.model, init_method=ExistingCheckpointInit(str(path)))
        parts = build_model_parts(cfg, run.layout, run.mesh, run.device)
        for p in parts.parameters():
            p.requires_grad_(False)
        for m in parts.modules:
            m.eval()
        logger.info(f"[DoReMi] reference model from {path}, frozen")
        return parts

    def _forward_losses(self, parts: ModelParts, tagged: list[tuple], layout) -> torch.Tensor:
        """[rows, S] each token's loss under `parts`, forward only, in eval mode (no dropout,
        whatever the layout); zeros off the last stage."""
        rows, s = layout.microbatches * layout.microbatch_size, layout.sequence_length
        device = next(iter(parts.parameters())).device
        table = torch.zeros(rows, s, device=device)
        record = _Record(table, layout.vocab_size)
        modes = [m.training for m in parts.modules]
        for m in parts.modules:
            m.eval()
        try:
            self._forward(parts, tagged, layout, record, device)
        finally:
            for m, mode in zip(parts.modules, modes, strict=True):
                m.train(mode)
        return table

    def _forward(self, parts: ModelParts, tagged: list[tuple], layout, record, device) -> None:
        autocast, tp = layout.autocast_dtype, layout.dims.tp
        with torch.no_grad():
            if parts.schedule is None:
                for inputs, tags in tagged:
                    with _autocast(device, autocast):
                        logits = parts.modules[0](inputs.to(device))
                    with _loss_ctx(tp):
                        record(logits, tags.to(device))
                return
            inputs = torch.cat([b[0] for b in tagged]).to(device) if parts.has_first else None
            labels = torch.cat([b[1] for b in tagged]).to(device) if parts.has_last else None
            stages, schedule = parts.pipeline_at(layout.sequence_length)
            parts.loss_fn.instead = record
            try:
                with _autocast(device, autocast), _loss_ctx(tp):
                    if is_v_schedule(layout.schedule):
                        forward_walk(stages, layout.microbatches, inputs, labels, None,
                                     parts.loss_fn, layout.activation())  # fmt: skip
                    else:
                        run_schedule(schedule, stages, inputs, labels, forward_only=True)
            finally:
                parts.loss_fn.instead = None

    def _train(self, run, layout, tagged, loss_fn, step: int, accepts) -> tuple[float, float]:
        """`train_step` with `loss_fn` as the run's loss function for this step."""
        run.parts.loss_fn.instead = loss_fn
        try:
            return train_step(
                run.parts, run.optimizer, run.scheduler, tagged, layout=layout,
                clip_grad=run.cfg.optimizer.clip_grad, mesh=run.mesh, device=run.device,
                accepts=accepts, step=step,
            )  # fmt: skip
        finally:
            run.parts.loss_fn.instead = None

    def _sum(self, run, layout, sums: torch.Tensor) -> torch.Tensor:
        """`sums` added over pp (only the last stage has token losses) and dp, on the CPU."""
        g = groups_of(run.mesh)
        if layout.dims.pp > 1:
            dist.all_reduce(sums, group=g.pp)
        if layout.dims.dp > 1:
            dist.all_reduce(sums, group=g.dp)
        return sums.cpu()

    def step(self, run, step: int, accepts=None) -> tuple[list, float, float, dict]:
        """Train step `step`: (batches, loss, grad norm, metrics). A proxy trains on the weighted
        excess loss; a reference or final run on its usual loss, its domains' losses logged."""
        layout = run.layout_at(step)
        mbs, rows = layout.microbatch_size, layout.microbatches * layout.microbatch_size
        batches = run.batches(step)
        tagged = _tag(batches, mbs)
        domains = stage_domains(run.data, step)  # [GBS], the same on every rank
        first = layout.coords["dp"] * rows
        mine = domains[first : first + rows].to(run.device)  # this rank's rows
        samples = torch.bincount(domains, minlength=len(self.names))
        tokens = samples.double() * layout.sequence_length  # per domain, global
        train = self._proxy_step if self.proxy else self._reference_step
        loss, grad_norm, metrics = train(run, layout, step, accepts, tagged, mine, tokens)
        for i, name in enumerate(self.names):
            metrics[f"doremi/samples/{name}"] = int(samples[i])
        return batches, loss, grad_norm, metrics

    def _reference_step(self, run, layout, step, accepts, tagged, mine, tokens):
        """The run's own loss (a `StepLoss` like the run's), each domain's loss summed aside."""
        sums = torch.zeros(len(self.names), dtype=torch.float64, device=run.device)
        own = run.parts.loss_fn
        plain = StepLoss(own.vocab_size, layout.global_tokens, own.backward_scale, own.z_loss)
        loss_fn = _DomainSums(plain, sums, mine)
        loss, grad_norm = self._train(run, layout, tagged, loss_fn, step, accepts)
        per_domain = torch.where(
            tokens > 0, self._sum(run, layout, sums) / tokens.clamp_min(1), 0.0
        )
        return (
            loss,
            grad_norm,
            {f"doremi/loss/{n}": float(x) for n, x in zip(self.names, per_domain)},
        )

    def _proxy_step(self, run, layout, step, accepts, tagged, mine, tokens):
        """The weights updated from the step's excess losses, then the weighted excess loss."""
        ref = self._forward_losses(self.ref, tagged, layout)
        _reshard(self.ref.modules)
        proxy = self._forward_losses(run.parts, tagged, layout)
        sums = torch.zeros(3, len(self.names), dtype=torch.float64, device=run.device)
        if run.parts.has_last:  # (excess, proxy loss, reference loss) summed per domain
            per_row = torch.stack([(proxy - ref).clamp_min(0), proxy, ref]).double().sum(-1)
            sums.index_add_(1, mine, per_row)
        sums = self._sum(run, layout, sums)
        per_domain = torch.where(tokens > 0, sums / tokens.clamp_min(1), 0.0)
        self.weights = update_weights(self.weights, per_domain[0], self.step_size, self.smoothing)
        self.weight_sum += self.weights
        self.steps += 1
        coef = (self.weights / tokens.clamp_min(1)).float().to(run.device)
        excess = _WeightedExcess(ref, mine, coef, layout.vocab_size, layout.backward_scale)
        loss, grad_norm = self._train(run, layout, tagged, excess, step, accepts)
        metrics = {"doremi/ce_loss": float(sums[1].sum() / tokens.sum())}
        for i, name in enumerate(self.names):
            metrics[f"doremi/weight/{name}"] = float(self.weights[i])
            metrics[f"doremi/excess/{name}"] = float(per_domain[0, i])
            metrics[f"doremi/loss/{name}"] = float(per_domain[1, i])
        shown = ", ".join(f"{n}: {float(w):.5f}" for n, w in zip(self.names, self.weights))
        logger.info(f"[DoReMi] step {step} domain weights: {shown}")
        return loss, grad_norm, metrics

    def metas(self) -> dict:
        """What a checkpoint keeps (`custom_metas["doremi"]`): the weights and their sum."""
        if not self.proxy:
            return {}
        return {"doremi": {"domain_names": self.names, "domain_weights": self.weights.tolist(),
                           "weight_sum": self.weight_sum.tolist(), "steps": self.steps}}  # fmt: skip

    def resumed(self, custom: dict) -> None:
        """Continue the weights kept in a resumed proxy checkpoint's `custom_metas`."""
        saved = custom.get("doremi")
        if not self.proxy or saved is None:
            return
        if saved["domain_names"] != self.names:
            raise UserError(
                f"the checkpoint's DoReMi domains {saved['domain_names']} are not "
                f"`doremi.domain_names` {self.names}; resume with the same domains, in order"
            )
        self.weights = torch.tensor(saved["domain_weights"], dtype=torch.float64)
        self.weight_sum = torch.tensor(saved["weight_sum"], dtype=torch.float64)
        self.steps = int(saved["steps"])


def average_weights(path: str) -> tuple[list[str], list[float]]:
    """(domain names, the proxy's weights averaged over its steps) from a proxy step folder (or
    a checkpoints folder with latest.txt)."""
    from mesh3d.checkpoint.load import checkpoint_custom_metas

    custom = checkpoint_custom_metas(resolve_step_dir(path, "the proxy checkpoint")) or {}
    saved = custom.get("doremi")
    if not saved or not saved.get("steps"):
        raise UserError(f"{path} holds no DoReMi weights: give a step folder of a proxy run")
    avg = [w / saved["steps"] for w in saved["weight_sum"]]
    return saved["domain_names"], avg


def weights_yaml(names: list[str], weights: list[float]) -> str:
    """The `doremi:` section of the final run (weights rounded to 6 places, summing to 1)."""
    rounded = [round(w, 6) for w in weights]
    rounded[rounded.index(max(rounded))] += round(1.0 - sum(rounded), 6)
    return (f"doremi:\n  domain_names: {', '.join(names)}\n"
            f"  domain_weights: {', '.join(f'{w:.6f}' for w in rounded)}\n")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """`python -m mesh3d.train.doremi <proxy step folder>`: print the final run's section."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m mesh3d.train.doremi <proxy checkpoint step folder>", file=sys.stderr
        )
        raise SystemExit(2)
    try:
        names, avg = average_weights(args[0])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    assert math.isclose(sum(avg), 1.0, rel_tol=1e-6)
    print(weights_yaml(names, avg), end="")


if __name__ == "__main__":
    main()
