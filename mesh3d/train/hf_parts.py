"""This rank's parts of a `transformers` causal LM (`mesh3d.hf_model`), for mesh3d's own run.

Every rank loads the model from the folder (`from_pretrained`; a folder holding only a
config.json gets transformers' own initialization, seeded by `general.seed`), casts it to the
run's parameter dtype, cuts it into pipeline stages at its decoder layers (`build_hf_stage`,
layers split by their parameter counts as `mesh3d plan --hf-model` plans them) and puts each
stage on the mesh with its own TP plan and mesh3d's DP (`parallelize_hf`: zero_stage 0 sums
gradients after backward, zero_stage 1 / `mesh3d.full_shard` is FSDP2). The result is the same
`ModelParts` a mesh3d family gives, so the run's data, loss, step, metrics, guards and
checkpoints are the family runs' own; checkpoints keep the model's parameter names
(`params_of`), each tensor's TP split read off its files when loading at another layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mesh3d import extensions
from mesh3d.checkpoint.any_model import as_saved, params_of
from mesh3d.config import SFTDatasetsArgs
from mesh3d.errors import UserError
from mesh3d.hf_models import decoder_layers, load_hf, load_hf_config, parallelize_hf
from mesh3d.hf_stages import build_hf_stage, hf_stage_layers
from mesh3d.layout import RunLayout
from mesh3d.log import logger
from mesh3d.parallel.pipeline import build_schedule, pipeline_stage
from mesh3d.parallel.pipeline_layout import rank_of_stage, stage_ids_of_rank
from mesh3d.train.build import ModelParts
from mesh3d.train.loss import step_loss


def load_model(cfg) -> nn.Module:
    """The model of `mesh3d.hf_model`: its saved weights, or (a config.json alone) its own
    initialization drawn from `general.seed`, the same on every rank."""
    source = cfg.mesh3d.hf_model
    folder = Path(source)
    weights = not folder.is_dir() or any([*folder.glob("*.safetensors"), *folder.glob("*.bin")])
    if weights:
        model = load_hf(source)
    else:
        import transformers

        torch.manual_seed(cfg.general.seed)
        model = transformers.AutoModelForCausalLM.from_config(load_hf_config(source))
    logger.info(
        f"Model: {type(model).__name__} from {source} (transformers' own code; "
        f"{'its saved weights' if weights else 'initialized from general.seed'})"
    )
    return model


def build_hf_parts(cfg, layout: RunLayout, mesh, device: torch.device) -> ModelParts:
    """This rank's parts of the run's transformers model (module docstring)."""
    p = cfg.parallelism
    if any(isinstance(s.data.dataset, SFTDatasetsArgs) for s in cfg.data_stages or []):
        raise UserError(
            "data_stages: SFT data needs mesh3d's attention (per-document positions); "
            "mesh3d.hf_model trains on pretraining data only"
        )
    model = load_model(cfg).to(device="cpu", dtype=layout.param_dtype)
    loss_fn = step_loss(layout)
    mode, sp = layout.dp_mode, layout.sequence_parallel
    ep, replicas = None, None
    if layout.expert_parallel > 1:  # every rank makes every group, before any stage is built
        experts = extensions.load("expert_parallel")
        ep, replicas = experts.new_groups(layout.dims, layout.expert_parallel)

    def finish(part: nn.Module) -> nn.Module:
        part = parallelize_hf(part, mesh, dp_mode=mode, sequence_parallel=sp, ep=ep)
        return part.to(device) if device.type != "cpu" else part

    every = list(range(len(model.get_submodule(decoder_layers(model)))))
    if p.pp == 1:
        parts = ModelParts([finish(build_hf_stage(model, 0, 1, every))], loss_fn=loss_fn,
                           expert_replicas=replicas)  # fmt: skip
        parts.params_of = _saved_names(parts)
        return parts
    name, virtual = layout.schedule, layout.virtual_stages
    n = p.pp * virtual
    split = hf_stage_layers(model, n)
    ids = stage_ids_of_rank(layout.coords["pp"], p.pp, virtual, name)
    modules = [finish(build_hf_stage(model, i, n, split[i])) for i in ids]
    del model

    def shaped(seq_len: int) -> tuple[list, object]:
        stages = [
            pipeline_stage(m, i, n, device, mesh["pp"].get_group(),
                           microbatch_size=layout.microbatch_size, seq_len=seq_len,
                           seq_len_local=seq_len,
                           hidden_size=cfg.model.model_config.hidden_size,
                           vocab_size=layout.padded_vocab, dtype=layout.param_dtype,
                           logits_dtype=layout.logits_dtype)
            for m, i in zip(modules, ids)
        ]  # fmt: skip
        return stages, build_schedule(name, stages, layout.microbatches, loss_fn)

    stages, schedule = shaped(layout.sequence_length)
    parts = ModelParts(
        modules=modules, schedule=schedule, stages=stages, has_first=0 in ids,
        has_last=n - 1 in ids, embed_rank=rank_of_stage(0, p.pp, name),
        head_rank=rank_of_stage(n - 1, p.pp, name), loss_fn=loss_fn, expert_replicas=replicas,
        seq_len=layout.sequence_length, reshape=shaped,
    )  # fmt: skip
    parts.params_of = _saved_names(parts)
    return parts


def _saved_names(parts: ModelParts):
    """`params_of(pp_rank, folder=None)`: the checkpoint entries of this rank's parameters under
    their own names, their TP split from the placements (saving) or from `folder`'s files
    (loading, saved at any layout)."""

    def entries(pp_rank: int, folder: Path | None = None) -> list:
        found = params_of(parts.modules, pp_rank=pp_rank)
        return found if folder is None else [as_saved(Path(folder) / "model", e) for e in found]

    return entries
