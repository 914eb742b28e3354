"""Cross-checks of a typed config, run on every rank before any process group (no torch import).

Each message names the key(s), the values and the fix."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Iterator
from operator import attrgetter
from pathlib import PurePosixPath

from mesh3d import extensions
from mesh3d.checks.checkpoint_checks import checkpoint_errors, s3_errors
from mesh3d.checks.data_checks import (
    data_stage_errors,
    sequence_split_errors,
    stage_length_errors,
    unsupported_data,
)
from mesh3d.checks.guard_checks import loss_spike_errors
from mesh3d.checks.optim_checks import lr_errors, lr_warnings, optimizer_errors
from mesh3d.checks.size_checks import scale_errors, too_large
from mesh3d.config.derive import effective_pp_schedule, longest_sequence
from mesh3d.config.families import MESH3D_FAMILIES
from mesh3d.config.schema import Config, Mesh3dArgs, RandomInit, SpectralMupInit
from mesh3d.errors import ConfigError, not_supported_yet
from mesh3d.models.activations import TRAIN_DTYPES
from mesh3d.models.registry import model_shape, spec_of
from mesh3d.parallel.pipeline_layout import SCHEDULES, microbatches_needed, split_by_cost

DTYPES = ("float32", "float64", "complex64", "complex128", "float16", "bfloat16")
DTYPES += ("uint8", "int8", "int16", "int32", "int64", "bool")  # Nanotron's list
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")
SCALING_METHODS = ("NONE", "NUM_LAYERS", "LAYER_INDEX", "MODEL_SCALE")
EXISTING_CHECKPOINTS = ("error", "resume", "overwrite")
MC = "model.model_config"
SIZES = ("parallelism.dp", "parallelism.tp", "parallelism.pp", "mesh3d.pp_virtual_stages",
         "model.make_vocab_size_divisible_by", "tokens.sequence_length", "tokens.train_steps",
         "tokens.micro_batch_size", "tokens.batch_accumulation_per_replica")  # fmt: skip


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Raise one ConfigError naming every problem; `world_size` None skips the layout product check.

    Example:

        mesh3d.validate(cfg, world_size=8)   # raises ConfigError listing every problem
    """
    errors = validation_errors(cfg, world_size)
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} problems in the config:\n  - " + "\n  - ".join(errors))


def config_warnings(cfg: Config) -> list[str]:
    """What a valid config asks for that the user probably did not mean, one line per cause.

    Example:

        for line in mesh3d.checks.config_warnings(cfg): print("warning:", line)
    """
    if validation_errors(cfg):
        return []
    warnings = list(lr_warnings(cfg)) + list(getattr(cfg.model.model_config, "notes", []))
    t = cfg.tokens
    if t.val_check_interval > t.train_steps > 0 and t.limit_val_batches > 0:
        warnings.append(
            f"`tokens.val_check_interval` ({t.val_check_interval}) is larger than "
            f"`tokens.train_steps` ({t.train_steps}): validating once, at the last step "
            f"({t.train_steps}); set val_check_interval to -1 for none"
        )
    if t.val_check_interval <= 0 and t.limit_val_batches > 0:
        warnings.append(
            f"`tokens.limit_val_batches` is {t.limit_val_batches} but `tokens.val_check_interval` "
            f"is {t.val_check_interval} (never): no validation runs (as in Nanotron); set "
            "val_check_interval to evaluate every that many steps, or limit_val_batches to 0"
        )
    named = cfg.s3_upload.s5cmd_path if cfg.s3_upload is not None else None
    if named and shutil.which(named) is None:  # validation passed: s5cmd is on PATH
        warnings.append(
            f"`s3_upload.s5cmd_path` {named!r} is not found: using {shutil.which('s5cmd')} "
            "(s5cmd on PATH); set s5cmd_path to the binary to use, or null"
        )
    mc = cfg.model.model_config
    positions, (key, seq) = getattr(mc, "max_position_embeddings", None), longest_sequence(cfg)
    if getattr(mc, "is_llama_config", False) and positions is not None and 1 <= positions < seq:
        warnings.append(
            f"`model.model_config.max_position_embeddings` ({positions}) is smaller than `{key}` "
            f"({seq}): trained anyway (mesh3d's rotary positions have no table, Nanotron's Llama "
            "table grows), but a Hugging Face export keeps the smaller limit; raise it to at "
            f"least {seq} to match"
        )
    return warnings


