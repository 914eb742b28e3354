"""`mesh3d generate` under torchrun: the tensor- and pipeline-parallel model picks each token.

    torchrun --nproc_per_node=4 -m mesh3d.generate --checkpoint PATH --prompt TEXT --tp 2 --pp 2

Every rank builds its model parts exactly as training does (`train/build.py`) from the step's
`config.yaml` at the layout of the flags (dp 1, tp_mode ALL_REDUCE: each tp rank holds every
token, so a forward may be one token long; the weights are the same in both modes), for one
microbatch of the prompts and S = prompt + new tokens. Parameters are fp32 on CPU and in the
model dtype on CUDA, without autocast, as the one-process path loads them. Each rank reads only
its own weights, saved at any layout: `load_checkpoint` (no optimizer, no scheduler) for a step
folder, `load_weights` for a `from-hf` folder (no checkpoint metadata).

With the KV cache (the default; `generation/cache.py`) the prompt runs once and each new token
is one forward of that token: every rank keeps a `LayerCache` on the attention modules of its
own stages, holding its own heads under tp. Without (`cache=False`) each token runs the whole
sequence so far. A batch of prompts of different lengths is left-padded (`pads`, positions
from 0 at each row's first real token), as on one process.

Per new token: one forward-only pass over the pipeline stages with `forward_walk` (the
evaluation walk: a stage's modules called directly, activations of the step's shape sent on
the pp group); the last stage's tp ranks gather the last position's vocab-sharded logits
(`full_tensor`), its tp rank 0 picks the token (`sampling.next_token`, with its seeded
generator) and broadcasts it to every rank, so that all ranks extend the same sequence.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from mesh3d.checkpoint.load import load_checkpoint, load_weights, read_metadata
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
    group: object = None  # this rank's dp replica's process group (None: dp 1, the world)


def generation_config(step: Path, tp: int, pp: int, batch: int, length: int, device: str,
                      dp: int = 1) -> Config:  # fmt: skip
    """The step's training config at dp x tp x pp for `batch` sequences (per dp replica) of up
    to `length` tokens, validated; no process group is needed. dp replicas hold whole copies
    (zero 0) and each runs its own sequences."""
    path = step / "config.yaml"
    if not path.is_file():
        raise UserError(
            f"{step} has no config.yaml, which generation at tp/pp builds the model from; "
            "generate on one process instead (python -m mesh3d.generate ... without torchrun)"
        )
    saved = {}  # a step folder keeps its non-default `mesh3d:` settings in the metadata
    if (step / "checkpoint_metadata.json").is_file():
        saved = (read_metadata(step).get("custom_metas") or {}).get("mesh3d") or {}
    seq = length
    cfg = load_config(path, [
        f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
        "parallelism.tp_mode=ALL_REDUCE", "mesh3d.async_tp=false",  # any forward length
        "parallelism.context_parallel_size=1",  # a model trained at any cp generates at cp 1
        "parallelism.expert_parallel_size=1",  # and at any ep with every expert on each rank
        "parallelism.pp_engine=afab", "mesh3d.pp_schedule=null", "mesh3d.pp_virtual_stages=1",
        "parallelism.recompute_layer=false", "mesh3d.compile=false", "mesh3d.full_shard=false",
        "optimizer.zero_stage=0", "optimizer.accumulate_grad_in_fp32=false", "data_stages=null",
        f"tokens.micro_batch_size={batch}", "tokens.batch_accumulation_per_replica=1",
        f"tokens.sequence_length={seq}", f"mesh3d.device={device}",
        *(f"mesh3d.{k}={saved[k]}" for k in family_keys() if saved.get(k) is not None),
        *([f"mesh3d.lora={json.dumps(saved['lora'])}"] if saved.get("lora") else []),
    ])  # fmt: skip
    if resolve_device(device).type == "cpu":
        cfg.model.dtype = "float32"
    mc = cfg.model.model_config
    # mesh3d's models never read it; validate() refuses a longer sequence, generate only warns
    mc.max_position_embeddings = max(mc.max_position_embeddings, seq)
    if cfg.mesh3d.lora is None:  # the saved weights replace it after the build
        cfg.model.init_method = RandomInit(std=0.02)
    # a LoRA step folder's adapters load onto its base (config.yaml's init_method), built first
    validate(cfg, world_size=dp * tp * pp)
    return cfg


def load_parallel_model(step: Path, tp: int, pp: int, batch: int, length: int,
                        device: str = "auto", dp: int = 1) -> ParallelModel:  # fmt: skip
    """This rank's parts of the model of `step` at dp x tp x pp, with the saved weights, for
    `batch` sequences (per dp replica) of up to `length` tokens. Every rank of a world of
    dp x tp x pp processes calls it; the process group is started when it is not."""
    cfg = generation_config(step, tp, pp, batch, length, device, dp)  # before any collective
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
    # rank = (pp_rank * dp + dp_rank) * tp + tp_rank (cp 1): tp rank 0 of this replica's last stage
    d = layout.coords["dp"]
    group = None
    if dp > 1:  # one group per replica, every rank creating each (new_group is collective)
        for r in range(dp):
            g = dist.new_group([(p * dp + r) * tp + t for p in range(pp) for t in range(tp)])
            group = g if r == d else group
    return ParallelModel(parts, layout, dev, picker=(parts.head_rank * dp + d) * tp, group=group)


@torch.no_grad()
def generate_parallel(model: ParallelModel, ids: Tensor, max_new_tokens: int,
                      temperature: float = 0.0, top_k: int | None = None, eos: int | None = None,
                      generator: torch.Generator | None = None, *, cache: bool = True,
                      pads: Tensor | None = None) -> Tensor:  # fmt: skip
    """`sampling.generate` on the parallel model: every rank calls it with the same `ids` [S]
    or [B, S] (B = the model's batch; `pads` [B] left padding, see `cache.left_pad`) and gets
    the same tokens back; `generator` draws on the picking rank only. Never picks vocabulary
    padding. With `cache` every rank keeps the keys and values of its layers and heads.

    Example:

        model = load_parallel_model(step, tp=2, pp=2, batch=1, length=40)
        out = generate_parallel(model, torch.tensor([1, 5, 9]), 20, eos=2)
    """
    from mesh3d.generation.cache import KVCache, pad_positions

    check_sampling(max_new_tokens, temperature, top_k)
    layout = model.layout
    rows = ids[None] if ids.dim() == 1 else ids
    b, s = rows.shape
    if b != layout.microbatch_size or s + max_new_tokens > layout.sequence_length:
        raise ValueError(
            f"the model was built for {layout.microbatch_size} sequences of up to "
            f"{layout.sequence_length} tokens; got {b} of {s} + {max_new_tokens}"
        )
    rows = rows.to(model.device)
    pads = pads.to(model.device) if pads is not None else None
    fed = [0]  # tokens the cache holds

    def positions(start: int, end: int) -> Tensor:
        if pads is None:
            return torch.arange(start, end, device=model.device).expand(b, -1)
        return pad_positions(pads, start, end)

    def pick(out: Tensor) -> Tensor:
        if cache:
            n = out.shape[1]
            logits = _last_logits(model, out[:, fed[0] :], positions(fed[0], n), padded=False)
            fed[0] = n
        else:
            logits = _last_logits(model, out, positions(0, out.shape[1]) if pads is not None
                                  else None, padded=True)  # fmt: skip
        tok = torch.empty(b, dtype=torch.int64, device=model.device)
        if dist.get_rank() == model.picker:
            tok = next_token(logits[:, : layout.vocab_size], temperature, top_k, generator)
        dist.broadcast(tok, src=model.picker, group=model.group)
        return tok

    if not cache:
        out = extend(rows, max_new_tokens, pick, eos)
    else:
        with KVCache(list(model.parts.modules), s + max_new_tokens, pads):
            out = extend(rows, max_new_tokens, pick, eos)
    return out[0] if ids.dim() == 1 else out


def _last_logits(model: ParallelModel, x: Tensor, positions: Tensor | None,
                 padded: bool) -> Tensor | None:  # fmt: skip
    """The logits [B, V] (padded vocabulary, gathered over tp) at the last position of `x`
    [B, n] where this rank runs the last stage; None on the other ranks. `padded`: run `x`
    padded to the model's sequence length (every stage's activation has the built shape)."""
    n, parts = x.shape[1], model.parts
    if padded:  # causal attention: the padding after position n - 1 changes nothing there
        rest = model.layout.sequence_length - n
        x = F.pad(x, (0, rest))  # (B, S), padded with token 0
        if positions is not None:
            positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(
                rest, device=x.device)], dim=1)  # fmt: skip

    def last(logits: Tensor, _) -> Tensor:
        logits = logits[:, n - 1]  # (B, V), vocab-sharded under tp
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    kwargs = {} if positions is None else {"positions": positions}
    if parts.schedule is None:
        return last(parts.modules[0](x, **kwargs), None)
    act = model.layout.activation()
    act = torch.empty((x.shape[0], x.shape[1], act.shape[-1]), dtype=act.dtype, device="meta")
    got = forward_walk(parts.stages, 1, x, x, positions, last, act)
    return got[0] if got else None


def generate_cli(step: Path, prompts: list[list[int]], args, tp: int,
                 pp: int) -> tuple[list[list[int]], str]:  # fmt: skip
    """The new token ids of each prompt (one left-padded batch) for `mesh3d generate` at
    tp x pp, and how they were made (the caller ends the process group:
    `mesh.shutdown_distributed`)."""
    from mesh3d.generation.cache import left_pad
    from mesh3d.generation.single import new_tokens

    ids, pads = left_pad(prompts, 0)
    length = ids.shape[1] + args.max_new_tokens
    model = load_parallel_model(step, tp, pp, len(prompts), length, args.device)
    eos = model.layout.eos_token_id
    generator = torch.Generator(model.device).manual_seed(args.seed)
    cache = not getattr(args, "no_cache", False)
    start = time.perf_counter()
    out = generate_parallel(model, ids, args.max_new_tokens, args.temperature, args.top_k, eos,
                            generator, cache=cache, pads=pads if pads.any() else None)  # fmt: skip
    took = time.perf_counter() - start
    kind = "KV cache" if cache else "no cache"
    how = f"in {took:.1f} s at tp {tp} x pp {pp} on {model.device.type} ({kind})"
    return new_tokens(out.tolist(), ids.shape[1], eos), how
