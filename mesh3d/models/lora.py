"""LoRA: low-rank adapters on a model's projections, the base weights frozen (`mesh3d.lora`).

Each adapted projection `y = W x + b` becomes `y = W x + b + (alpha / r) · B A x`, with A [r, in]
drawn as peft draws it (uniform in ±1/sqrt(in)) and B [out, r] zeros, so training starts from
the base model's function. Parameter names are peft's: `layers.0.self_attn.q_proj.lora_A.weight`
beside the base `layers.0.self_attn.q_proj.weight`.

Which projections (`target_modules`, peft's meaning: a list of module names matched as the
last dotted parts of a module's name, a regex string matched against the whole name, or
"all-linear") are chosen from the family's Nanotron table: the 2-D weights of decoder layers
that tensor parallelism splits by columns or rows (attention and MLP projections; not the
experts, router or shared expert of an MoE layer, not the head). The choice never depends on the
layout, and nor do the values: every adapter is drawn whole from its own seed.

Under tensor parallelism an adapter is split the way its base matrix is:
- column-parallel base (W split by output rows): A whole on every rank (its gradient a partial
  sum over tp, `Partial()`), B split by rows like W; each rank adds its rows of B A x.
- row-parallel base (W split by input columns): A split by columns like W, B whole; each rank
  adds B A_i x_i to its partial product before the one reduction the base layer does, so the
  adapter costs no collective (`tp_styles.LocalRowwise` calls the module's `partial_term`).

A LoRA run's checkpoints hold the adapters and their optimizer state only, plus (in the step
folder's metadata) the adapter settings and a fingerprint of the base they apply to
(`base_fingerprint`): resuming, converting or generating with another base is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mesh3d.errors import ConfigError, UserError
from mesh3d.models.init import param_seed

KEY = "mesh3d.lora"
ALL_LINEAR = "all-linear"
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.weight")


@dataclass(frozen=True)
class LoraPlan:
    """The adapters of a run: rank, scaling and, per adapted module (its name in the full
    model), its tp kind ("column" or "row") and its base's [out, in]."""

    r: int
    lora_alpha: float
    modules: dict[str, str]  # module name -> "column" | "row"
    shapes: dict[str, tuple[int, int]]  # module name -> (out_features, in_features)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r

    def adapter_shapes(self) -> dict[str, tuple[int, int]]:
        """Every adapter parameter's name -> full shape, in module order (A before B)."""
        out = {}
        for m, (o, i) in self.shapes.items():
            out[f"{m}.lora_A.weight"] = (self.r, i)
            out[f"{m}.lora_B.weight"] = (o, self.r)
        return out

    def adapter_kind(self, name: str) -> str:
        """How tp splits adapter parameter `name` in files and on ranks: a row-parallel base's A
        by columns ("row"), a column-parallel base's B by rows ("column"), the others whole."""
        module, which = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
        kind = self.modules[module]
        if kind == "row" and which == "lora_A":
            return "row"
        if kind == "column" and which == "lora_B":
            return "column"
        return "replicated"

    def to_json(self) -> dict:
        return {"r": self.r, "lora_alpha": self.lora_alpha, "modules": self.modules,
                "shapes": {k: list(v) for k, v in self.shapes.items()}}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> LoraPlan:
        shapes = {k: (int(v[0]), int(v[1])) for k, v in d["shapes"].items()}
        return cls(int(d["r"]), float(d["lora_alpha"]), dict(d["modules"]), shapes)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _candidates(spec, shape) -> dict[str, tuple[str, tuple[int, int]]]:
    """Module name -> (tp kind, (out, in)) of every projection LoRA can adapt (module doc)."""
    shapes = spec.param_shapes(shape)
    kinds: dict[str, str] = {}
    for i in range(shape.num_layers):
        for ours, kind in spec.nanotron_layer(shape, i).values():
            for o in ours:
                kinds[f"layers.{i}.{o}"] = kind
    out = {}
    for name, s in shapes.items():
        m = _LAYER.fullmatch(name)
        if m is None or len(s) != 2 or kinds.get(name) not in ("column", "row"):
            continue
        if int(m.group(1)) in shape.moe_layers and m.group(2).startswith("mlp."):
            continue  # an MoE layer's router, experts and shared expert
        out[name.removesuffix(".weight")] = (kinds[name], (s[0], s[1]))
    return out


def _matches(module: str, targets) -> bool:
    if targets == ALL_LINEAR:
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def lora_plan(args, spec, shape) -> LoraPlan:
    """The adapters `args` (`mesh3d.lora`) give a model of this family and shape; a
    `ConfigError` naming the key when the targets match nothing or the rank cannot fit."""
    errors = list(plan_errors(args, spec, shape))
    if errors:
        raise ConfigError("; ".join(errors))
    found = _candidates(spec, shape)
    chosen = {m: v for m, v in found.items() if _matches(m, args.target_modules)}
    return LoraPlan(args.r, float(args.lora_alpha), {m: k for m, (k, _) in chosen.items()},
                    {m: s for m, (_, s) in chosen.items()})  # fmt: skip


