"""Values computed from a config: padded vocab, global batch, the pipeline schedule, the run name."""

from __future__ import annotations

import datetime
import os

from mesh3d.config.schema import Config


def padded_vocab_size(cfg: Config) -> int:
    """Vocab rounded up to a multiple of tp * make_vocab_size_divisible_by
    (docs/nanotron-layout.md#parameter-names)."""
    multiple = cfg.parallelism.tp * cfg.model.make_vocab_size_divisible_by
    return -(-cfg.model.model_config.vocab_size // multiple) * multiple


def world_size(cfg: Config) -> int:
    """Processes the config's layout needs: dp * context_parallel_size * tp * pp."""
    p = cfg.parallelism
    return p.dp * max(p.context_parallel_size, 1) * p.tp * p.pp


def layout_text(cfg: Config) -> str:
    """The layout's degrees in words, e.g. "dp 2 x cp 2 x tp 2 x pp 1" (cp only when > 1)."""
    p = cfg.parallelism
    cp = f" x cp {p.context_parallel_size}" if p.context_parallel_size != 1 else ""
    return f"dp {p.dp}{cp} x tp {p.tp} x pp {p.pp}"


def global_batch_size(cfg: Config) -> int:
    """Samples per optimizer step: micro_batch_size * batch_accumulation_per_replica * dp."""
    t = cfg.tokens
    return t.micro_batch_size * t.batch_accumulation_per_replica * cfg.parallelism.dp


def stage_sequence_length(cfg: Config, stage) -> int:
    """A data stage's sequence length: its own `sequence_length`, or `tokens.sequence_length`."""
    return stage.sequence_length or cfg.tokens.sequence_length


def longest_sequence(cfg: Config) -> tuple[str, int]:
    """(key, length) of the longest sequence the run trains on: `tokens.sequence_length`, or
    the first stage (by start step) with a longer `sequence_length`."""
    key, longest = "tokens.sequence_length", cfg.tokens.sequence_length
    for s in cfg.data_stages or []:
        if stage_sequence_length(cfg, s) > longest:
            key, longest = f"data_stages[name={s.name!r}].sequence_length", s.sequence_length
    return key, longest


def max_sequence_length(cfg: Config) -> int:
    """The longest sequence the run trains on (`longest_sequence`): what memory is sized for."""
    return longest_sequence(cfg)[1]


def effective_pp_schedule(cfg: Config) -> str:
    """`mesh3d.pp_schedule` when set, else Nanotron's `parallelism.pp_engine` (afab | 1f1b)."""
    return cfg.mesh3d.pp_schedule or cfg.parallelism.pp_engine


def expand_run_name(run: str) -> str:
    """Nanotron HEAD's run placeholders: %date -> YYYYmmdd_HHMMSS, %jobid -> $SLURM_JOB_ID or local."""
    run = run.replace("%date", datetime.datetime.now().strftime("%Y%m%d_%H%M%S"))
    return run.replace("%jobid", os.environ.get("SLURM_JOB_ID", "local"))