WARNED_ENV = "MESH3D_CONFIG_WARNED"  # set once the warnings are out: the ranks started after


def warn_once(cfg: Config) -> None:
    """Log `config_warnings` once per launch (the launcher, or world rank 0 under torchrun)."""
    from mesh3d.log import logger

    if os.environ.get(WARNED_ENV) or int(os.environ.get("RANK", 0)) != 0:
        return
    for line in config_warnings(cfg):
        logger.warning(line)
    os.environ[WARNED_ENV] = "1"


def validation_errors(cfg: Config, world_size: int | None = None) -> list[str]:
    """Every problem as one message; checks that would divide by a bad size run only if sizes are sane."""
    if not isinstance(cfg, Config):  # `mesh3d.train("cfg.yaml")`: train, validate, make_plan, Run
        raise TypeError(f"a mesh3d.Config is needed, not {type(cfg).__name__} {cfg!r:.60}; use "
                        "mesh3d.load_config(path) or mesh3d.config_from_dict(mapping)")  # fmt: skip
    for first in (_sections, _sizes):
        if errors := list(first(cfg)):
            return errors
    checks = (_model, _pipeline, optimizer_errors, lr_errors, data_stage_errors, _run, _choices,
              _unsupported, _optional, scale_errors,
              loss_spike_errors, checkpoint_errors, s3_errors, _run_name)  # fmt: skip
    errors = list(_layout(cfg, world_size))
    for check in checks:
        errors.extend(check(cfg))
    if cfg.mesh3d.lora is not None and not errors:  # its plan needs a sane model config
        errors.extend(extensions.load("lora").config_errors(cfg))
    if cfg.mesh3d.fault_tolerance is not None:  # torchft replica groups
        errors.extend(extensions.load("ft_checks").fault_tolerance_errors(cfg))
    if cfg.doremi is not None:  # Nanotron's examples/doremi section (docs/doremi.md)
        errors.extend(extensions.load("doremi_checks").doremi_errors(cfg))
    return errors


def _sections(cfg: Config) -> Iterator[str]:
    if cfg.tokens is None:
        yield "section `tokens` is missing; mesh3d needs sequence_length, train_steps, micro_batch_size and batch_accumulation_per_replica"
    if cfg.optimizer is None:
        yield "section `optimizer` is missing; mesh3d needs optimizer_factory, zero_stage, weight_decay, accumulate_grad_in_fp32 and learning_rate_scheduler"


def _sizes(cfg: Config) -> Iterator[str]:
    mc = cfg.model.model_config
    sizes = {key: attrgetter(key)(cfg) for key in SIZES}
    with contextlib.suppress(ConfigError):  # an unsupported family: `_unsupported` names it
        sizes.update(spec_of(mc).config_sizes(mc))
    for key, value in sizes.items():
        if value < 1:
            yield f"`{key}` must be >= 1, got {value}"
        elif message := too_large(key, value):
            yield message


def _layout(cfg: Config, world_size: int | None) -> Iterator[str]:
    p = cfg.parallelism
    cp = p.context_parallel_size
    product = p.dp * p.tp * p.pp * max(cp, 1)
    if world_size is not None and product != world_size:  # cp named even at 1: it counts too
        yield (
            f"parallelism.dp ({p.dp}) x tp ({p.tp}) x pp ({p.pp}) x context_parallel_size ({cp}) "
            f"= {product}, but the world size is {world_size}; change "
            f"parallelism.dp/context_parallel_size/tp/pp so the product is {world_size}, or "
            f"launch with --nproc_per_node={product}"
        )
    yield from sequence_split_errors(
        "tokens.sequence_length", cfg.tokens.sequence_length, p, " (a balanced causal split)"
    )
    for k in ("expert_parallel_size", "context_parallel_size"):
        if getattr(p, k) < 1:
            yield f"`parallelism.{k}` must be >= 1 (1 means off), got {getattr(p, k)}"


