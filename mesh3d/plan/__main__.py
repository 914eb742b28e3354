"""Pre-flight plan of a run: `mesh3d plan [CONFIG] [--preset NAME] [--world-size N] [--json]
[--dry-run] [key=value ...]` (or `python -m mesh3d.plan ...`).

Without CONFIG it plans mesh3d's built-in default run (`mesh3d/configs/default.yaml`, what
`mesh3d train` trains without a config) and says so on stderr. `--preset NAME` sets the
`model.model_config` keys of a published model (presets.py: llama3-8b, llama3-70b, llama3-405b,
smollm-135m, smollm-360m, smollm-1.7b); dotted overrides apply after it.

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
import math
import sys

from mesh3d.config import DEFAULT_CONFIG, load_config
from mesh3d.errors import UserError, exit_on_user_error
from mesh3d.plan.build import make_plan
from mesh3d.plan.dry_run import differences, dry_run
from mesh3d.plan.presets import PRESETS, preset_overrides
from mesh3d.plan.report import format_dry_run, format_plan, gpu_memory_gib
from mesh3d.plan.search_report import run_search


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="mesh3d plan", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    ap.add_argument("config", nargs="?",
                    help="Nanotron YAML config file (default: the built-in run `mesh3d train` "
                    "trains without a config)")  # fmt: skip
    ap.add_argument("--preset", choices=PRESETS, metavar="NAME",
                    help="set model.model_config to a published model's shape: "
                    f"{', '.join(PRESETS)} (overrides given after it win)")  # fmt: skip
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
    ap.add_argument("--hf-model", metavar="FOLDER",
                    help="plan this transformers causal LM (a local folder or hub id: its "
                    "config.json) at the config's parallelism and tokens, read off its module "
                    "tree (mesh3d/plan/hf.py) instead of the config's model")  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallelism.tp=2")
    args = ap.parse_intermixed_args(argv)
    search_only = [f"--{k.replace('_', '-')}" for k in ("hardware", "hardware_file", "nodes_of",
                   "top", "write") if getattr(args, k) != ap.get_default(k)]  # fmt: skip
    if search_only and not args.search:  # they were silently ignored
        verb = "applies" if len(search_only) == 1 else "apply"
        raise UserError(f"{', '.join(search_only)} only {verb} to a layout search: add --search")
    for flag, value in (("--top", args.top), ("--nodes-of", args.nodes_of)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} must be >= 1")
    if args.world_size is not None and args.world_size < 1:
        raise UserError(
            f"--world-size {args.world_size}: a run needs at least 1 rank; give the number of "
            "processes (e.g. --world-size 8), or leave it out for dp x cp x tp x pp"
        )
    gib = gpu_memory_gib(args.gpu_memory) if args.gpu_memory else None
    if gib is not None and not (math.isfinite(gib) and gib > 0):
        raise UserError(
            f"--gpu-memory {args.gpu_memory!r} must be a positive number of GiB; give the memory "
            "of one device (e.g. --gpu-memory 80) or its name (e.g. H100)"
        )
    if args.config and "=" in args.config:  # `mesh3d plan parallelism.tp=2`: no CONFIG
        args.overrides.insert(0, args.config)
        args.config = None
    if args.config is None and args.hf_model:
        sys.stderr.write(
            f"no config given: the layout and tokens come from mesh3d's built-in default run "
            f"({DEFAULT_CONFIG}); set them with parallelism.* and tokens.* overrides\n"
        )
    elif args.config is None:
        sys.stderr.write(
            f"no config given: planning mesh3d's built-in default run ({DEFAULT_CONFIG}, "
            "what `mesh3d train` trains without a config)\n"
        )
    presets = preset_overrides(args.preset) if args.preset else []
    base = []
    if args.config is None and args.search and args.write:  # a config `mesh3d train` can run:
        from mesh3d.data.corpus import default_run_overrides  # with the default run's data

        base = default_run_overrides()
    cfg = load_config(args.config or DEFAULT_CONFIG, base + presets + args.overrides)
    if args.hf_model:
        _plan_hf(cfg, args)
        return
    if args.search:
        run_search(cfg, args)
        return
    _check_world_size(cfg, args.world_size)
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


def _plan_hf(cfg, args) -> None:
    """`--hf-model`: the module-tree plan of a transformers model at the config's layout."""
    from mesh3d.layout import dp_mode
    from mesh3d.plan.hf import format_hf_plan, plan_hf

    p, t = cfg.parallelism, cfg.tokens
    if p.context_parallel_size > 1 or args.search or args.dry_run:
        raise UserError(
            "--hf-model plans dp x tp x pp only: leave out --search, --dry-run and "
            "parallelism.context_parallel_size (context parallelism needs mesh3d's attention)"
        )
    _check_world_size(cfg, args.world_size)
    plan = plan_hf(args.hf_model, dp=p.dp, tp=p.tp, pp=p.pp, dp_mode=dp_mode(cfg.optimizer.zero_stage, cfg.mesh3d.full_shard, cfg.mesh3d.dp_shard),
                   micro_batch=t.micro_batch_size, sequence_length=t.sequence_length,
                   microbatches=t.batch_accumulation_per_replica)  # fmt: skip
    if args.json:
        sys.stdout.write(json.dumps(dataclasses.asdict(plan), indent=1) + "\n")
    else:
        sys.stdout.write(format_hf_plan(plan))


def _check_world_size(cfg, world: int | None) -> None:
    """`--world-size` against the config's layout, with the fix `mesh3d plan` takes (training's
    own message suggests torchrun's --nproc_per_node)."""
    p = cfg.parallelism
    product = p.dp * p.tp * p.pp * max(p.context_parallel_size, 1)
    if world is None or world == product:
        return
    raise UserError(
        f"--world-size {world}, but parallelism.dp ({p.dp}) x tp ({p.tp}) x pp ({p.pp}) x "
        f"context_parallel_size ({p.context_parallel_size}) = {product}; give --world-size "
        f"{product} (or leave it out), change parallelism.dp/context_parallel_size/tp/pp so the "
        f"product is {world}, or let `mesh3d plan --search --world-size {world}` choose"
    )


if __name__ == "__main__":
    main()
