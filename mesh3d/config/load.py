"""Nanotron YAML <-> `Config`: strict parsing, the forms found in real configs, derived values, saving.

Unions are picked by their keys as Nanotron does, with a clear error where Nanotron guesses wrong
(`{name: adamW}` without Adam keys). Older forms (v0.1-v0.4) are rewritten first. The values
Nanotron derives in `__post_init__` are filled in, so a saved config shows them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import operator
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from mesh3d import extensions
from mesh3d.config.families import MESH3D_FAMILIES, family_of_config
from mesh3d.config.overrides import apply_to_dict, yaml_problem
from mesh3d.config.schema import (
    AdamWOptimizerArgs,
    Config,
    ExistingCheckpointInit,
    LlamaConfig,
    Mesh3dArgs,
    ModelConfig,
    MuonOptimizerArgs,
    NanosetDatasetsArgs,
    PretrainDatasetsArgs,
    RandomInit,
    SFTDatasetsArgs,
    SGDOptimizerArgs,
    SpectralMupInit,
)
from mesh3d.config.typecheck import Pickers, build, join, need_mapping, show
from mesh3d.errors import ConfigError

_ADAM_KEYS = ("adam_eps", "adam_beta1", "adam_beta2", "torch_adam_is_fused")
_INITS = {"std": RandomInit, "use_mup": SpectralMupInit, "path": ExistingCheckpointInit}
_OPTIMIZERS = {"adamw": AdamWOptimizerArgs, "sgd": SGDOptimizerArgs, "muon": MuonOptimizerArgs}


def _names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _lazy(module: str, name: str) -> type:
    return getattr(importlib.import_module(f"mesh3d.config.{module}"), name)


def _pick_model_config(value: Any, path: str) -> tuple[type, dict]:
    d = need_mapping(value, path)
    if "is_mamba_config" in d or d.keys() & {"d_model", "ssm_cfg"}:
        return _lazy("mamba", "MambaConfig"), d  # not in ModelConfig: loaded for a Mamba only
    if "is_llamoe_config" in d or d.keys() & {"moe_num_experts", "moe_capacity_factor"}:
        return _lazy("llamoe", "LlaMoEConfig"), d  # Nanotron's examples/moe
    if "is_llama_config" in d:
        return LlamaConfig, d
    from mesh3d.config.other_families import Qwen2Config, Starcoder2Config

    llama, qwen, star = _names(LlamaConfig), _names(Qwen2Config), _names(Starcoder2Config)
    for family in MESH3D_FAMILIES.values():  # mesh3d's own model_config.json of its checkpoint
        if family.marker in d:
            return family.config_class, d
    if "is_qwen2_config" in d:
        return Qwen2Config, d
    if "is_starcoder2_config" in d or d.keys() & (star - llama - qwen):
        return Starcoder2Config, d
    if d.keys() & (qwen - llama):
        return Qwen2Config, d
    return LlamaConfig, d


def _pick_init_method(value: Any, path: str) -> tuple[type, dict]:
    d = need_mapping(value, path)
    if "initializer_range" in d:  # Nanotron's examples/mamba init (not in InitMethod)
        return _lazy("mamba", "MambaInit"), d
    for key, cls in _INITS.items():
        if key in d:
            return cls, d
    raise ConfigError(
        f"`{path}` needs `std` (random init), `use_mup` (spectral muP), `initializer_range` "
        f"(Mamba's init) or `path` (weights of an existing checkpoint); got keys "
        f"{sorted(map(str, d))}"
    )


def _pick_optimizer_factory(value: Any, path: str) -> tuple[type, dict]:
    d = dict(need_mapping(value, path))
    name = d.get("name")
    if name is None and d.keys() & set(_ADAM_KEYS):
        name = "adamW"
    if not isinstance(name, str) or name.lower() not in _OPTIMIZERS:
        got = "no `name`" if name is None else f"name {show(name)}"
        raise ConfigError(f"`{join(path, 'name')}` must be adamW, sgd or muon; got {got}")
    cls = _OPTIMIZERS[name.lower()]
    d["name"] = cls.name  # the field's default: adamW, sgd or muon
    if cls is AdamWOptimizerArgs and (missing := [k for k in _ADAM_KEYS if k not in d]):
        raise ConfigError(
            f"missing required key `{join(path, missing[0])}`: adamW needs all of "
            f"{', '.join(_ADAM_KEYS)} (Nanotron would silently read this as SGD and then crash)"
        )
    return cls, d


def _pick_dataset(value: Any, path: str) -> tuple[type, dict]:
    d = need_mapping(value, path)
    if "dataset_folder" in d:
        return NanosetDatasetsArgs, _nanoset_forms(d, path)
    if "hf_dataset_or_datasets" in d:
        sft_only = _names(SFTDatasetsArgs) - _names(PretrainDatasetsArgs)
        return (SFTDatasetsArgs if d.keys() & sft_only else PretrainDatasetsArgs), d
    raise ConfigError(
        f"`{path}` needs `dataset_folder` (Nanoset) or `hf_dataset_or_datasets` (Hugging Face "
        f"datasets), or write `dataset: null` for dummy data; got keys {sorted(map(str, d))}"
    )


def _nanoset_forms(d: dict, path: str) -> dict:
    """`dataset_folder: str` -> [str] with weight 1; `{folder: weight}` -> folders + weights."""
    d = dict(d)
    folder = d["dataset_folder"]
    if isinstance(folder, str):
        d["dataset_folder"] = [folder]
        if d.get("dataset_weights") is None:
            d["dataset_weights"] = [1.0]
    elif isinstance(folder, dict):
        if d.get("dataset_weights") is not None:
            raise ConfigError(
                f"`{join(path, 'dataset_weights')}` is given and `{join(path, 'dataset_folder')}` "
                "is a {folder: weight} mapping; give the weights in one place only"
            )
        d["dataset_folder"], d["dataset_weights"] = list(folder), list(folder.values())
    if isinstance(d.get("dataset_read_path"), str):
        d["dataset_read_path"] = [d["dataset_read_path"]]
    return d


_PICKERS: Pickers = {
    frozenset({ModelConfig}): _pick_model_config,
    frozenset(_INITS.values()): _pick_init_method,
    frozenset(_OPTIMIZERS.values()): _pick_optimizer_factory,
    frozenset({PretrainDatasetsArgs, NanosetDatasetsArgs, SFTDatasetsArgs}): _pick_dataset,
}


def _upgrade_legacy(raw: dict) -> dict:
    """Rewrite v0.1-v0.4 forms (flat Adam keys, top-level `data:`) into the current schema."""
    raw = dict(raw)
    opt = raw.get("optimizer")
    if isinstance(opt, dict) and "optimizer_factory" not in opt and opt.keys() & set(_ADAM_KEYS):
        opt = dict(opt)
        factory = {"name": "adamW", **{k: opt.pop(k) for k in _ADAM_KEYS if k in opt}}
        raw["optimizer"] = dict(opt, optimizer_factory=factory)
    if "data" in raw:
        if raw.get("data_stages") is not None:
            raise ConfigError(
                "both `data` (the pre-v0.5 form) and `data_stages` are given; keep `data_stages`"
            )
        data = raw.pop("data")
        raw["data_stages"] = [dict(name="Stable Training Stage", start_training_step=1, data=data)]
    if raw.get("mesh3d", {}) is None:
        del raw["mesh3d"]
    return raw


def _resolve(cfg: Config) -> Config:
    """Fill what Nanotron derives in `__post_init__`, and normalize enum spellings."""
    p = cfg.parallelism
    p.tp_mode, p.pp_engine = p.tp_mode.upper(), p.pp_engine.lower()
    if cfg.mesh3d.pp_schedule is not None:
        cfg.mesh3d.pp_schedule = cfg.mesh3d.pp_schedule.lower()
    mc = cfg.model.model_config
    if hasattr(mc, "num_key_value_heads") and mc.num_key_value_heads is None:
        mc.num_key_value_heads = mc.num_attention_heads
    if hasattr(mc, "resolve"):  # a family's own derived values (config/llamoe.py)
        mc.resolve(cfg)
    family = MESH3D_FAMILIES.get(cfg.mesh3d.model_family)
    if family is not None and type(mc) is family.base:
        fields = {f.name: getattr(mc, f.name) for f in dataclasses.fields(mc)}
        own = {k: getattr(cfg.mesh3d, k) for k in family.keys}
        mc = cfg.model.model_config = family.config_class(**fields, **own)
    family = family_of_config(mc)
    if family is not None:  # also from model_config.json's form; `mesh3d:` keeps its own fields
        cfg.mesh3d.model_family = family.name
        for key in family.keys:
            ours = getattr(cfg.mesh3d, key)
            if ours not in (getattr(Mesh3dArgs, key), getattr(mc, key)):
                raise ConfigError(
                    f"`mesh3d.{key}` ({ours}) differs from `model.model_config.{key}` "
                    f"({getattr(mc, key)}); give it in one place"
                )
            setattr(cfg.mesh3d, key, getattr(mc, key))
    if isinstance(cfg.model.init_method, RandomInit):
        cfg.model.init_method.scaling_method = cfg.model.init_method.scaling_method.upper()
    if cfg.optimizer is not None:
        s = cfg.optimizer.learning_rate_scheduler
        if s.lr_decay_steps is None and cfg.tokens is not None:
            s.lr_decay_steps = max(0, cfg.tokens.train_steps - s.lr_warmup_steps)
            s.derived_decay = True  # not a field: `config_to_dict(derived=False)` leaves it null
        if s.min_decay_lr is None:
            s.min_decay_lr = s.learning_rate
    if cfg.data_stages is not None:
        cfg.data_stages.sort(key=lambda stage: stage.start_training_step)
    return cfg


def config_from_dict(d: dict) -> Config:
    """A typed, resolved `Config` from a mapping in Nanotron's YAML schema (plus `mesh3d:`).

    Example:

        cfg = mesh3d.config_from_dict(yaml.safe_load(open("cfg.yaml")))
    """
    if not isinstance(d, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {show(d)}")
    if isinstance(d.get("mesh3d"), dict) and isinstance(d["mesh3d"].get("hf_model"), str):
        d = extensions.load("hf_config").fill(d)
    return _resolve(build(Config, _upgrade_legacy(copy.deepcopy(d)), "", _PICKERS))


# keys in Nanotron's examples that its HEAD parser refuses: (section path, key, default)
_NOT_NANOTRON = ((("parallelism",), "moe_layer_recompute", False),
                 (("model", "model_config"), "interleaved_rotary", None))  # fmt: skip
# a mesh3d family's config is written as its base family's plus `mesh3d:` (config/families.py)
_FAMILY_ONLY = tuple(dict.fromkeys(
    k for f in MESH3D_FAMILIES.values() for k in (f.marker, *f.keys)))  # fmt: skip


def _drop_not_nanotron(d: dict, always: bool) -> None:
    for path, key, default in _NOT_NANOTRON:
        section = functools.reduce(operator.getitem, path, d)
        if key in section and (always or section[key] == default):
            del section[key]
    if d.get("doremi", 0) is None:  # only Nanotron's examples/doremi config class has it
        del d["doremi"]
    model_config = d["model"]["model_config"]
    for key in _FAMILY_ONLY:
        model_config.pop(key, None)


def config_to_dict(cfg: Config, derived: bool = True) -> dict:
    """Plain mapping of every field (as Nanotron writes); of `mesh3d:` and of `_NOT_NANOTRON`
    only the keys that differ from their defaults. `derived=False`: a value derived at load
    (`lr_decay_steps` from `train_steps`) stays null, so that it follows a later change."""
    d = dataclasses.asdict(cfg)
    if not derived and getattr(cfg.optimizer and cfg.optimizer.learning_rate_scheduler,
                               "derived_decay", False):  # fmt: skip
        d["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = None
    d["mesh3d"] = mesh3d_changes(cfg)
    if not d["mesh3d"]:
        del d["mesh3d"]
    _drop_not_nanotron(d, always=False)
    return d


def mesh3d_changes(cfg: Config) -> dict:
    """The `mesh3d:` settings that differ from their defaults ({} when none)."""
    default = dataclasses.asdict(Mesh3dArgs())
    return {k: v for k, v in dataclasses.asdict(cfg.mesh3d).items() if v != default[k]}


def nanotron_config_dict(cfg: Config, step: int | None = None, consumed: int | None = None) -> dict:
    """The config as Nanotron HEAD writes it into a checkpoint: step and consumed samples set,
    every stage's `sequence_length` filled, no key only mesh3d accepts."""
    d = dataclasses.asdict(cfg)
    del d["mesh3d"]
    _drop_not_nanotron(d, always=True)
    d["general"].update(step=step, consumed_train_samples=consumed)
    for stage in d["data_stages"] or []:
        if stage["sequence_length"] is None and cfg.tokens is not None:
            stage["sequence_length"] = cfg.tokens.sequence_length
    return d


