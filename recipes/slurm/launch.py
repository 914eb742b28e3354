"""Start `recipes/train.py` on every node of a multi-node job with torchrun's c10d rendezvous.

    # on each node (Slurm does this for you, see train.sbatch):
    python recipes/slurm/launch.py --config-file cfg.yaml --gpus-per-node 8 [overrides ...]
    # anywhere, to see the command it runs:
    python recipes/slurm/launch.py --config-file cfg.yaml --gpus-per-node 8 --nodes 2 --dry-run

The node count is the config's world size (dp x cp x tp x pp) / --gpus-per-node (checked against
--nodes and $SLURM_NNODES when given). Every node runs the same torchrun command:
`--nnodes N --nproc_per_node G --rdzv_backend c10d --rdzv_endpoint HOST:PORT --rdzv_id ID`,
where HOST is --rdzv-host, else the first host of $SLURM_JOB_NODELIST (via scontrol), else
this machine; ID is $SLURM_JOB_ID when set. A config or layout mistake exits with code 2 before
anything starts. It prints that command, then runs it in this process through torch's elastic
agent (`mesh3d.agent.run_agent`, what torchrun does): SIGUSR1, SIGTERM and SIGINT are forwarded
to the ranks, so a preemption notice makes every rank save and exit 75, and this process exits
with the ranks' code (2 for a mistake only a rank sees, such as a missing data folder: its one
`error:` line, without torchrun's ChildFailedError traceback and exit 1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from mesh3d.checks import validate
from mesh3d.config import layout_text, load_config, world_size
from mesh3d.errors import UserError, exit_on_user_error

TRAIN = Path(__file__).resolve().parents[1] / "train.py"
# torchrun's default list plus SIGUSR1, which Slurm's `--signal` sends before a preemption
PREEMPTION_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def _first_slurm_host() -> str | None:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):  # no scontrol here: this machine
        return None
    return (out.stdout.split() or [None])[0]


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line every node runs (after checking the config and the sizes)."""
    cfg = load_config(args.config_file, args.overrides)
    world = world_size(cfg)
    validate(cfg, world_size=world)
    if world % args.gpus_per_node:
        raise UserError(
            f"the config needs {world} processes ({layout_text(cfg)}), not a "
            f"multiple of --gpus-per-node {args.gpus_per_node}; change the layout or the node size"
        )
    nodes = world // args.gpus_per_node
    for name, given in (("--nodes", args.nodes), ("$SLURM_NNODES", os.environ.get("SLURM_NNODES"))):
        if given is not None and not str(given).strip().isdigit():
            raise UserError(f"{name} is {given!r}, not a number of nodes")
        if given is not None and int(given) != nodes:
            raise UserError(
                f"{name} is {given}, but {layout_text(cfg)} = {world} processes at "
                f"{args.gpus_per_node} per node need {nodes} nodes; change the layout or the job size"
            )
    host = args.rdzv_host or _first_slurm_host() or socket.gethostname()
    job = args.rdzv_id or os.environ.get("SLURM_JOB_ID", "mesh3d")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
           f"--nproc_per_node={args.gpus_per_node}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint={host}:{args.rdzv_port}", f"--rdzv_id={job}", *_signal_option(),
           str(TRAIN), "--config-file", str(args.config_file)]  # fmt: skip
    if args.metrics_file:
        cmd += ["--metrics-file", args.metrics_file]
    return cmd + list(args.overrides)


def _signal_option() -> list[str]:
    """torchrun's option for the signals it forwards, where this torch has it (older ones read
    only TORCHELASTIC_SIGNALS_TO_HANDLE, set in `main`)."""
    from torch.distributed.run import get_args_parser

    options = {o for action in get_args_parser()._actions for o in action.option_strings}
    return [f"--signals-to-handle={PREEMPTION_SIGNALS}"] if "--signals-to-handle" in options else []


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True, help="processes per node")
    ap.add_argument("--nodes", type=int, help="expected node count (checked)")
    ap.add_argument(
        "--rdzv-host", help="rendezvous host (default: first Slurm node, else this one)"
    )
    ap.add_argument("--rdzv-port", type=int, default=29500)
    ap.add_argument("--rdzv-id", help="rendezvous id (default: $SLURM_JOB_ID)")
    ap.add_argument("--metrics-file")
    ap.add_argument("--dry-run", action="store_true", help="print the command, start nothing")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if not args.config_file.strip():  # `--config-file "$CFG"`, CFG unset
        raise UserError(f"--config-file {args.config_file!r} is empty; give a YAML config file")
    for flag, value, low, high in (("--gpus-per-node", args.gpus_per_node, 1, None),
                                   ("--nodes", args.nodes, 1, None),
                                   ("--rdzv-port", args.rdzv_port, 1, 65535)):  # fmt: skip
        if value is not None and (value < low or (high is not None and value > high)):
            bound = f"between {low} and {high}" if high else f">= {low}"
            raise UserError(f"{flag} {value} must be {bound}")
    cmd = torchrun_command(args)
    print(" ".join(map(shlex.quote, cmd)), flush=True)
    if not args.dry_run:
        # what that command does, run here by torch's elastic agent (mesh3d/launch.py): this
        # process forwards Slurm's SIGTERM/SIGINT/SIGUSR1 to every rank, which finish the step,
        # save and exit 75; a rank's mistake is its one `error:` line and exit code 2, with no
        # torchrun traceback
        from mesh3d.agent import run_agent

        at = cmd.index(str(TRAIN))
        opts = dict(o[2:].split("=", 1) for o in cmd[3:at] if o.startswith("--") and "=" in o)
        run_agent(cmd[at:], int(opts["nproc_per_node"]), int(opts["nnodes"]),
                  opts["rdzv_endpoint"], opts["rdzv_id"])  # fmt: skip


if __name__ == "__main__":
    main()
