"""`mesh3d generate` under torchrun: the tensor- and pipeline-parallel model picks each token.

    torchrun --nproc_per_node=4 -m mesh3d.generate --checkpoint PATH --prompt TEXT --tp 2 --pp 2

Every rank builds its model parts exactly as training does (`train/build.py`) from the step's
`config.yaml` at the layout of the flags (dp 1), for one microbatch of the prompts and a fixed
sequence length S = prompt + new tokens (rounded up to a multiple of tp for sequence
parallelism): pipeline stages fix their shapes when built, so each forward gets the tokens so
far padded to S, and the logits are read at the last real position (attention is causal, so
the padding after it changes nothing). Parameters are fp32 on CPU and in the model dtype on
CUDA, without autocast, as the one-process path loads them. Each rank reads only its own
weights, saved at any layout: `load_checkpoint` (no optimizer, no scheduler) for a step folder,
`load_weights` for a `from-hf` folder (no checkpoint metadata).

Per new token: one forward-only pass, over the pipeline stages with `forward_walk` (the
evaluation walk: a stage's modules called directly, activations sent on the pp group); the
last stage's tp ranks gather the last position's vocab-sharded logits (`full_tensor`), its tp
rank 0 picks the token (`sampling.next_token`, with its seeded generator) and broadcasts it to
every rank, so that all ranks extend the same sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from mesh3d.checkpoint.nanotron_state import read_metadata
from mesh3d.checkpoint.training import load_checkpoint, load_weights
from mesh3d.checks import validate
from mesh3d.config import RandomInit, load_config
from mesh3d.config.families import family_keys
from mesh3d.config.schema import Config
from mesh3d.errors import UserError
from mesh3d.generation.sampling import check_sampling, extend, next_token
from mesh3d.layout import RunLayout
from mesh3d.mesh import (
    build_mesh,
    collective_timeout,
    init_distributed,
    resolve_device,
    set_collective_timeout,
)
from mesh3d.parallel.pipeline_forward import forward_walk
from mesh3d.train.build import ModelParts, build_model_parts


@dataclass
class ParallelModel:
    """This rank's share of a model that generates: its parts, layout, device, and the global
    rank that picks every token (tp rank 0 of the last pipeline stage)."""

    parts: ModelParts
    layout: RunLayout
    device: torch.device
    picker: int


def generation_config(step: Path, tp: int, pp: int, batch: int, length: int, device: str) -> Config:
    """The step's training config at tp x pp (dp 1) for `batch` sequences of up to `length`
    tokens, validated; no process group is needed."""
    path = step / "config.yaml"
    if not path.is_file():
        raise UserError(
            f"{step} has no config.yaml, which generation at tp/pp builds the model from; "
            "generate on one process instead (python -m mesh3d.generate ... without torchrun)"
        )
    saved = {}  # a step folder keeps its non-default `mesh3d:` settings in the metadata
    if (step / "checkpoint_metadata.json").is_file():
        saved = (read_metadata(step).get("custom_metas") or {}).get("mesh3d") or {}
    seq = -(-length // tp) * tp  # sequence parallelism splits it over tp
    cfg = load_config(path, [
        "parallelism.dp=1", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
        "parallelism.context_parallel_size=1",  # a model trained at any cp generates at cp 1
        "parallelism.expert_parallel_size=1",  # and at any ep with every expert on each rank
        "parallelism.pp_engine=afab", "mesh3d.pp_schedule=null", "mesh3d.pp_virtual_stages=1",
        "parallelism.recompute_layer=false", "mesh3d.compile=false", "mesh3d.full_shard=false",
        "optimizer.zero_stage=0", "optimizer.accumulate_grad_in_fp32=false", "data_stages=null",
        f"tokens.micro_batch_size={batch}", "tokens.batch_accumulation_per_replica=1",
        f"tokens.sequence_length={seq}", f"mesh3d.device={device}",
        *(f"mesh3d.{k}={saved[k]}" for k in family_keys() if saved.get(k) is not None),
    ])  # fmt: skip
    if resolve_device(device).type == "cpu":
        cfg.model.dtype = "float32"
    mc = cfg.model.model_config
    # mesh3d's models never read it; validate() refuses a longer sequence, generate only warns
    mc.max_position_embeddings = max(mc.max_position_embeddings, seq)
    cfg.model.init_method = RandomInit(std=0.02)  # the saved weights replace it after the build
    validate(cfg, world_size=tp * pp)
    return cfg


def load_parallel_model(step: Path, tp: int, pp: int, batch: int, length: int,
                        device: str = "auto") -> ParallelModel:  # fmt: skip
    """This rank's parts of the model of `step` at tp x pp, with the saved weights, for `batch`
    sequences of up to `length` tokens. Every rank of a world of tp x pp processes calls it;
    the process group is started when it is not."""
    cfg = generation_config(step, tp, pp, batch, length, device)  # before any collective
    dev = init_distributed(timeout_s=cfg.mesh3d.collective_timeout_s, device=device)
    layout = RunLayout.resolve(cfg, dist.get_world_size(), dist.get_rank())
    mesh = build_mesh(layout.dims, dev.type)
    set_collective_timeout(mesh, cfg.mesh3d.collective_timeout_s)
    parts = build_model_parts(cfg, layout, mesh, dev)
    m = cfg.mesh3d
    if (step / "checkpoint_metadata.json").is_file():
        with collective_timeout(mesh, m.checkpoint_timeout_s, m.collective_timeout_s):
            load_checkpoint(step, parts, None, None, cfg, layout=layout,
                            load_optimizer=False, load_lr_scheduler=False)  # fmt: skip
    else:  # a `from-hf` folder: weights and model_config.json only
        load_weights(step, parts, layout)
    for module in parts.modules:
        module.eval()
    # rank = (pp_rank * dp + dp_rank) * tp + tp_rank, with dp 1 and tp rank 0
    return ParallelModel(parts, layout, dev, picker=parts.head_rank * tp)


@torch.no_grad()
def generate_parallel(model: ParallelModel, ids: Tensor, max_new_tokens: int,
                      temperature: float = 0.0, top_k: int | None = None, eos: int | None = None,
                      generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
    """`sampling.generate` on the parallel model: every rank calls it with the same `ids` [S]
    or [B, S] (B = the model's batch) and gets the same tokens back; `generator` draws on the
    picking rank only. Never picks vocabulary padding.

    Example:

        model = load_parallel_model(step, tp=2, pp=2, batch=1, length=40)
        out = generate_parallel(model, torch.tensor([1, 5, 9]), 20, eos=2)
    """
    check_sampling(max_new_tokens, temperature, top_k)
    layout = model.layout
    rows = ids.shape[0] if ids.dim() == 2 else 1
    if rows != layout.microbatch_size or ids.shape[-1] + max_new_tokens > layout.sequence_length:
        raise ValueError(
            f"the model was built for {layout.microbatch_size} sequences of up to "
            f"{layout.sequence_length} tokens; got {rows} of {ids.shape[-1]} + {max_new_tokens}"
        )

    def pick(out: Tensor) -> Tensor:
        logits = _last_logits(model, out)  # (B, V) where this rank runs the last stage
        tok = torch.empty(rows, dtype=torch.int64, device=model.device)
        if dist.get_rank() == model.picker:
            tok = next_token(logits[:, : layout.vocab_size], temperature, top_k, generator)
        dist.broadcast(tok, src=model.picker)
        return tok

    return extend(ids.to(model.device), max_new_tokens, pick, eos)


def _last_logits(model: ParallelModel, out: Tensor) -> Tensor | None:
    """The logits [B, V] (padded vocabulary, gathered over tp) at the last position of `out`
    [B, n] where this rank runs the last stage; None on the other ranks."""
    n, parts = out.shape[1], model.parts
    x = F.pad(out, (0, model.layout.sequence_length - n))  # (B, S), padded with token 0

    def last(logits: Tensor, _) -> Tensor:
        logits = logits[:, n - 1]  # (B, V), vocab-sharded under tp
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    if parts.schedule is None:
        return last(parts.modules[0](x), None)
    got = forward_walk(parts.stages, 1, x, x, None, last, model.layout.activation())
    return got[0] if got else None


def generate_cli(step: Path, prompt_ids: list[int], args, tp: int, pp: int) -> tuple[list, str]:
    """The new token ids for `mesh3d generate` at tp x pp, and how they were made (the caller
    ends the process group: `mesh.shutdown_distributed`)."""
    length = len(prompt_ids) + args.max_new_tokens
    model = load_parallel_model(step, tp, pp, 1, length, args.device)
    generator = torch.Generator(model.device).manual_seed(args.seed)
    start = time.perf_counter()
    out = generate_parallel(model, torch.tensor(prompt_ids), args.max_new_tokens,
                            args.temperature, args.top_k, model.layout.eos_token_id,
                            generator)  # fmt: skip
    took = time.perf_counter() - start
    how = f"in {took:.1f} s at tp {tp} x pp {pp} on {model.device.type}"
    return out[len(prompt_ids) :].tolist(), how
