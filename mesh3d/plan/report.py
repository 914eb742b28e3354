"""`format_plan`: the plan as a text report with aligned tables (what `mesh3d plan` prints)."""

from __future__ import annotations

from mesh3d.plan.records import DryRun, Plan, RankPlan


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for x in xs:
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


GPU_MEMORY_GIB = {  # --gpu-memory by name: the memory of one device, GiB
    "A100-40GB": 40, "A100": 80, "A100-80GB": 80, "H100": 80, "H100-80GB": 80, "H800": 80,
    "H200": 141, "B200": 180, "L4": 24, "L40S": 48, "A10": 24, "V100": 32, "MI300X": 192,
}  # fmt: skip
GROUPS_SHOWN = 3  # groups printed before `...` and the last one, on an axis with many


def _group(g: list[int]) -> str:
    """[0, 64, 128, ..., 448] -> '[0, 64, ..., 448]' when evenly spaced and long."""
    if len(g) > 4 and len({b - a for a, b in zip(g, g[1:])}) == 1:
        return f"[{g[0]}-{g[-1]}]" if g[1] - g[0] == 1 else f"[{g[0]}, {g[1]}, ..., {g[-1]}]"
    return "[" + ", ".join(map(str, g)) + "]"


def groups_line(groups: list[list[int]], width: int = 100) -> str:
    """An axis's groups as `[0, 1] [2, 3]`; past `width` characters abbreviated: the first
    GROUPS_SHOWN, `...`, the last, and how many of what size."""
    full = " ".join(map(str, groups))
    if len(full) <= width:
        return full
    shown = [*groups[:GROUPS_SHOWN], None, groups[-1]] if len(groups) > GROUPS_SHOWN + 1 else groups
    text = " ".join("..." if g is None else _group(g) for g in shown)
    return f"{len(groups)} groups of {len(groups[0])}: {text}"


def gpu_memory_gib(value: str) -> float:
    """`--gpu-memory`: a number of GiB or a device name of `GPU_MEMORY_GIB`."""
    try:
        return float(value)
    except ValueError:
        pass
    key = value.upper().replace("_", "-")
    if key not in GPU_MEMORY_GIB:
        from mesh3d.errors import UserError

        raise UserError(
            f"--gpu-memory {value!r} is neither a number of GiB nor a known device; use a number "
            f"(e.g. --gpu-memory 80) or one of {', '.join(GPU_MEMORY_GIB)}"
        )
    return float(GPU_MEMORY_GIB[key])


def fit_line(plan: Plan, gib: float | None) -> str:
    """Whether the largest per-rank peak fits in `gib` GiB per device (None: how to ask)."""
    worst = max(plan.ranks, key=lambda r: r.peak_bytes)
    peak = f"largest peak {_size(worst.peak_bytes)} (rank {worst.rank})"
    if gib is None:
        return f"  {peak}; pass --gpu-memory GiB (or a name, e.g. H100) to check that it fits"
    if worst.peak_bytes <= gib * 2**30:
        return f"  fits: {peak} <= {gib:g} GiB per device ({worst.peak_bytes / 2**30 / gib:.0%})"
    over = [r.rank for r in plan.ranks if r.peak_bytes > gib * 2**30]
    return (
        f"  DOES NOT FIT: {peak} > {gib:g} GiB per device, on ranks {_ranges(over)}; raise tp, "
        "pp or dp with zero_stage 1, lower micro_batch_size, or recompute layers"
    )


