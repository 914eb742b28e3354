"""`mesh3d.hf_model`: a config whose model is a `transformers` causal LM folder (or hub id), trained
with the model's own modeling code (`mesh3d/train/hf_parts.py`).

The folder's config.json is the model: `model.model_config` is replaced by its sizes in
Nanotron's Llama form (vocabulary, hidden size, layers, heads, positions, tied embeddings), which
mesh3d's data, checks, plan and logs read, and `model.init_method` by a placeholder (the weights
come from the folder, or from transformers' own initialization when it holds none). What such a
run cannot do yet is refused here, in one line naming the key.
"""

from __future__ import annotations

import os

from mesh3d.errors import ConfigError

# `mesh3d:` keys a transformers model does not take yet: (key, its off value, why)
_NOT_YET = (("lora", None, "LoRA adapters"), ("float8", False, "float8 linears"),
            ("compile", False, "torch.compile of mesh3d's blocks"),
            ("fault_tolerance", None, "fault tolerance"), ("async_tp", False, "async TP"),
            ("hf_export", False, "the in-run export (use `mesh3d convert to-hf --checkpoint "
             "STEP`: it finds the model in the checkpoint)"))  # fmt: skip


def fill(d: dict) -> dict:
    """`d` (a config mapping) with `model.model_config` / `init_method` from `mesh3d.hf_model`."""
    source = os.fspath(d["mesh3d"]["hf_model"])
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "`mesh3d.hf_model` needs transformers: pip install transformers"
        ) from None
    config = from_pretrained(transformers.AutoConfig, source, "`mesh3d.hf_model`",
                             "a transformers config.json")  # fmt: skip
    for key, off, what in _NOT_YET:
        if (d.get("mesh3d") or {}).get(key, off) not in (off, None):
            raise ConfigError(f"`mesh3d.{key}`: {what} is not supported with mesh3d.hf_model yet")
    p = d.get("parallelism") or {}
    ep = p.get("expert_parallel_size") or 1
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if ep > 1 and (not experts or experts % ep or (p.get("dp") or 1) % ep):
        raise ConfigError(
            f"`parallelism.expert_parallel_size`: {ep} must divide parallelism.dp "
            f"({p.get('dp') or 1}) and the model's experts ({experts or 'none'})"
        )
    if (p.get("context_parallel_size") or 1) > 1 and (p.get("pp") or 1) > 1:
        raise ConfigError(
            "`parallelism.context_parallel_size`: with pp > 1 it is not supported for a "
            "transformers model (mesh3d.hf_model) yet; use pp 1 or context_parallel_size 1"
        )
    if (
        (p.get("pp") or 1) > 1
        and (p.get("tp") or 1) > 1
        and str(p.get("tp_mode", "")).upper() == "REDUCE_SCATTER"
    ):
        raise ConfigError(
            "`parallelism.tp_mode`: REDUCE_SCATTER (sequence parallelism) with pp > 1 is not "
            "supported with mesh3d.hf_model yet; use ALL_REDUCE, or pp 1"
        )
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not (heads and hidden and layers and getattr(config, "vocab_size", None)):
        raise ConfigError(
            f"`mesh3d.hf_model`: {type(config).__name__} of {os.fspath(source)!r} has no "
            "hidden_size / num_attention_heads / num_hidden_layers / vocab_size; it is not a "
            "decoder-only causal LM mesh3d can train"
        )
    model = dict(d.get("model") or {})
    model["model_config"] = {
        "vocab_size": config.vocab_size, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(config, "intermediate_size", None) or 4 * hidden,
        "max_position_embeddings": getattr(config, "max_position_embeddings", None) or 2048,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }  # fmt: skip
    model["init_method"] = {"std": getattr(config, "initializer_range", 0.02)}
    model["make_vocab_size_divisible_by"] = 1  # the model's own vocabulary, as it is
    return {**d, "model": model}


def from_pretrained(cls, source: str | os.PathLike, label: str, what: str):
    """`cls.from_pretrained(source)` (a transformers Auto class): a local folder, or a hub id
    from the cache, else from the hub; a `ConfigError` line "`label`: ... neither a folder holding
    `what` nor a hub id (why)" when none gives it."""
    source = os.fspath(source)

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{label}: {source!r} is neither a folder holding {what} nor a hub id "
                           f"({why})")  # fmt: skip

    if os.path.exists(source):  # a folder: no network
        try:
            return cls.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as err:
            config = os.path.exists(os.path.join(source, "config.json"))
            raise refuse(_first_line(err) if config else "it has no config.json") from None
    host = _hub_host()  # None: offline, where the hub client would retry for about 30 s
    if host is None and not _cached(source):
        raise refuse("not in the hub cache, and the hub cannot be reached from here; give a "
                     "local folder")  # fmt: skip
    try:
        return cls.from_pretrained(source, local_files_only=host is None)
    except (OSError, ValueError) as err:
        raise refuse(f"{host or 'the hub cache'}: {_first_line(err)}") from None


def _cached(repo_id: str) -> bool:
    """Whether the hub cache holds `repo_id`'s config.json."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a repo id at all
        return False


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _hub_host() -> str | None:
    """The hub's host name when it resolves and the hub is not switched off (HF_HUB_OFFLINE),
    else None: a machine without network is told so at once, not after the hub client's
    retries (about 30 s)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    if constants.HF_HUB_OFFLINE or not host:
        return None
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return None
    return host
