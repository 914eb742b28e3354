"""AdamW / SGD with Nanotron's settings, plus its LR schedule. Weight decay skips the
parameters matching `optimizer.weight_decay_exclude_named_params` (`re.match` on our name and
on Nanotron's; a tied lm_head under the embedding's names). Nanotron's leaked `tied_name` bug
(`.*layernorm.*` also excluding the projections after it) is not copied."""

from __future__ import annotations

import re

import torch

from mesh3d import extensions
from mesh3d import nanotron_names as names
from mesh3d.config.schema import SpectralMupInit
from mesh3d.errors import decided_alike
from mesh3d.layout import RunLayout
from mesh3d.models.registry import spec_named
from mesh3d.models.spec import ModelShape
from mesh3d.parallel.parallelize import canonical_name
from mesh3d.train.lr_schedule import build_lr_scheduler

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def match_names(name: str, shape: ModelShape) -> list[str]:
    """Our name of a parameter and its Nanotron names, as the exclusion patterns match them."""
    spec = spec_named(shape.family)
    name = canonical_name(name)
    if shape.tied and name == "lm_head.weight":
        name = "embed_tokens.weight"
    theirs = [n for n, (parts, *_) in spec.nanotron_outer.items() if name in parts]
    m = _LAYER.fullmatch(name)
    if m:
        prefix = names.LAYER_PREFIX_NANOTRON.format(i=m.group(1))
        layer = spec.nanotron_layer(shape, int(m.group(1))).items()
        theirs += [prefix + k for k, (parts, _) in layer if m.group(2) in parts]
    return [name, *theirs]


def param_groups(
    named_params, weight_decay: float, exclude: list[str], shape: ModelShape,
    lr_scale: dict[str, float] | None = None,
) -> list[dict]:  # fmt: skip
    """Param groups by (decayed or `exclude`d, `lr_scale` of µP: our name -> lr / configured lr),
    the groups at scale 1 first; each says its `lr_scale`."""
    by_group: dict[tuple, list] = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        candidates = match_names(name, shape)
        excluded = any(re.match(pat, n) for pat in exclude for n in candidates)
        scale = lr_scale[candidates[0]] if lr_scale else 1.0
        # expert-parallel slices and each mesh's DTensors apart: one fused/foreach AdamW call
        # cannot mix plain tensors (expert slices under zero 1) with FSDP's DTensors
        mesh = str(getattr(getattr(p, "device_mesh", None), "mesh_dim_names", ""))
        sliced = (getattr(p, "expert_shard", None) is not None, mesh)
        by_group.setdefault((scale != 1.0, scale, excluded, sliced), []).append(p)
    if not by_group:
        by_group[(False, 1.0, False, (False, ""))] = []
    return [
        {"params": params, "weight_decay": 0.0 if excluded else weight_decay, "lr_scale": scale}
        for (_, scale, excluded, _), params in sorted(by_group.items(), key=lambda kv: kv[0])
    ]


def build_optimizer(named_params, cfg, layout: RunLayout, device: torch.device):
    """(optimizer, lr_scheduler) for the (name, parameter) pairs from `cfg.optimizer`."""
    o = cfg.optimizer
    f, lr = o.optimizer_factory, o.learning_rate_scheduler.learning_rate
    exclude, shape = list(o.weight_decay_exclude_named_params or []), layout.shape
    named_params = list(named_params)
    scales = None
    if isinstance(cfg.model.init_method, SpectralMupInit):
        rules = extensions.load("mup").mup_rules(layout.spec, shape, layout.vocab_size)
        scales = {name: rule.lr_scale for name, rule in rules.items()}
    groups = param_groups(named_params, o.weight_decay, exclude, shape, scales)
    for g in groups:
        g["lr"] = lr * g["lr_scale"]
    if f.name == "muon":
        from mesh3d.config.schema import MuonOptimizerArgs
        from mesh3d.train.muon import MuonAdamW, split_groups

        names = {id(p): canonical_name(n) for n, p in named_params}
        explicit = f.muon_params != MuonOptimizerArgs().muon_params
        with decided_alike():  # every rank's parameters have the same names
            split = split_groups(groups, names, f.muon_params, explicit)
        opt = MuonAdamW(split, lr, f)
    elif f.name == "sgd":
        opt = torch.optim.SGD(groups, lr=lr)
    else:
        # Nanotron's `torch_adam_is_fused`: torch's fused AdamW kernel (CUDA, and CPU since 2.4)
        fused = bool(f.torch_adam_is_fused) and device.type in ("cuda", "cpu")
        betas = (f.adam_beta1, f.adam_beta2)
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=f.adam_eps, fused=fused or None)
    return opt, build_lr_scheduler(opt, cfg)
