"""`mesh3d train [CONFIG] [key=value ...]`: train, starting the processes the config asks for.

    mesh3d train                                 # the default run: real text, CPU, minutes
    mesh3d train cfg.yaml parallelism.dp=2       # dp x cp x tp x pp processes here
    torchrun --nproc_per_node=8 -m mesh3d.launch cfg.yaml    # under a launcher: one rank each

Outside a launcher, `mesh3d train` checks the config first (a mistake prints one `error:` line
and exits 2 before anything starts), then runs one process in place, or starts dp x cp x tp x pp
local processes with torch's elastic launcher used as a library (what torchrun does). Under
torchrun or Slurm (RANK set) it is one rank. Without CONFIG it prepares the default run's data
once (`mesh3d/data/corpus.py`) and trains `mesh3d/configs/default.yaml` on it.

Every run writes `runs/<run name>/metrics.jsonl` (or `--metrics-file`) and, at the end, its plot
beside it and a summary (`mesh3d/summary.py`). Exit codes are those of
`mesh3d/errors.py`; a failing rank's own `error:` line is the only message.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from mesh3d.checks import validate, warn_once
from mesh3d.config import DEFAULT_CONFIG, expand_run_name, load_config, world_size
from mesh3d.errors import PeerError, UserError, decided_alike, exit_on_user_error
from mesh3d.log import launcher_lines, logger, setup_launcher_logging

LAUNCHED_ENV = "MESH3D_LAUNCHED"  # set in the ranks `mesh3d train` starts itself


def _split(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="mesh3d train", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("config", nargs="?", help="Nanotron YAML config (default: the built-in run)")
    ap.add_argument("--config-file", "--config", dest="config_file", help="same as CONFIG")
    ap.add_argument("--metrics-file", help="JSON lines, one per logged iteration "
                    "(default: runs/<run name>/metrics.jsonl)")  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallelism.dp=2")
    args = ap.parse_intermixed_args(argv)
    if args.config and "=" in args.config:  # `mesh3d train tokens.train_steps=5`: no CONFIG
        args.overrides.insert(0, args.config)
        args.config = None
    if args.config_file is not None and args.config is not None:  # it would be dropped
        raise UserError(f"{args.config!r} is no override (KEY=VALUE), and --config-file "
                        f"{args.config_file} names the config: give it once, overrides as KEY=VALUE")  # fmt: skip
    for flag, value in (("--config-file", args.config_file), ("--metrics-file", args.metrics_file)):
        if value is not None and not value.strip():  # `--config-file "$CFG"`, CFG unset
            raise UserError(f"{flag} {value!r} is empty; give a file, or leave the flag out")
    args.config = args.config_file or args.config
    if args.config is not None and not args.config.strip():  # `mesh3d train "$CFG"`, CFG unset
        raise UserError(f"CONFIG {args.config!r} is empty; give a file, or none for the default")
    return args


def _resolved(args: argparse.Namespace) -> tuple[str, list[str]]:
    """(config path, overrides) with what this launch fixes for every rank: the run name
    (expanded once), the default run's data, and the metrics file."""
    overrides = list(args.overrides)
    if args.config is None:
        from mesh3d.data.corpus import default_run_overrides

        overrides = default_run_overrides() + overrides
    path = args.config or str(DEFAULT_CONFIG)
    cfg = load_config(path, overrides)
    run = _resumed_run_name(cfg) or expand_run_name(cfg.general.run)
    overrides.append(f"general.run={json.dumps(run)}")  # quoted: a YAML string, even empty
    ck = cfg.checkpoints  # the default's folder follows its run name unless a key moved it
    if (
        args.config is None
        and ck is not None
        and str(ck.checkpoints_path) == "runs/default/checkpoints"
    ):
        overrides.append(f"checkpoints.checkpoints_path=runs/{run}/checkpoints")
    return path, overrides