def plan_errors(args, spec, shape) -> Iterator[str]:
    """Every problem of `mesh3d.lora` for this model, one message each (no torch work)."""
    if not spec.lora:
        yield f"`{KEY}` with the {spec.family} family is not supported yet; train it without adapters"
        return
    if args.r < 1:
        yield f"`{KEY}.r` must be >= 1 (the adapters' rank), got {args.r}"
        return
    if not (isinstance(args.lora_alpha, int | float) and math.isfinite(args.lora_alpha)
            and args.lora_alpha > 0):  # fmt: skip
        yield f"`{KEY}.lora_alpha` must be a finite number > 0 (scaling = alpha / r), got {args.lora_alpha}"
    if args.lora_dropout != 0:
        yield (
            f"`{KEY}.lora_dropout` {args.lora_dropout}: dropout on the adapters' input is not "
            "supported yet (its masks would differ between layouts); set it to 0"
        )
    targets = args.target_modules
    if isinstance(targets, str) and targets != ALL_LINEAR:
        try:
            re.compile(targets)
        except re.error as e:
            yield f"`{KEY}.target_modules` {targets!r} is not a valid regular expression: {e}"
            return
    found = _candidates(spec, shape)
    chosen = {m: v for m, v in found.items() if _matches(m, targets)}
    names = sorted({m.split(".", 2)[2] for m in found})
    if not chosen:
        how = (" (a string is a regular expression over the whole module name, as in peft: "
               f"write a list, e.g. [{targets}], to name projections)") if isinstance(targets, str) else ""  # fmt: skip
        yield (
            f"`{KEY}.target_modules` {targets!r} matches no projection of this "
            f'{spec.family} model{how}; it can adapt: {", ".join(names)} (or "{ALL_LINEAR}")'
        )
        return
    if isinstance(targets, list):
        unused = [t for t in targets if not any(_matches(m, [t]) for m in found)]
        if unused:
            yield (
                f"`{KEY}.target_modules` entries {unused} match no projection of this "
                f"{spec.family} model; it can adapt: {', '.join(names)}"
            )
    smallest = min(min(s) for _, s in chosen.values())
    if args.r > smallest:
        m = next(m for m, (_, s) in chosen.items() if min(s) == smallest)
        yield (
            f"`{KEY}.r` {args.r} is larger than the adapted matrix {m} "
            f"({chosen[m][1][0]} x {chosen[m][1][1]}); use r <= {smallest}"
        )


def config_errors(cfg) -> Iterator[str]:
    """The checks of a config with `mesh3d.lora` (part of `mesh3d config` / `validate`)."""
    from mesh3d.config.schema import SpectralMupInit
    from mesh3d.models.registry import model_shape, spec_of

    args = cfg.mesh3d.lora
    if cfg.mesh3d.float8:
        yield f"`{KEY}` with `mesh3d.float8: true`: adapters on float8 projections are not supported; turn one off"
    if isinstance(cfg.model.init_method, SpectralMupInit):
        yield f"`{KEY}` with µP (`init_method: {{use_mup: true}}`): µP's rates name no adapter; start LoRA from a checkpoint (`init_method: {{path: ...}}`)"
    yield from plan_errors(args, spec_of(cfg.model.model_config), model_shape(cfg))


# ------------------------------------------------------------------------ on the model (torch)


def inject(model: nn.Module, plan: LoraPlan, tp_mesh=None) -> list[str]:
    """Add the adapters of `plan` to the modules of `model` it holds (a pipeline stage holds
    some), after tensor parallelism and on meta; returns the adapted module names.

    With a tp mesh of size > 1 the adapter weights are DTensors laid out as the module doc says."""
    from mesh3d.tp_styles import Partial, Replicate, Shard, distribute_tensor

    tp = tp_mesh is not None and tp_mesh.size() > 1
    done = []
    for name, module in list(model.named_modules()):  # before any wrapper: plain names
        if name not in plan.modules:
            continue
        kind = plan.modules[name]
        out_f, in_f = plan.shapes[name]
        device = module.weight.device
        a = nn.Linear(in_f, plan.r, bias=False, device=device)
        b = nn.Linear(plan.r, out_f, bias=False, device=device)
        a_grad, b_grad = None, None
        if tp:
            a_place, b_place = (
                ([Replicate()], [Shard(0)]) if kind == "column" else ([Shard(1)], [Replicate()])
            )
            for lin, place in ((a, a_place), (b, b_place)):
                dt = distribute_tensor(lin.weight.detach(), tp_mesh, place, src_data_rank=None)
                lin.weight = nn.Parameter(dt)
            # the whole factor's gradient is a sum over tp ranks (each saw its own rows / columns)
            a_grad, b_grad = (Partial(), None) if kind == "column" else (None, Partial())
        module.lora_A, module.lora_B = a, b
        module.lora_scaling = plan.scaling
        row_tp = tp and kind == "row"
        term = types.MethodType(_lora_term(a_grad, b_grad), module)
        if row_tp:  # added to the partial product, before the base layer's reduction
            module.partial_term = term
        else:
            module.forward = types.MethodType(_with_term(module.forward, term), module)
        done.append(name)
    return done


