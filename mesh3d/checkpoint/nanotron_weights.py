"""Nanotron's model-weight files, written and read as full tensors
(docs/nanotron-layout.md#checkpoints).

Pure functions over full tensors keyed by our parameter names. One safetensors file per
parameter and TP rank, tensor key `data`, string metadata `version` / `unsharded_shape` /
`local_global_slices_pairs`; replicated weights (norms) once, with empty metadata; tied
embeddings once, under the embedding's path. `root` is a step's `model/` folder. Reading
accepts any TP/PP layout and splits fused qkv / gate_up back into our tensors.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from mesh3d import extensions
from mesh3d import nanotron_names as names
from mesh3d.errors import UserError
from mesh3d.models.registry import spec_named
from mesh3d.models.spec import ModelShape
from mesh3d.parallel.pipeline_layout import split_by_cost

__all__ = [
    "ModelShape",
    "Param",
    "nanotron_params",
    "read_nanotron_weights",
    "write_nanotron_weights",
]

Slices = tuple[slice, ...]


@dataclass(frozen=True)
class Param:
    """One Nanotron parameter: its name, our tensors (dim-0 chunks), full shape, kind, pp rank."""

    name: str
    ours: tuple[str, ...]
    chunks: tuple[int, ...]
    shape: tuple[int, ...]
    kind: names.Kind
    pp_rank: int


def _param(name: str, ours: tuple[str, ...], kind: names.Kind, pp_rank: int, shapes) -> Param:
    parts = [shapes[o] for o in ours]
    shape = (sum(p[0] for p in parts), *parts[0][1:])
    return Param(name, ours, tuple(p[0] for p in parts), shape, kind, pp_rank)


EMBEDDING_OURS, HEAD_OURS = ("embed_tokens.weight",), ("lm_head.weight",)


def is_embedding(p: Param) -> bool:
    """Whether `p` is the token embedding (whatever its family calls it in Nanotron)."""
    return p.ours == EMBEDDING_OURS


def nanotron_params(s: ModelShape, pp: int = 1) -> list[Param]:
    """Nanotron's parameters in module order (from the family's spec); no lm_head when tied."""
    spec = spec_named(s.family)
    shapes = spec.param_shapes(s)
    stages = enumerate(split_by_cost(*spec.pipeline_costs(s), pp))
    stage_of = {i: st for st, owned in stages for i in owned}
    outer = {"first": [], "last": []}
    for name, (ours, kind, end) in spec.nanotron_outer.items():
        if not (s.tied and ours == HEAD_OURS):
            outer[end].append(_param(name, ours, kind, 0 if end == "first" else pp - 1, shapes))
    params = outer["first"]
    for i in range(s.num_layers):
        for key, (ours, kind) in spec.nanotron_layer(s, i).items():
            our_names = tuple(names.LAYER_PREFIX_OURS.format(i=i) + o for o in ours)
            name = names.LAYER_PREFIX_NANOTRON.format(i=i) + key
            params.append(_param(name, our_names, kind, stage_of[i], shapes))
    return params + outer["last"]


def _slice_pairs(p: Param, tp_rank: int, tp: int) -> list[tuple[Slices, Slices]]:
    """(local, global) slices, one pair per chunk (docs/nanotron-layout.md#slice-metadata)."""
    dim, full = names.SPLIT_DIM[p.kind], (slice(None),) * len(p.shape)
    chunks = p.chunks if p.kind == "column" else (p.shape[dim],)
    pairs, offset = [], 0
    for c in chunks:
        if c % tp:
            raise UserError(
                f"{p.name}: size {c} on dim {dim} does not split over tp={tp}; use a tp that divides it"
            )
        n = c // tp
        a = offset + tp_rank * n
        glob = (*full[:dim], slice(a, a + n), *full[dim + 1 :])
        local = full if p.kind != "column" else (slice(offset // tp, offset // tp + n),) + full[1:]
        pairs.append((local, glob))
        offset += c
    return pairs


def _fmt(slices: Slices) -> str:
    return "|".join(f"{s.start},{s.stop},{s.step}" for s in slices)


def _parse(text: str) -> Slices:
    return tuple(
        slice(*(None if v == "None" else int(v) for v in d.split(","))) for d in text.split("|")
    )


def weight_file(p: Param, tp_rank: int, tp: int, pp: int) -> str:
    """`p`'s file for `tp_rank`, under `<step>/model` (docs/nanotron-layout.md#weight-files)."""
    *dirs, leaf = p.name.split(".")
    fmt = names.UNSHARDED_FILE if p.kind == "replicated" else names.SHARDED_FILE
    file = fmt.format(leaf=leaf, pp_rank=p.pp_rank, pp=pp, tp_rank=tp_rank, tp=tp)
    return "/".join([*dirs, file])


def local_shape(p: Param, tp: int) -> tuple[int, ...]:
    """The shape of one TP rank's tensor of `p` (every rank's is the same for Llama)."""
    dim = names.SPLIT_DIM[p.kind]  # None: not split
    return tuple(d // tp if i == dim else d for i, d in enumerate(p.shape))


def shard_of(p: Param, fused: Tensor, tp_rank: int, tp: int) -> tuple[Tensor, dict[str, str]]:
    """TP rank `tp_rank`'s tensor of `p` from its full (fused) tensor, and the file metadata."""
    if p.kind == "replicated":
        return fused.contiguous(), {}
    pairs = _slice_pairs(p, tp_rank, tp)
    parts = [fused[g] for _, g in pairs]
    data = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
    meta = {
        "version": names.WRITE_VERSION,
        "unsharded_shape": str(p.shape),
        "local_global_slices_pairs": ";".join(f"{_fmt(lo)}#{_fmt(g)}" for lo, g in pairs),
    }
    return data, meta


def unshard(p: Param, shards: dict[int, Tensor], tp: int) -> Tensor:
    """The full (fused) tensor of `p` from every TP rank's tensor {tp_rank: local tensor}."""
    if p.kind == "replicated":
        return shards[min(shards)]
    full = torch.empty(p.shape, dtype=next(iter(shards.values())).dtype)
    for t in range(tp):
        for lo, g in _slice_pairs(p, t, tp):
            full[g] = shards[t][lo]
    return full


def fuse(p: Param, tensors: dict[str, Tensor]) -> Tensor:
    """Our tensors of `p` concatenated into Nanotron's full (fused) tensor, shape-checked."""
    if missing := [o for o in p.ours if o not in tensors]:
        raise UserError(f"no weights for {missing} (needed for {p.name})")
    fused = torch.cat([tensors[o] for o in p.ours]) if len(p.ours) > 1 else tensors[p.ours[0]]
    if tuple(fused.shape) != p.shape:
        raise UserError(
            f"{p.name}: weights have shape {tuple(fused.shape)}, the model config says {p.shape}"
        )
    return fused


def nanotron_shards(full: dict[str, Tensor], s: ModelShape, tp: int,
                    pp: int) -> dict[str, tuple[Tensor, dict[str, str]]]:  # fmt: skip
    """Relative path (under `<step>/model`) -> (the file's `data` tensor, its metadata)."""
    out = {}
    for p in nanotron_params(s, pp):
        fused = fuse(p, full)
        for t in range(1 if p.kind == "replicated" else tp):
            out[weight_file(p, t, tp, pp)] = shard_of(p, fused, t, tp)
    return out


def write_nanotron_weights(root: str | Path, full: dict[str, Tensor], s: ModelShape, tp: int,
                           pp: int) -> list[Path]:  # fmt: skip
    """Write every file of the (tp, pp) layout under `root` (= `<step>/model`); return the paths.

    Example:

        mesh3d.write_nanotron_weights("out/model", llama.state_dict(), shape, tp=2, pp=2)
    """
    paths = []
    for rel, (data, meta) in nanotron_shards(full, s, tp, pp).items():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        save_readable({names.TENSOR_KEY: data}, path, meta or None)
        paths.append(path)
    return paths


def save_readable(tensors: dict[str, Tensor], path: Path, metadata: dict | None) -> None:
    """`safetensors.torch.save_file`, then mode 0666 less the umask: safetensors creates its
    files 0600, unreadable to the other users of a shared model folder."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _read_file(path: Path) -> tuple[Tensor, dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(names.TENSOR_KEY), f.metadata() or {}
    except Exception as e:  # safetensors raises several types for a damaged file
        raise UserError(
            f"cannot read weight file {path}: {e}; the file is truncated or corrupted, copy it again"
        ) from None


def _version(path: Path, text: str | None) -> None:
    try:
        version = tuple(int(x) for x in (text or "").split("."))
    except ValueError:
        version = ()
    if not version:
        raise UserError(
            f"{path} has no valid checkpoint `version` in its metadata ({text!r}); checkpoints older than 1.2 are not supported"
        )
    if version > names.MAX_READ_VERSION:
        max_v = ".".join(map(str, names.MAX_READ_VERSION))
        raise UserError(
            f"{path} is checkpoint version {text}, newer than the {max_v} mesh3d reads; convert it with that Nanotron version"
        )


def _shape(path: Path, text: str | None) -> tuple[int, ...]:
    """`str(tuple)` of the full shape; numpy-2 writes `np.int64(48)` for some sizes."""
    try:
        shape = ast.literal_eval(re.sub(r"np\.\w+\((-?\d+)\)", r"\1", text or ""))
        return tuple(int(d) for d in shape)
    except (ValueError, SyntaxError, TypeError):
        raise UserError(f"{path}: unreadable `unsharded_shape` metadata {text!r}") from None


def _shard_files(directory: Path, p: Param) -> list[Path]:
    """The sharded files of `p`, checking that every TP rank of the saved layout is there."""
    leaf = p.name.rsplit(".", 1)[1]
    regex = re.compile(names.SHARDED_FILE_REGEX.format(leaf=leaf))
    files = directory.glob(f"model_{leaf}*.safetensors") if directory.is_dir() else ()
    found = {f: m for f in files if (m := regex.fullmatch(f.name))}
    if not found:
        hint = tied = ""
        if directory.is_dir() and any(directory.glob(names.BAD_NAMING_GLOB)):
            hint = " (doubled file names of checkpoint 1.3: run Nanotron's scripts/fix_checkpoint_bad_naming.py)"
        if p.ours == HEAD_OURS:
            tied = " (or the checkpoint has tied embeddings: set tie_word_embeddings: true)"
        raise UserError(
            f"missing weights of {p.name}: no model_{leaf}_pp-rank-*_tp-rank-*.safetensors in {directory}{hint}{tied}"
        )
    layouts = {(int(m.group(2)), int(m.group(4))) for m in found.values()}
    if len(layouts) > 1:
        raise UserError(
            f"{directory} mixes files of several (pp, tp) layouts {sorted(layouts)}; "
            "remove the stale ones"
        )
    pp_rank, pp, _, tp = (int(g) for g in next(iter(found.values())).groups())
    present = {int(m.group(3)) for m in found.values()}
    for t in range(tp):
        if t not in present:
            name = names.SHARDED_FILE.format(leaf=leaf, pp_rank=pp_rank, pp=pp, tp_rank=t, tp=tp)
            raise UserError(
                f"missing shard {directory / name} of {p.name} (tp={tp} checkpoint); the checkpoint is incomplete"
            )
    return sorted(found)


def _read_sharded(root: Path, p: Param) -> Tensor:
    directory = root.joinpath(*p.name.split(".")[:-1])
    full: Tensor | None = None
    covered = torch.zeros(p.shape, dtype=torch.bool)
    for path in _shard_files(directory, p):
        local, meta = _read_file(path)
        _version(path, meta.get("version"))
        shape = _shape(path, meta.get("unsharded_shape"))
        if shape != p.shape:
            raise UserError(
                f"{path}: full shape {shape} but the model config gives {p.shape} for {p.name}; check "
                "hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, vocab_size "
                "and make_vocab_size_divisible_by x tp"
            )
        full = torch.empty(p.shape, dtype=local.dtype) if full is None else full
        try:
            for pair in meta["local_global_slices_pairs"].split(";"):
                lo, g = (_parse(x) for x in pair.split("#"))
                full[g] = local[lo]
                covered[g] = True
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise UserError(
                f"{path}: bad `local_global_slices_pairs` metadata for shape {tuple(local.shape)}: {e}"
            ) from None
    if not covered.all():
        first = tuple(int(i) for i in (~covered).nonzero()[0])
        raise UserError(
            f"missing shard of {p.name} in {directory}: element {first} of {p.shape} is in no file"
        )
    return full


def is_expert_stack(p: Param) -> bool:
    """Whether `p` is an MoE layer's stack of experts (split over ep ranks when ep > 1)."""
    return p.name.endswith(names.EXPERT_STACKS)


def read_param(root: str | Path, p: Param) -> Tensor:
    """The full (fused) tensor of `p` from `root` (= `<step>/model`), saved at any TP/PP/ep."""
    root = Path(root)
    if p.kind != "replicated":
        return _read_sharded(root, p)
    path = root / weight_file(p, 0, 1, 1)
    if not path.is_file() and is_expert_stack(p):  # saved split over ep ranks?
        split = extensions.load("expert_files").read_expert_files(root, p)
        if split is not None:
            return split
    if not path.is_file():
        raise UserError(f"missing weight file {path}: a checkpoint of a model without {p.name}, "
                        "or an incomplete one")  # fmt: skip
    full, _ = _read_file(path)
    if tuple(full.shape) != p.shape:
        raise UserError(
            f"{path}: shape {tuple(full.shape)} but the model config gives {p.shape} for {p.name}"
        )
    return full


def read_nanotron_weights(root: str | Path, s: ModelShape) -> dict[str, Tensor]:
    """Our name -> full tensor, from `root` (= `<step>/model`) saved with any TP/PP layout.

    With tied embeddings only `embed_tokens.weight` is returned (lm_head is the same tensor).

    Example:

        full = mesh3d.read_nanotron_weights("ckpt/100/model", mesh3d.model_shape(cfg))
    """
    out = {}
    for p in nanotron_params(s):
        out.update(zip(p.ours, torch.split(read_param(root, p), p.chunks), strict=True))
    return out


def model_config_json(cfg) -> dict:
    """`model_config.json` (docs/nanotron-layout.md#metadata-files), vocab padded."""
    from mesh3d.config import padded_vocab_size

    d = dataclasses.asdict(cfg.model.model_config)
    d["vocab_size"] = padded_vocab_size(cfg)
    return d
