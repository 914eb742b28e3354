"""Convert weights between Hugging Face model folders and Nanotron's layout, for every family
mesh3d has (the family's spec gives the names and the config translation).

    python -m mesh3d.convert to-hf --checkpoint <step dir | checkpoints dir> --output <hf dir>
    python -m mesh3d.convert from-hf --model <hf dir> --output <dir> [--tp N] [--pp N]

`to-hf` reads a step folder (`model_config.json` + `model/...`, saved at any tp/pp, by Nanotron
or mesh3d), or the one a checkpoints folder's `latest.txt` names, and writes `config.json` +
`model.safetensors` that transformers' `AutoModelForCausalLM.from_pretrained` loads. The
vocabulary stays the padded one of `model_config.json` (lossless; the extra rows are the padding). Tied embeddings are written once, as `model.embed_tokens.weight`. A model trained
with `rope_interleaved: true` has its q/k rows permuted per head into HF's rotate-half order.
The tokenizer saved with the checkpoint (`<step>/tokenizer/`) is copied next to them.

`from-hf` reads a local HF folder (the family from its `model_type` / `architectures`) (`config.json` in the transformers 4 form, top-level
`rope_theta` / `rope_scaling`, or the transformers 5 form, `rope_parameters`; `*.safetensors`,
sharded or not) and writes `<output>/model/...` (Nanotron's layout at the given tp/pp),
`<output>/model_config.json` (padded vocab) and `<output>/config.yaml`, a training config that
runs as is and starts from these weights (`init_method: {path: <output>}`; the other sections
are small defaults, see `from_hf_config.py`). No optimizer state is written.

Weight math (docs/nanotron-layout.md#hugging-face-names): the spec maps our names to HF's (for
Llama, a `model.` prefix); `write_nanotron_weights` / `read_nanotron_weights` fuse and split qkv and
gate_up.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from mesh3d import extensions
from mesh3d.checkpoint.from_hf_config import training_config
from mesh3d.checkpoint.load import not_a_folder, verified, weights_dir
from mesh3d.checkpoint.model_config import _read_json_object, read_model_config_json, shape_of  # noqa: F401
from mesh3d.checkpoint.tokenizer_files import FILES, copy_into_folder, step_tokenizer
from mesh3d.checkpoint.training import lora_of, resolve_step_dir
from mesh3d.checks import validate
from mesh3d.config import save_config
from mesh3d.errors import ConfigError, UserError, unwritable
from mesh3d.log import logger
from mesh3d.models.dtypes import DTYPES
from mesh3d.models.registry import families, spec_for_hf, spec_of

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --- rotary layout -------------------------------------------------------------------------


def interleave_permutation(head_dim: int) -> Tensor:
    """Row order taking HF rotate-half rows to GPT-J interleaved rows, per head
    (docs/nanotron-layout.md#rotary-layouts): new row 2i = old row i, new row 2i+1 = old row i +
    dh/2."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], dim=-1).flatten()


def _permute_heads(w: Tensor, head_dim: int, perm: Tensor) -> Tensor:
    return w.view(-1, head_dim, w.shape[-1])[:, perm].reshape(w.shape)


def permute_qk(full: dict[str, Tensor], head_dim: int, to_interleaved: bool) -> dict[str, Tensor]:
    """q/k projection rows moved between rotate-half (HF) and interleaved order, per head."""
    perm = interleave_permutation(head_dim)
    if not to_interleaved:
        perm = torch.argsort(perm)
    return {
        k: _permute_heads(v, head_dim, perm)
        if k.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))
        else v
        for k, v in full.items()
    }


# --- model_config.json ------------------------------------------------------------------


# --- HF safetensors ------------------------------------------------------------------------