def _model(cfg: Config) -> Iterator[str]:
    m = cfg.model
    if m.dtype not in DTYPES:
        yield f"`model.dtype` {m.dtype!r} is not a dtype; use one of {', '.join(DTYPES)}"
    elif m.dtype not in TRAIN_DTYPES:
        yield f"`model.dtype` {m.dtype!r} cannot train; use float32, bfloat16 or float16"
    init = m.init_method
    if isinstance(init, RandomInit):
        if init.std < 0:
            yield f"`model.init_method.std` must be >= 0, got {init.std}"
        if init.scaling_method not in SCALING_METHODS:
            yield f"`model.init_method.scaling_method` {init.scaling_method!r} is not one of {', '.join(SCALING_METHODS)}"
    for key, owner in (("model.init_method", init), (MC, m.model_config)):  # (Mamba's init too)
        if (getattr(owner, "initializer_range", 0) or 0) < 0:
            yield f"`{key}.initializer_range` must be >= 0 (a std), got {owner.initializer_range}"
    if m.ddp_bucket_cap_mb < 0:
        yield f"`model.ddp_bucket_cap_mb` must be >= 0, got {m.ddp_bucket_cap_mb}"
    try:
        spec = spec_of(m.model_config)
    except ConfigError:
        return  # `_unsupported` names the family
    yield from spec.config_errors(cfg)