def _resumed_run_name(cfg) -> str | None:
    """The run name of the checkpoint this launch resumes from, when the config's name has a
    placeholder (`%date`, `%jobid`), so a resumed run keeps its metrics, plot and W&B run. None
    for a fixed name, a fresh start, or a checkpoint not readable here (the run's checks say)."""
    import yaml

    from mesh3d.checkpoint.training import resolve_step_dir

    ck = cfg.checkpoints
    if "%" not in cfg.general.run or ck is None:
        return None
    resume = ck.resume_checkpoint_path
    if resume is None and cfg.mesh3d.existing_checkpoints == "resume":
        resume = ck.checkpoints_path
    if resume is None or str(resume).startswith("s3://"):
        return None
    try:
        stored = yaml.safe_load((resolve_step_dir(resume) / "config.yaml").read_text())
        name = stored["general"]["run"]
    except (UserError, OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    return name if isinstance(name, str) and name and "%" not in name else None


def _resolved_on_ranks(args: argparse.Namespace) -> tuple[str, list[str], str]:
    """A rank that torchrun or Slurm started: the config checked before any collective, then
    world rank 0's run name for every rank and the same metrics file as `mesh3d train`."""
    from mesh3d.mesh import init_distributed, share

    shown = launcher_lines() if int(os.environ["RANK"]) == 0 else contextlib.nullcontext()
    with shown:  # rank 0 shows what the launcher of `mesh3d train` shows before the run
        with decided_alike():  # the same file and overrides on every rank
            path, overrides = _resolved(args)
            cfg = load_config(path, overrides)
            validate(cfg, world_size=int(os.environ["WORLD_SIZE"]))
        warn_once(cfg)
        logger.info(where_it_writes(cfg, args.metrics_file, args.config is None))
    init_distributed(timeout_s=cfg.mesh3d.collective_timeout_s, device=cfg.mesh3d.device)
    overrides = share(overrides)  # rank 0's (a run name expanded once)
    run = load_config(path, overrides).general.run
    return path, overrides, args.metrics_file or f"runs/{run}/metrics.jsonl"


def where_it_writes(cfg, metrics_file: str | None, default_run: bool) -> str:
    """The launcher's line naming where the run writes, as absolute paths (and for the default
    run the cache folder of its prepared data)."""
    metrics = Path(metrics_file or f"runs/{cfg.general.run}/metrics.jsonl").resolve()
    line = f"writing {metrics} (and its plot beside it)"
    if cfg.checkpoints is not None:
        ck = str(cfg.checkpoints.checkpoints_path)
        line += f", checkpoints in {ck if ck.startswith('s3://') else Path(ck).resolve()}"
    if default_run:
        from mesh3d.data.corpus import cache_root

        line += (
            f"; the default run's data is prepared once into {cache_root().resolve()} "
            "(set MESH3D_CACHE to use another folder)"
        )
    return line


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = _split(sys.argv[1:] if argv is None else argv)
    is_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if is_rank and os.environ.get(LAUNCHED_ENV):  # started by `_launch`: all resolved there
        return run_rank(args.config, list(args.overrides), args.metrics_file)
    if is_rank:  # under torchrun / Slurm: one rank, resolved as `mesh3d train` would
        return run_rank(*_resolved_on_ranks(args))
    setup_launcher_logging()  # the default run's data preparation is shown
    path, overrides = _resolved(args)
    cfg = load_config(path, overrides)
    world = world_size(cfg)
    validate(cfg, world_size=world)  # before any process starts: one message, exit 2
    warn_once(cfg)
    metrics = args.metrics_file or f"runs/{cfg.general.run}/metrics.jsonl"
    logger.info(where_it_writes(cfg, metrics, args.config is None))
    if world == 1:  # in this process: a one-process world, no launcher
        return run_rank(path, overrides, metrics)
    _launch(world, path, overrides, metrics)


def run_rank(path: str, overrides: list[str], metrics_file: str | None) -> None:
    """One rank's run (the launched processes, torchrun's ranks, and a one-process run)."""
    from mesh3d.mesh import shutdown_distributed
    from mesh3d.summary import finish
    from mesh3d.train.loop import train

    with decided_alike():  # the same file and overrides on every rank
        cfg = load_config(path, overrides)
    try:
        finish(cfg, train(cfg, metrics_file=metrics_file), metrics_file)
    except PeerError:
        raise  # tearing down a group whose peers are gone can hang: just exit
    except BaseException:
        shutdown_distributed(wait=False)
        raise
    shutdown_distributed(wait=True)


def _launch(world: int, path: str, overrides: list[str], metrics_file: str) -> None:
    """`world` local ranks of `python -m mesh3d.launch`, through torch's elastic agent."""
    from mesh3d.agent import run_agent

    os.environ[LAUNCHED_ENV] = "1"  # the ranks inherit it: everything is resolved here
    try:
        run_agent(["-m", "mesh3d.launch", path, "--metrics-file", metrics_file, *overrides], world)
    finally:
        os.environ.pop(LAUNCHED_ENV, None)


if __name__ == "__main__":
    main()