def read_hf_weights(model_dir: Path) -> dict[str, Tensor]:
    """HF name -> tensor from every `*.safetensors` of `model_dir` (the index's files if any)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{index} names shards that are missing: {', '.join(missing)}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = list(model_dir.glob("*.bin")) + list(model_dir.glob("*.pt"))
        hint = (
            " (it has PyTorch .bin weights: re-save with `save_pretrained(..., "
            "safe_serialization=True)`)"
            if bins
            else ""
        )
        raise UserError(f"{model_dir} has no *.safetensors weights{hint}")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[k] = sf.get_tensor(k)
        except Exception as e:  # safetensors raises several types for a damaged file
            raise UserError(f"cannot read {f}: {e}; the file is truncated or corrupted") from None
    return out


def hf_to_ours(hf: dict[str, Tensor], mc, where: Path, arch=None) -> dict[str, Tensor]:
    """Our names (the architecture's map); caches dropped, lm_head dropped when tied; every
    weight the model needs present and nothing else."""
    spec = spec_of(mc)
    arch = arch or spec.hf_of(mc)
    hf = arch.weights_from_hf(hf, mc) if arch.weights_from_hf else hf
    tied = shape_of(mc).tied
    ours, hf_name = {}, {}
    for k, v in hf.items():
        name = arch.hf_to_ours(k)
        if name is None or (tied and name == "lm_head.weight"):
            continue
        ours[name], hf_name[name] = v, k
    if not tied and "lm_head.weight" not in ours:
        raise UserError(
            f"{where} has no lm_head.weight and config.json says tie_word_embeddings is false"
        )
    shapes = spec.param_shapes(shape_of(mc))
    expected = set(shapes) - ({"lm_head.weight"} if tied else set())
    extra, missing = sorted(set(ours) - expected), sorted(expected - set(ours))
    if extra:
        raise UserError(f"{where} has weights mesh3d's {spec.family} does not know: {extra[:5]}")
    if missing:
        raise UserError(f"{where} lacks weights of the model: {missing[:5]}")
    for name, t in ours.items():
        if tuple(t.shape) != tuple(shapes[name]):
            key = hf_name.get(name, name)
            raise UserError(
                f"{_file_of(where, key)}: tensor {key} has shape {tuple(t.shape)} but "
                f"config.json gives {tuple(shapes[name])} (mesh3d's {name}); the weights do not "
                "match their config.json: re-download the folder or restore config.json"
            )
    return ours


def _file_of(model_dir: Path, key: str) -> Path:
    """The safetensors file of `model_dir` holding tensor `key` (for error messages)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return model_dir / json.loads(index.read_text()).get("weight_map", {}).get(key, index.name)
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            if key in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                return f
    return model_dir


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


# --- the two directions --------------------------------------------------------------------


def to_hf(checkpoint: str | Path, output: str | Path, dtype: str | None = None) -> list[Path]:
    """Write `output/config.json` + `output/model.safetensors` (+ the checkpoint's saved
    tokenizer files, replacing an earlier export's) from a step folder or a checkpoints folder
    (`latest.txt`); the paths. A warning names what else `output` holds."""
    step, output = verified(weights_dir(checkpoint, "--checkpoint")), Path(output)
    mc = read_model_config_json(step)
    spec = spec_of(mc)
    if not (step / "model").is_dir():
        raise UserError(f"{step} has no model/ folder of weights")
    from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights

    shape = shape_of(mc)
    if lora_of(step) is not None:  # a LoRA run's: its base with the adapters merged
        full = extensions.load("lora_files").merged_weights(step)
    else:
        full = read_nanotron_weights(step / "model", shape)
    if getattr(mc, "rope_interleaved", False):
        full = permute_qk(full, shape.head_dim, to_interleaved=False)
    if shape.tied:
        full.pop("lm_head.weight", None)
    if dtype is not None:
        full = {k: v.to(DTYPES[dtype]) for k, v in full.items()}
    arch = spec.hf_of(mc)
    hf = {arch.ours_to_hf(k): v.contiguous() for k, v in full.items()}
    out_dtype = next(iter(hf.values())).dtype
    name = DTYPE_NAMES.get(out_dtype, str(out_dtype).removeprefix("torch."))
    hf_config = arch.config_to_hf(mc, name)
    hf = arch.weights_to_hf(hf, mc) if arch.weights_to_hf else hf
    config = output / "config.json"
    try:
        output.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(hf_config, indent=2) + "\n")
    except OSError as e:
        raise unwritable("--output", output, e) from None
    weights = output / "model.safetensors"
    from mesh3d.checkpoint.nanotron_weights import save_readable

    save_readable(hf, weights, {"format": "pt"})
    for name in FILES:  # an earlier export's: this model's replace them, or none
        (output / name).unlink(missing_ok=True)
    copied = copy_into_folder(step_tokenizer(step), output)
    specials = set_special_tokens(output, mc)
    paths = [config, weights, *copied, *(p for p in specials if p not in copied)]
    if others := sorted(p.name for p in output.iterdir() if p not in paths):
        names = ", ".join(others[:5]) + ", ..." * (len(others) > 5)
        logger.warning(f"{output} also holds {len(others)} entries this export did not write "
                       f"(from something else?): {names}")  # fmt: skip
    return paths


def set_special_tokens(folder: Path, mc) -> list[Path]:
    """Name the model config's bos / eos (/ pad) ids in `folder/tokenizer_config.json`, where it
    leaves them unset, so the exported tokenizer loads with `eos_token` etc. set (a bare
    `tokenizer.json` has no such roles). Pad: the config's pad id, else eos. [] without a
    `tokenizer.json`."""
    tok_json, conf_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not tok_json.is_file():
        return []
    try:
        tok = json.loads(tok_json.read_text(encoding="utf-8"))
        conf = json.loads(conf_path.read_text(encoding="utf-8")) if conf_path.is_file() else {}
    except (OSError, ValueError):
        return []  # a tokenizer mesh3d cannot read is copied as it is
    vocab = tok.get("model", {}).get("vocab") or {}
    names = {i: t for t, i in vocab.items()} if isinstance(vocab, dict) else {}
    names |= {a["id"]: a["content"] for a in tok.get("added_tokens", []) if "id" in a}
    eos = getattr(mc, "eos_token_id", None)
    pad = getattr(mc, "pad_token_id", None)
    wanted = {"bos_token": getattr(mc, "bos_token_id", None), "eos_token": eos,
              "pad_token": pad if pad is not None else eos}  # fmt: skip
    changed = False
    for role, token_id in wanted.items():
        if conf.get(role) is None and token_id in names:
            conf[role], changed = names[token_id], True
    if not changed:
        return []
    conf_path.write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")
    return [conf_path]