def _pipeline(cfg: Config) -> Iterator[str]:
    p, v = cfg.parallelism, cfg.mesh3d.pp_virtual_stages
    if p.pp_engine not in ("afab", "1f1b"):
        yield f"`parallelism.pp_engine` {p.pp_engine!r} must be afab or 1f1b (Nanotron's engines); set mesh3d.pp_schedule for the others"
        if cfg.mesh3d.pp_schedule is None:
            return  # the schedule is that pp_engine: no second message naming mesh3d.pp_schedule
    sched = effective_pp_schedule(cfg)
    if sched not in SCHEDULES:
        yield f"`mesh3d.pp_schedule` {sched!r} is not a pipeline schedule; use one of {', '.join(SCHEDULES)}"
        return
    traits = SCHEDULES[sched]
    several = [name for name, t in SCHEDULES.items() if t.multi_stage]
    if traits.v_shape and v != 2:
        yield f"`mesh3d.pp_virtual_stages` ({v}) must be 2 for the V-shaped schedule {sched}"
    if not traits.multi_stage and v != 1:
        yield (
            f"`mesh3d.pp_virtual_stages` ({v}) needs a schedule with several stages per rank; set "
            f"mesh3d.pp_schedule to one of {', '.join(several)}, or pp_virtual_stages to 1"
        )
    stages, layers = p.pp * v, cfg.model.model_config.num_hidden_layers
    if layers < stages:
        yield (
            f"`{MC}.num_hidden_layers` ({layers}) is less than the number of pipeline stages "
            f"pp ({p.pp}) x mesh3d.pp_virtual_stages ({v}) = {stages}; every stage needs a layer"
        )
    n, key = cfg.tokens.batch_accumulation_per_replica, "tokens.batch_accumulation_per_replica"
    if p.pp == 1:
        return
    # the trainer's layer split, so an empty stage fails here (hf_model's: `train/hf_parts.py`)
    if layers >= stages and not cfg.mesh3d.hf_model:
        try:
            split_by_cost(*spec_of(cfg.model.model_config).pipeline_costs(model_shape(cfg)), stages)
        except ConfigError as e:
            yield str(e)
    need = microbatches_needed(sched, p.pp, v)
    # "pp-1": Nanotron's 1F1B rule; with n < pp it runs all forwards then all backwards
    what = {"stages": "stages (pp x pp_virtual_stages)", "pp-1": "pp - 1", "pp": "pp"}
    if n < need:
        yield (
            f"`{key}` ({n}) is the number of microbatches per step; the {sched} pipeline schedule "
            f"needs at least {what[traits.min_microbatches]} = {need}; raise it to {need} or use "
            "pp_engine: afab"
        )
    elif traits.rounds and n % max(1, n // p.pp):
        yield (
            f"`{key}` ({n}) must be a multiple of the number of rounds {n} // pp ({p.pp}) = "
            f"{n // p.pp} for {sched}, which runs microbatches in rounds; use a multiple of pp"
        )


def _run_name(cfg: Config) -> Iterator[str]:
    run = cfg.general.run  # it names the folder runs/<run>/
    parts = PurePosixPath(run.replace("\\", "/")).parts
    if not run.strip() or run.startswith(("/", "\\")) or ".." in parts or set(parts) <= {"."}:
        yield (f"`general.run` {run!r} must name a folder inside runs/ (runs/<run>/): not empty, "
               "not absolute, no `..` parts (a/b is fine)")  # fmt: skip


def _run(cfg: Config) -> Iterator[str]:
    """Evaluation limits, the checkpoint interval and mesh3d's fail-safe settings."""
    for k in ("limit_val_batches", "limit_test_batches"):
        if getattr(cfg.tokens, k) < 0:
            yield f"`tokens.{k}` must be >= 0, got {getattr(cfg.tokens, k)}"
    # held-out batches with no interval are only warned about (`config_warnings`), as Nanotron
    every, batches = cfg.tokens.val_check_interval, cfg.tokens.limit_val_batches
    if every < -1:
        yield (
            f"`tokens.val_check_interval` must be -1 or 0 (no validation) or a number of steps "
            f">= 1, got {every}"
        )
    elif every > 0 and batches == 0:
        yield (
            f"`tokens.val_check_interval` is {every} but `tokens.limit_val_batches` is 0, so "
            "validation would run on no batches: set limit_val_batches to the number of held-out "
            "global batches per evaluation (e.g. 4), or val_check_interval to -1"
        )
    ck = cfg.checkpoints
    if ck is not None and ck.checkpoint_interval < 1:
        yield f"`checkpoints.checkpoint_interval` must be >= 1 (save every that many steps), got {ck.checkpoint_interval}"
    m = cfg.mesh3d
    timeouts = {k: getattr(m, k) for k in ("collective_timeout_s", "checkpoint_timeout_s")}
    bad = {k: s for k, s in timeouts.items() if not (math.isfinite(s) and s > 0)}
    for k, seconds in bad.items():
        yield f"`mesh3d.{k}` must be a finite number of seconds > 0, got {seconds}"
    if not bad and m.checkpoint_timeout_s < m.collective_timeout_s:
        yield (
            f"`mesh3d.checkpoint_timeout_s` ({m.checkpoint_timeout_s}) is less than "
            f"`mesh3d.collective_timeout_s` ({m.collective_timeout_s}); a save must not time out "
            "sooner than a normal collective: raise checkpoint_timeout_s or lower collective_timeout_s"
        )
    if m.skip_nonfinite_steps < 0:
        yield f"`mesh3d.skip_nonfinite_steps` must be >= 0 (0 stops at the first non-finite step), got {m.skip_nonfinite_steps}"


def _choices(cfg: Config) -> Iterator[str]:
    choices = {
        "parallelism.tp_mode": (cfg.parallelism.tp_mode, ("ALL_REDUCE", "REDUCE_SCATTER")),
        "logging.log_level": (cfg.logging.log_level, LOG_LEVELS),
        "logging.log_level_replica": (cfg.logging.log_level_replica, LOG_LEVELS),
        "mesh3d.device": (cfg.mesh3d.device, ("auto", "cpu", "cuda")),
        "mesh3d.attention": (cfg.mesh3d.attention, ("auto", "sdpa", "flash")),
        "mesh3d.dummy_data": (cfg.mesh3d.dummy_data, ("random", "learnable")),
        "mesh3d.sft_assistant_turns": (cfg.mesh3d.sft_assistant_turns, ("all", "last")),
        "mesh3d.console": (cfg.mesh3d.console, ("auto", "nanotron", "compact")),
        "mesh3d.model_family": (cfg.mesh3d.model_family, (None, *MESH3D_FAMILIES)),
        "mesh3d.existing_checkpoints": (cfg.mesh3d.existing_checkpoints, EXISTING_CHECKPOINTS),
        "mesh3d.eval_failure": (cfg.mesh3d.eval_failure, ("continue", "stop")),
        "mesh3d.eval_engine": (cfg.mesh3d.eval_engine, ("lm-eval", "lighteval")),
    }
    if cfg.metrics_logging is not None:
        choices["metrics_logging.log_level"] = (cfg.metrics_logging.log_level, (0, 1))
        if cfg.metrics_logging.log_detail_interval < 1:
            yield f"`metrics_logging.log_detail_interval` must be >= 1, got {cfg.metrics_logging.log_detail_interval}"
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            yield f"`{key}` {value!r} is not one of {shown}"
    if cfg.logging.iteration_step_info_interval < 1:
        yield f"`logging.iteration_step_info_interval` must be >= 1, got {cfg.logging.iteration_step_info_interval}"


def _family_keys(cfg: Config) -> Iterator[str]:
    """`mesh3d.model_family` needs its base family's model_config; a family's keys need it."""
    chosen = MESH3D_FAMILIES.get(cfg.mesh3d.model_family)
    mc = cfg.model.model_config
    if chosen is not None and not isinstance(mc, chosen.base):
        base = chosen.base.__name__.removesuffix("Config")
        yield (
            f"`mesh3d.model_family: {chosen.name}` reads a {base} model_config "
            f"(is_{base.lower()}_config: true) as {chosen.name}; this one is {type(mc).__name__}"
        )
    for family in MESH3D_FAMILIES.values():
        for key in family.keys:
            if family is not chosen and getattr(cfg.mesh3d, key) != getattr(Mesh3dArgs, key):
                yield (f"`mesh3d.{key}` is only for `mesh3d.model_family: {family.name}`; "
                       "remove it or set the family")  # fmt: skip


def _optional(cfg: Config) -> Iterator[str]:
    """The checks of optional capabilities, loaded only when configured."""
    m = cfg.mesh3d  # (recompute_layer alone is a bool: nothing to check)
    if any(x is not None for x in (cfg.profiler, m.stream_shards, m.recompute, m.dp_shard)) or (
        m.recompute_every != 1 or m.full_shard
    ):
        from mesh3d.checks.run_checks import run_errors

        yield from run_errors(cfg)
    if cfg.parallelism.expert_parallel_size > 1:
        yield from extensions.load("moe_checks").expert_parallel_errors(cfg)
    if cfg.mesh3d.float8 or cfg.mesh3d.async_tp:
        yield from extensions.load("speed_checks").speed_errors(cfg)


def _unsupported(cfg: Config) -> Iterator[str]:
    """Nanotron settings mesh3d does not implement yet; delete a line when its feature lands."""
    m = cfg.model
    if cfg.tokens is not None and cfg.tokens.limit_test_batches > 0:
        yield not_supported_yet("tokens.limit_test_batches", "there is no test pass; set it to 0")
    if cfg.lighteval is not None or cfg.mesh3d.eval_mode != "in_run":  # checked when given
        from mesh3d.checks.eval_checks import eval_errors

        yield from eval_errors(cfg)
    try:
        spec_of(m.model_config)
    except ConfigError as e:
        yield f"`model.model_config`: {e}"
    yield from _family_keys(cfg)
    if getattr(m.model_config, "moe_config", None) is not None:
        yield from extensions.load("moe_checks").moe_errors(cfg, m.model_config)
    if isinstance(m.init_method, SpectralMupInit):
        try:
            extensions.load("mup").mup_rules(
                spec_of(m.model_config), model_shape(cfg), m.model_config.vocab_size
            )
        except ConfigError as e:
            yield str(e)
    scaling = getattr(m.init_method, "scaling_method", None)
    if scaling in ("LAYER_INDEX", "MODEL_SCALE"):
        yield not_supported_yet(
            "model.init_method.scaling_method", f"{scaling}; use NUM_LAYERS or NONE"
        )
    for stage in cfg.data_stages or []:
        yield from unsupported_data(stage)
    yield from stage_length_errors(cfg)