def _table(head: list[str], rows: list[list[str]], left: int) -> list[str]:
    """Cells padded to their column's width: the first `left` columns left, the rest right."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        padded = (
            x.ljust(w) if i < left else x.rjust(w) for i, (x, w) in enumerate(zip(cells, widths))
        )
        return "  " + "  ".join(padded).rstrip()

    return [line(head), *map(line, rows)]


def _by_value(plan: Plan, key) -> dict[tuple, list[RankPlan]]:
    """Ranks grouped by `key(rank)`, in rank order: identical rows print once."""
    groups: dict[tuple, list[RankPlan]] = {}
    for r in plan.ranks:
        groups.setdefault(key(r), []).append(r)
    return groups


def _moe_line(plan: Plan) -> list[str]:
    """Total against active parameters per token, with experts; nothing without."""
    if not plan.moe:
        return []
    share = plan.active_params / plan.total_params
    return [f"  mixture of experts: {plan.moe}; {plan.active_params:,} parameters active per "
            f"token of {plan.total_params:,} ({share:.1%})"]  # fmt: skip


def _lora_line(plan: Plan) -> list[str]:
    if not plan.trainable_params or plan.trainable_params == plan.total_params:
        return []
    share = plan.trainable_params / plan.total_params
    return [f"  LoRA (mesh3d.lora): {plan.trainable_params:,} adapter parameters train "
            f"({share:.2%} of the model's); the base is frozen: no gradient, no optimizer "
            "state"]  # fmt: skip


def format_plan(plan: Plan, gpu_memory: float | None = None) -> str:
    """The plan as a text report with aligned tables; `gpu_memory` GiB per device: whether the
    peaks fit."""
    d, b = plan.dims, plan.bubble
    cp = d.get("cp", 1)
    axes = ("tp", "cp", "pp", "dp") if cp > 1 else ("tp", "pp", "dp")  # cp shown when on
    mesh = " x ".join(f"{a} {d[a]}" for a in ("pp", "dp", "cp", "tp") if a in axes)
    split = f", {plan.sequence_length // cp} on each cp rank" if cp > 1 else ""
    out = [
        f"mesh3d plan: {plan.world_size} ranks = {mesh}; "
        f"{plan.total_params:,} parameters (vocab padded to {plan.padded_vocab}, tied "
        f"{plan.tied_embeddings})",
        *_moe_line(plan),
        *_lora_line(plan),
        f"  per dp rank and step: {plan.microbatches} microbatch(es) of {plan.micro_batch_size} x "
        f"{plan.sequence_length} tokens{split}; params {plan.param_dtype}, compute "
        f"{plan.compute_dtype}, {plan.optimizer}; dp {plan.dp_mode}, tp {plan.tp_mode}, "
        f"recompute {plan.recompute_layer}",
        "",
        "1. Rank groups",
        *(f"  {a}: " + groups_line(plan.groups[a]) for a in axes),
        *(
            f"  {a.replace('_', ' ')}: " + groups_line(plan.groups[a])
            for a in ("ep", "expert_replicas")
            if a in plan.groups
        ),
        "",
        f"2. Pipeline stages ({plan.schedule}, {plan.virtual_stages} per pp rank)",
    ]
    rows = [[str(s.stage), str(s.pp_rank), _ranges(s.layers) or "-",
             ", ".join(x for x, on in (("embedding", s.embedding), ("norm, lm_head", s.head)) if on)
             or "-"]
            for s in plan.stages]  # fmt: skip
    out += _table(["stage", "pp rank", "decoder layers", "also"], rows, left=4)
    out += ["", "3. Memory per rank (grads at the optimizer step; peak: every term at once)"]
    keys = ("stages", "param_elements", "param_bytes", "grad_bytes", "optimizer_bytes",
            "activation_bytes", "microbatches_in_flight", "transient", "peak_bytes")  # fmt: skip
    groups = _by_value(plan, lambda r: tuple(str(getattr(r, k)) for k in keys))
    rows = [[_ranges([r.rank for r in g]), ",".join(map(str, g[0].stages)),
             f"{g[0].param_elements:,}", *(_size(getattr(g[0], k)) for k in keys[2:6]),
             str(g[0].microbatches_in_flight), _size(sum(g[0].transient.values())),
             _size(g[0].peak_bytes)] for g in groups.values()]  # fmt: skip
    head = ["ranks", "stages", "params", "param B", "grad B", "optim B", "activations",
            "in flight", "transient", "peak"]  # fmt: skip
    out += _table(head, rows, left=2)
    out.append(fit_line(plan, gpu_memory))
    for g in groups.values():
        if g[0].transient:
            items = ", ".join(f"{k} {_size(v)}" for k, v in g[0].transient.items())
            out.append(f"  transient, ranks {_ranges([r.rank for r in g])}: {items}")
    out += ["", "4. Activations per microbatch (stage_activation_bytes)"]
    rows = [[str(s.stage), _size(s.saved_per_microbatch), _size(s.held_per_microbatch)]
            for s in plan.stages]  # fmt: skip
    out += _table(["stage", "saved for backward", "held output"], rows, left=1)
    out.append(f"  in flight from {plan.order_source}")
    value = "n/a" if b.fraction is None else f"{b.fraction:.1%}"
    out += ["", f"5. Pipeline bubble: {value} ({b.kind}: {b.formula})", ""]
    out.append(
        "6. Communication per step (payload: full tensor, or a bucket's mean; sent: by this "
        "rank, ring)"
    )
    groups = _by_value(plan, lambda r: tuple(map(str, r.comm))).values()
    if not any(r.comm for r in plan.ranks):
        groups = []
        out.append("  none: nothing is sent between ranks in this layout")
    for g in groups:
        axes_sent = (*axes, "ep") if "ep" in plan.groups else axes
        sent = {a: sum(c.sent_bytes for c in g[0].comm if c.axis == a) for a in axes_sent}
        totals = ", ".join(f"{a} {_size(v)}" for a, v in sent.items())
        out.append(f"  ranks {_ranges([r.rank for r in g])} send {totals}")
        rows = [[c.axis, c.what, c.collective, str(c.count), _size(c.bytes_each),
                 _size(c.sent_bytes)] for c in g[0].comm]  # fmt: skip
        out += _table(["axis", "what", "collective", "count", "payload", "sent"], rows, left=3)
    out += ["", "Notes:", *(f"  - {n}" for n in plan.notes)] if plan.notes else []
    return "\n".join(out) + "\n"


def format_dry_run(plan: Plan, run: DryRun, differences: dict[int, list[str]]) -> str:
    """The dry run's section: per representative rank, the plan's bytes against the built ones."""
    out = [f"7. Dry run: {len(run.built)} representative rank(s) of {run.world_size} built as "
           "training builds them, on meta, with torch's fake process group"]  # fmt: skip
    rows = []
    for b in run.built:
        rp = plan.ranks[b.rank]
        pairs = (
            f"{_size(getattr(rp, k))} / {_size(getattr(b, k))}"
            for k in ("param_bytes", "grad_bytes", "optimizer_bytes")
        )
        check = "DIFFERS" if b.rank in differences else "ok"
        rows.append([_ranges(b.ranks), str(b.rank), ",".join(map(str, b.stages)),
                     b.schedule or "-", f"{b.param_elements:,}", *pairs, check,
                     f"{b.seconds:.1f} s"])  # fmt: skip
    head = ["ranks", "rank", "stages", "schedule", "params", "param B plan / built",
            "grad B plan / built", "optim B plan / built", "check", "build"]  # fmt: skip
    out += _table(head, rows, left=4)
    for rank, lines in differences.items():
        out += [f"  rank {rank} differs from the plan:", *(f"    {x}" for x in lines)]
    out.append(f"  built in {run.seconds:.1f} s")
    return "\n".join(out) + "\n"
