"""Pre-flight plan of a run: `python -m mesh3d.plan CONFIG [--world-size N] [--json] [key=value ...]`.

Prints the text report of `format_plan`, or with `--json` `dataclasses.asdict(make_plan(...))`;
exit 0. A config training would refuse prints `error: ...` and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from mesh3d.config import load_config
from mesh3d.errors import exit_on_user_error
from mesh3d.plan.build import make_plan
from mesh3d.plan.report import format_plan


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mesh3d.plan", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="Nanotron YAML config file")
    ap.add_argument(
        "--world-size", type=int, help="number of processes (default: dp x cp x tp x pp)"
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallelism.tp=2")
    args = ap.parse_intermixed_args(argv)
    plan = make_plan(load_config(args.config, args.overrides), args.world_size)
    out = json.dumps(dataclasses.asdict(plan), indent=1) + "\n" if args.json else format_plan(plan)
    sys.stdout.write(out)


if __name__ == "__main__":
    main()