def _lora_term(a_grad, b_grad):
    from mesh3d.tp_local import local_of

    def term(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        a = local_of(self.lora_A.weight, a_grad)
        b = local_of(self.lora_B.weight, b_grad)
        return F.linear(F.linear(x, a), b) * self.lora_scaling

    return term


def _with_term(forward, term):
    def lora_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return forward(x) + term(x)

    return lora_forward


def adapter_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial value of adapter `name`: A uniform in ±1/sqrt(in) (peft's default,
    kaiming-uniform with a = sqrt(5)) from the parameter's own seed; B zeros."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def with_adapters(source, seed: int):
    """A `FullSource` that gives adapters their initial values and the rest from `source`."""

    def full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return adapter_init(name, shape, seed) if is_adapter(name) else source(name, shape)

    return full


def freeze_base(model: nn.Module) -> None:
    """Only adapters train: every other parameter gets `requires_grad=False` (no gradient, no
    optimizer state)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))


def merged(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], plan: LoraPlan
           ) -> dict[str, torch.Tensor]:  # fmt: skip
    """Full weights (our names) with every adapter folded in: W + scaling · B A, in W's dtype."""
    out = dict(base)
    for m in plan.modules:
        w = out[f"{m}.weight"]
        a, b = adapters[f"{m}.lora_A.weight"].double(), adapters[f"{m}.lora_B.weight"].double()
        out[f"{m}.weight"] = (w.double() + plan.scaling * (b @ a)).to(w.dtype)
    return out


# ------------------------------------------------------------------------------- the base


def base_fingerprint(cfg) -> dict:
    """What a LoRA checkpoint's base is: the initial weights of `model.init_method`, named and
    fingerprinted, so a checkpoint is never applied to another base.

    A folder (a Nanotron-layout checkpoint or a Hugging Face model folder): its path and hashes
    of its weight files' names, sizes and sampled bytes and of its manifest or config; random init: std, scaling
    and seed (the base is regenerated exactly from them)."""
    from mesh3d.config.schema import ExistingCheckpointInit

    init = cfg.model.init_method
    if isinstance(init, ExistingCheckpointInit):
        return folder_fingerprint(Path(init.path))
    d = asdict(init)
    return {"init": "random", **d, "seed": cfg.general.seed}


def folder_fingerprint(root: Path) -> dict:
    """A base folder's path; `sha256`, a hash of its weight files' names and sizes and its
    manifest, config.json and model_config.json; `weights`, a hash of samples of the weight
    files' bytes (`_sampled`), which a base re-exported with other weights changes."""
    h, weights = hashlib.sha256(), hashlib.sha256()
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if not f.is_file() or rel.startswith(("optimizer/", "lr_scheduler/", "random/")):
            continue
        if f.suffix == ".safetensors":
            h.update(f"{rel}:{f.stat().st_size}\n".encode())
            _sampled(f, weights)
        elif rel in ("mesh3d_manifest.json", "config.json", "model_config.json"):
            h.update(f"{rel}:".encode() + f.read_bytes())
    return {"init": "path", "path": str(root.resolve()), "sha256": h.hexdigest(),
            "weights": weights.hexdigest()}  # fmt: skip


def _sampled(f: Path, h, head: int = 1 << 20, every: int = 1 << 18, block: int = 1 << 12) -> None:
    """Hash the file's first MiB (a safetensors header, then weights) and 4 KiB of every
    256 KiB after it: any tensor of 256 KiB or more is sampled, at under 2 % of the bytes."""
    with open(f, "rb") as fh:
        h.update(fh.read(head))
        for at in range(head, f.stat().st_size, every):
            fh.seek(at)
            h.update(fh.read(block))


def same_base(saved: dict, now: dict) -> bool:
    """Whether `now` is the base `saved` names; a fingerprint saved before `weights` was part
    of it is compared on what it holds."""
    return all(now.get(k) == v for k, v in saved.items())


def check_base(saved: dict, cfg, where: str) -> None:
    """A `UserError` unless `cfg`'s initial weights are the base `saved` (a LoRA checkpoint's
    `base`) was trained on."""
    now = base_fingerprint(cfg)
    if same_base(saved, now):
        return
    if saved.get("init") == "path" and not Path(saved.get("path", "")).exists():
        raise UserError(
            f"{where}: its LoRA base checkpoint {saved['path']} is missing; restore it there, or "
            "point model.init_method.path at a copy of that base"
        )
    raise UserError(
        f"{where} holds LoRA adapters for base {json.dumps(saved)}, but this config's base "
        f"(model.init_method) is {json.dumps(now)}: set model.init_method to the base the "
        "adapters were trained on"
    )
