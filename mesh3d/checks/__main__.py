"""Check a config before launching: `mesh3d config [CONFIG] [--world-size N] [key=value ...]`.

Loads the file, applies the dotted overrides, validates it (for `--world-size`, default
dp x cp x tp x pp) and prints the resolved YAML; exit 0. A problem prints `error: ...` and exits 2.
Without CONFIG it checks mesh3d's built-in default run (what `mesh3d train` trains without one).
"""

from __future__ import annotations

import argparse
import sys

from mesh3d.checks.validate import config_warnings, validate
from mesh3d.config.load import DEFAULT_CONFIG, config_to_yaml, load_config
from mesh3d.errors import UserError, exit_on_user_error


@exit_on_user_error
def main(argv: list[str] | None = None, data_check=None, default_data=None) -> None:
    """`data_check(cfg)`: opens every data stage's dataset and the tokenizer, raising a
    UserError (`mesh3d config --check-data`); `default_data()`: the overrides that point the
    default run at its prepared data (as `mesh3d train` does). Both given by `mesh3d.cli`, which
    sits above data/."""
    ap = argparse.ArgumentParser(
        prog="mesh3d config", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    ap.add_argument("config", nargs="?",
                    help="Nanotron YAML config file (default: the built-in run `mesh3d train` "
                    "trains without a config)")  # fmt: skip
    ap.add_argument(
        "--world-size", type=int, help="number of processes (default: dp x cp x tp x pp)"
    )
    ap.add_argument(
        "--check-data",
        action="store_true",
        help="also open every data stage's dataset folder and the tokenizer (as a run starts)",
    )
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallelism.tp=2")
    args = ap.parse_intermixed_args(argv)
    if args.config and "=" in args.config:  # `mesh3d config parallelism.tp=2`: no CONFIG
        args.overrides.insert(0, args.config)
        args.config = None
    if args.config is not None and not args.config.strip():
        raise UserError(f"CONFIG {args.config!r} is empty (an unset variable?); give a config "
                        "file, or leave it out to check the built-in default run")  # fmt: skip
    if args.world_size is not None and args.world_size < 1:
        raise UserError(f"--world-size {args.world_size} must be >= 1 (the number of processes)")
    if args.config is None:
        sys.stderr.write(
            f"no config given: checking mesh3d's built-in default run ({DEFAULT_CONFIG}, what "
            "`mesh3d train` trains without a config)\n"
        )
        if args.check_data and default_data is not None:  # its data, prepared once
            args.overrides[:0] = default_data()
    cfg = load_config(args.config or DEFAULT_CONFIG, args.overrides)
    validate(cfg, world_size=args.world_size)
    if args.check_data:
        if data_check is None:
            raise UserError(
                "--check-data needs the data code: run it as `mesh3d config --check-data`"
            )
        data_check(cfg)
    for line in config_warnings(cfg):
        sys.stderr.write(f"warning: {line}\n")
    sys.stdout.write(config_to_yaml(cfg))


if __name__ == "__main__":
    main()
