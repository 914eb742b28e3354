"""Spectral µP (`model.init_method: {use_mup: true}`), as Nanotron defines it, for any family
whose Nanotron parameters are column/row-parallel linears, norms and a vocabulary embedding.

Following Yang et al., "A Spectral Condition for Feature Learning" (2023), parametrization 1,
applied per Nanotron parameter (fused q/k/v and gate/up count as one matrix, as in Nanotron):
- a column- or row-parallel weight [fan_out, fan_in] (q/k/v, o, gate/up, down, and the untied
  lm_head, a column-parallel linear in Nanotron) starts at N(0, σ²) with
  σ = 1/√fan_in · min(1, √(fan_out/fan_in)), and trains at lr · fan_out/fan_in;
- norm weights start at 1, the embedding at N(0, 1); both train at lr.
The shapes are the full (unsharded) ones, so the rules do not depend on the layout. Two choices
Nanotron leaves open, made here: the lm_head's fan_out is the real vocabulary (Nanotron's padded
one grows with tp, which would make the rate depend on the layout), and a bias (Qwen2's q/k/v
bias; Nanotron's µP code cannot initialize one) starts at 0 and trains at its weight's rate.
Torch-free: the config checks, the init, the optimizer and the checkpoint files read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh3d import nanotron_names as names
from mesh3d.errors import ConfigError
from mesh3d.models.spec import ModelShape, ModelSpec


@dataclass(frozen=True)
class MupRule:
    std: float | None  # initial N(0, std²); None: ones (a norm)
    lr_scale: float  # the parameter's learning rate / the configured one


def spectral_std(fan_in: int, fan_out: int) -> float:
    return (1.0 / math.sqrt(fan_in)) * min(1.0, math.sqrt(fan_out / fan_in))


def mup_rules(spec: ModelSpec, shape: ModelShape, vocab_size: int) -> dict[str, MupRule]:
    """Our parameter name -> its µP rule, for the whole model (`vocab_size`: the real one)."""
    if not spec.mup:
        raise ConfigError(
            f"`model.init_method.use_mup` has no rule for the {spec.family} family in mesh3d "
            "(Nanotron defines spectral µP for Llama and Qwen2); use init_method: {std: 0.02}"
        )
    shapes = spec.param_shapes(shape)
    groups = [(n, ours, kind) for n, (ours, kind, _) in spec.nanotron_outer.items()]
    for i in range(shape.num_layers):
        ours_at, theirs_at = (
            names.LAYER_PREFIX_OURS.format(i=i),
            names.LAYER_PREFIX_NANOTRON.format(i=i),
        )
        layer = spec.nanotron_layer(shape, i).items()
        groups += [
            (theirs_at + key, tuple(ours_at + o for o in ours), kind) for key, (ours, kind) in layer
        ]
    rules: dict[str, MupRule] = {}
    for name, ours, kind in groups:
        full = [shapes[o] for o in ours]
        if name == names.LM_HEAD and shape.tied:
            continue  # the embedding's tensor
        if name == names.EMBEDDING:
            rules.update({o: MupRule(1.0, 1.0) for o in ours})
        elif len(full[0]) == 1 and kind == "replicated":  # a norm
            rules.update({o: MupRule(None, 1.0) for o in ours})
        elif len(full[0]) == 2 and (kind in ("column", "row") or name == names.LM_HEAD):
            fan_out = vocab_size if name == names.LM_HEAD else sum(s[0] for s in full)
            fan_in = full[0][1]
            rule = MupRule(spectral_std(fan_in, fan_out), fan_out / fan_in)
            rules.update({o: rule for o in ours})
        elif len(full[0]) != 1:
            raise ConfigError(
                f"`model.init_method.use_mup`: Nanotron's spectral µP has no rule for {name} "
                f"(shape {full[0]}, e.g. mixture-of-experts weights); remove the moe_config or "
                "use init_method: {std: 0.02}"
            )
    biases = [o for _, ours, _ in groups for o in ours if o.endswith(".bias")]
    for o in biases:  # zeros, at their weight's rate
        rules[o] = MupRule(0.0, rules[o.removesuffix(".bias") + ".weight"].lr_scale)
    return rules