def from_hf(model: str | Path, output: str | Path, tp: int = 1, pp: int = 1) -> list[Path]:
    """Write a Nanotron-layout weights checkpoint of an HF Llama folder; the paths written."""
    model_dir, output = Path(model), Path(output)
    if tp < 1 or pp < 1:
        raise UserError(f"--tp and --pp must be >= 1, got tp={tp} pp={pp}")
    if not model_dir.is_dir():
        raise UserError(f"--model {model_dir} {not_a_folder(model_dir)}; give a Hugging Face "
                        "model folder")  # fmt: skip
    mc, arch = hf_config_of(model_dir)
    if pp > mc.num_hidden_layers:
        raise UserError(f"--pp {pp} is more than the model's {mc.num_hidden_layers} layers")
    ours = hf_to_ours(read_hf_weights(model_dir), mc, model_dir, arch)
    dtypes = {t.dtype for t in ours.values()}
    dtype = DTYPE_NAMES.get(dtypes.pop(), "float32") if len(dtypes) == 1 else "float32"
    cfg = training_config(mc, model_dir, output, tp, pp, dtype)
    try:  # before writing anything: the converted model must train at this tp/pp
        validate(cfg, tp * pp)
    except ConfigError as e:
        raise UserError(f"{model_dir} cannot be trained at --tp {tp} --pp {pp}: {e}") from None
    vocab = mc.vocab_size
    padded = -(-vocab // tp) * tp  # make_vocab_size_divisible_by 1
    if ours["embed_tokens.weight"].shape[0] != vocab:
        raise UserError(
            f"{model_dir}: embed_tokens has {ours['embed_tokens.weight'].shape[0]} rows, "
            f"config.json says vocab_size {vocab}"
        )
    for k in ("embed_tokens.weight", "lm_head.weight"):
        if k in ours:
            ours[k] = _pad_rows(ours[k], padded)
    shape = shape_of(dataclasses.replace(mc, vocab_size=padded))
    from mesh3d.checkpoint.nanotron_weights import write_nanotron_weights

    try:  # before any weight file
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise unwritable("--output", output, e) from None
    paths = write_nanotron_weights(output / "model", ours, shape, tp=tp, pp=pp)

    model_json = dataclasses.asdict(mc)
    model_json["vocab_size"] = padded
    mcj = output / "model_config.json"
    mcj.write_text(json.dumps(model_json))
    yaml_path = output / "config.yaml"
    save_config(cfg, yaml_path)
    return [*paths, mcj, yaml_path]


# --- a Hugging Face folder's family --------------------------------------------------


def hf_config_of(model_dir: Path):
    """(our model config, HF architecture) of the HF folder `model_dir`, or a UserError naming
    its model_type when mesh3d has no such family."""
    cfg_path = model_dir / "config.json"
    hf_cfg = _read_json_object(
        cfg_path, f"{model_dir} has no config.json; give a Hugging Face model folder"
    )
    sizes = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
             "vocab_size", "num_key_value_heads")  # fmt: skip
    for key in (k for k in sizes if hf_cfg.get(k) is not None):  # (null: the family's default)
        if type(hf_cfg[key]) is not int or hf_cfg[key] < 1:
            raise UserError(f"{cfg_path}: {key} {hf_cfg[key]!r} must be a whole number >= 1")
    found = spec_for_hf(hf_cfg)
    if found is None:
        raise UserError(
            f"{cfg_path}: model_type {hf_cfg.get('model_type')!r} (architectures "
            f"{hf_cfg.get('architectures')}) is not a family mesh3d converts; supported: "
            f"{', '.join(families())}"
        )
    return found[1].config_from_hf(hf_cfg, cfg_path), found[1]


# --- CLI -----------------------------------------------------------------------------------


def hf_model_of(checkpoint: str) -> str | None:
    """The `mesh3d.hf_model` a run's step folder (or checkpoints folder) was trained as."""
    try:
        step = resolve_step_dir(checkpoint, "--checkpoint")
        meta = json.loads((step / "checkpoint_metadata.json").read_text())
    except (UserError, OSError, ValueError):
        return None
    return ((meta.get("custom_metas") or {}).get("mesh3d") or {}).get("hf_model")
