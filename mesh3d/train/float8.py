"""`mesh3d.float8`: the decoder layers' linear layers trained in float8, through torchao.

Training converts the single-device model right after it is built on meta, before pipeline
stages, tensor/data parallelism and compile see it. Converted: every plain `nn.Linear` a decoder
layer calls as a module (attention q/k/v/o, the dense MLP's gate/up/down) whose in and out
features are both multiples of 16 (what float8 matmul kernels take). It becomes torchao's
`Float8Linear` with the default recipe: tensorwise dynamic scaling (one scale per tensor per
call, so per microbatch), inputs and weights in e4m3, output gradients in e5m2, master weights
in their own dtype. Kept in high precision: the embedding and lm_head, and MoE blocks (their
router and shared expert call `F.linear` on the weights, so a converted module would never run;
the experts are stacked tensors, not linears). `Float8Linear` keeps `weight` and `bias` as plain
parameters: state dicts and checkpoints are the plain model's.
"""

from __future__ import annotations

from torch import nn

from mesh3d.checks.speed import TORCHAO_FIX
from mesh3d.errors import ConfigError
from mesh3d.log import logger

FLOAT8_MULTIPLE = 16  # in and out features of a linear that float8 kernels take


def convert_to_float8(model: nn.Module, moe: tuple[type, ...]) -> tuple[int, int]:
    """Swap the eligible linears of `model.layers` for torchao `Float8Linear`s, in place (see
    the module doc), leaving blocks of a class in `moe` (the family's MoE blocks) alone;
    returns (converted, skipped for their sizes)."""
    convert = _torchao_convert()
    in_moe = {id(m) for block in model.modules() if isinstance(block, moe) for m in block.modules()}
    counts = {"converted": 0, "skipped": 0}

    def eligible(module: nn.Module, _fqn: str) -> bool:
        if type(module) is not nn.Linear or id(module) in in_moe:
            return False
        fits = not (module.in_features % FLOAT8_MULTIPLE or module.out_features % FLOAT8_MULTIPLE)
        counts["converted" if fits else "skipped"] += 1
        return fits

    for layer in model.layers.values():
        convert(layer, module_filter_fn=eligible)
    return counts["converted"], counts["skipped"]


def apply_float8(model: nn.Module, moe: tuple[type, ...]) -> None:
    """`convert_to_float8` for training: logs what it converted, and refuses a model where
    nothing could be (a switch that changes nothing is an error, not a silent no-op)."""
    converted, skipped = convert_to_float8(model, moe)
    if converted == 0:
        raise ConfigError(
            f"`mesh3d.float8` found no linear layer to convert: each of the {skipped} decoder "
            f"projections has a size that is not a multiple of {FLOAT8_MULTIPLE} (hidden_size, "
            "intermediate_size, heads x head size); change the model or set mesh3d.float8: false"
        )
    kept = f", {skipped} kept in high precision (a size not a multiple of 16)" if skipped else ""
    logger.info(
        f"float8: {converted} linear layers converted to torchao Float8Linear (tensorwise "
        f"dynamic scaling){kept}; embedding, lm_head and MoE blocks stay in high precision"
    )


def _torchao_convert():
    """torchao's `convert_to_float8_training`, or a ConfigError saying how to get it."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise ConfigError(
            f"`mesh3d.float8: true` needs torchao, and `import torchao.float8` failed ({e}): "
            f"{TORCHAO_FIX}"
        ) from e
    return convert_to_float8_training
