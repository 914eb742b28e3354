"""Pre-flight plan of a run: `mesh3d plan CONFIG [--world-size N] [--json] [--dry-run]
[key=value ...]` (or `python -m mesh3d.plan ...`).

`--search` instead ranks every valid layout of the config's model and global batch on
`--world-size` ranks of `--hardware` (or `--hardware-file`) by predicted step time
(search.py, cost.py; docs/plan-search.md); `--write FILE` saves the best as a config.

Prints the text report of `format_plan`, or with `--json` `dataclasses.asdict(make_plan(...))`;
exit 0. A config training would refuse prints `error: ...` and exits 2. `--dry-run` also builds
every distinct rank's model parts as training does, on meta with a fake process group
(`dry_run.py`), and compares the bytes they hold with the plan's: a part that fails to build
prints `error: dry run: rank ...` and exits 2; bytes that differ from the plan exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from mesh3d.config import load_config
from mesh3d.errors import UserError, exit_on_user_error
from mesh3d.plan.build import make_plan
from mesh3d.plan.dry_run import differences, dry_run
from mesh3d.plan.report import format_dry_run, format_plan, gpu_memory_gib
from mesh3d.plan.search_report import run_search


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="mesh3d plan", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    ap.add_argument("config", help="Nanotron YAML config file")
    ap.add_argument(
        "--world-size", type=int, help="number of processes (default: dp x cp x tp x pp)"
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="build each distinct rank's model parts on meta (fake process group) and compare",
    )
    ap.add_argument("--search", action="store_true", help="rank every valid layout by step time")
    ap.add_argument("--hardware", default="h100-80g", help="profile name (--search); cpu: measured")
    ap.add_argument("--hardware-file", help="a YAML/JSON hardware profile (--search)")
    ap.add_argument("--nodes-of", type=int, help="ranks per node (--search; default the profile's)")
    ap.add_argument("--top", type=int, default=10, help="layouts to print (--search)")
    ap.add_argument("--write", help="save the best layout's config to this file (--search)")
    ap.add_argument(
        "--gpu-memory",
        help="memory per device, GiB or a name (H100, A100-40GB, H200, ...): says whether the "
        "largest per-rank peak fits",
    )
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallelism.tp=2")
    args = ap.parse_intermixed_args(argv)
    if args.world_size is not None and args.world_size < 1:
        raise UserError(
            f"--world-size {args.world_size}: a run needs at least 1 rank; give the number of "
            "processes (e.g. --world-size 8), or leave it out for dp x cp x tp x pp"
        )
    gib = gpu_memory_gib(args.gpu_memory) if args.gpu_memory else None
    cfg = load_config(args.config, args.overrides)
    if args.search:
        run_search(cfg, args)
        return
    plan = make_plan(cfg, args.world_size)
    run = dry_run(cfg, plan.world_size) if args.dry_run else None
    diffs = differences(plan, run) if run else {}
    if args.json:
        data = dataclasses.asdict(plan)
        if run:
            data |= {"dry_run": dataclasses.asdict(run), "differences": diffs}
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
    else:
        dry = "\n" + format_dry_run(plan, run, diffs) if run else ""
        sys.stdout.write(format_plan(plan, gib) + dry)
    if diffs:
        first = next(iter(diffs.values()))[0]
        ranks = ", ".join(map(str, diffs))
        sys.stderr.write(
            f"dry run: the plan differs from the parts built on rank(s) {ranks}: {first}\n"
        )
        raise SystemExit(1)


if __name__ == "__main__":
    main()