def nanotron_config_yaml(cfg: Config, step: int | None = None, consumed: int | None = None) -> str:
    """`nanotron_config_dict` as YAML, keys sorted (a step folder's `config.yaml`)."""
    d = nanotron_config_dict(cfg, step, consumed)
    return yaml.safe_dump(d, sort_keys=True, default_flow_style=False)


def config_to_yaml(cfg: Config, derived: bool = True) -> str:
    """YAML as Nanotron writes it: block style, keys sorted at every level."""
    return yaml.safe_dump(config_to_dict(cfg, derived), sort_keys=True, default_flow_style=False)


# mesh3d's built-in default run: what `mesh3d train` (and `mesh3d plan`) use without a config
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def save_config(cfg: Config, path: str | Path, derived: bool = True) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(cfg, derived))


def apply_overrides(d_or_cfg: dict | Config, overrides: Sequence[str]) -> dict | Config:
    """Apply dotted `key=value` overrides; a mapping gives a new mapping, a Config a new Config
    (whose values derived at load, such as `lr_decay_steps`, stay as they were resolved).

    Example:

        cfg = mesh3d.apply_overrides(cfg, ["optimizer.zero_stage=1"])
    """
    if isinstance(overrides, str | bytes):  # read one character at a time otherwise
        raise TypeError(f"overrides are a list of 'key=value' strings: write [{overrides!r}]")
    if isinstance(d_or_cfg, Config):
        return config_from_dict(apply_to_dict(config_to_dict(d_or_cfg), overrides))
    if not isinstance(d_or_cfg, dict):
        raise TypeError(f"apply_overrides takes a mapping or a Config, not {type(d_or_cfg).__name__}"
                        "; for a file: mesh3d.load_config(path, overrides)")  # fmt: skip
    return apply_to_dict(_upgrade_legacy(copy.deepcopy(d_or_cfg)), overrides)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a Nanotron YAML file, apply dotted overrides, type and resolve it.

    Example:

        cfg = mesh3d.load_config("cfg.yaml", ["parallelism.dp=2", "tokens.train_steps=100"])
    """
    if not isinstance(path, str | Path):
        raise TypeError(f"load_config reads a file (a path), not {type(path).__name__}; for a "
                        "mapping: mesh3d.config_from_dict(mapping)")  # fmt: skip
    path = Path(path)
    if not path.is_file():
        text = str(path)
        if "." in text and "/" not in text and path.suffix not in (".yaml", ".yml", ".json"):
            raise ConfigError(  # `mesh3d train parallelism.dp`: an override without its value
                f"{text!r} is not a config file and has no `=value`: write an override as "
                f"{text}=VALUE (e.g. parallelism.dp=2)"
            )
        raise ConfigError(f"config file {path} does not exist or is not a file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(
            f"config file {path} is not valid YAML: {yaml_problem(e)}; fix the file there"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}); "
                          "give a YAML config file") from None  # fmt: skip
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {show(raw)}")
    raw = apply_overrides(raw, overrides)
    try:
        return config_from_dict(raw)
    except ConfigError as e:  # blamed on the override that set the key, else on the file
        key = re.match(r"[^`]*`([^`]+)`", str(e))
        keys = [o.split("=", 1)[0].strip() for o in overrides]
        given = key and next((o for o, k in zip(overrides, keys)
                              if key[1] == k or f"{k}.".startswith(f"{key[1]}.")  # its section
                              or key[1].startswith(k + ".")), None)  # fmt: skip
        raise ConfigError(f"override {given!r}: {e}" if given else f"{path}: {e}") from None


def model_config_from_dict(d: dict, path: str = "model.model_config"):
    """A typed model config from a mapping, such as a step folder's `model_config.json`."""
    cls, d = _pick_model_config(d, path)
    return build(cls, copy.deepcopy(d), path, _PICKERS)
