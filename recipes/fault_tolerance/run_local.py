"""Fault-tolerant training on one machine: a torchft lighthouse and N replica groups, each its own
job of `recipes/train.py` (which starts the group's dp x tp x pp ranks), training one model.

    python recipes/fault_tolerance/run_local.py --groups 2 --output runs/ft \\
        --config-file recipes/configs/cpu_tiny.yaml parallelism.tp=2 tokens.train_steps=200
    # the same, with group 1 killed (kill -9 of its whole job) after step 20 and started again
    # 3 s later with the same command: it heals from group 0 and both end bitwise identical
    python recipes/fault_tolerance/run_local.py --groups 2 --output runs/ft --kill 1 --kill-at 20 \\
        --config-file recipes/configs/cpu_tiny.yaml tokens.train_steps=200

Group g writes `<output>/group_<g>/metrics.jsonl` and its log, and saves checkpoints under
`<output>/checkpoints/replica_<g>/` (unless the config names another checkpoints path). At the
end it prints each group's steps, which steps ran with fewer groups, and whether the groups'
last checkpoints hold the same weights and optimizer state. On a cluster, start the lighthouse
once (`torchft_lighthouse --min_replicas 1`) and each group as its own job with
`mesh3d.fault_tolerance.replica_id=<g>` and `TORCHFT_LIGHTHOUSE=<address>` (docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"


def start_lighthouse(heartbeat_ms: int = 1000):
    """A torchft lighthouse in this process (stops with it): (server, address)."""
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft starts its servers
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                              heartbeat_timeout_ms=heartbeat_ms)  # fmt: skip
    return server, server.address()


def start_group(g: int, groups: int, lighthouse: str, args: list[str], output: Path,
                tag: str = "") -> subprocess.Popen:  # fmt: skip
    """Replica group `g` as its own job (its own session, so a kill takes all of its ranks)."""
    folder = output / f"group_{g}"
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(TRAIN), *args, "--metrics-file",
               str(folder / f"metrics{tag}.jsonl"), f"mesh3d.fault_tolerance.replica_groups={groups}",
               f"mesh3d.fault_tolerance.replica_id={g}", f"mesh3d.fault_tolerance.lighthouse={lighthouse}"]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", RUST_LOG="warn")
    # the groups share this machine's cores: each its share (a group's launcher splits it
    # further only when unset, so a group of several ranks gets one thread per rank)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // groups)))
    with open(folder / f"log{tag}.txt", "wb") as log:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def kill_group(proc: subprocess.Popen) -> None:
    """kill -9 of the group's launcher and every rank it started."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def same_checkpoints(a: Path, b: Path) -> tuple[int, list[str]]:
    """(files compared, files that differ) between two step folders' model/, optimizer/ and
    lr_scheduler/ (tensors compared bitwise)."""
    import torch
    from safetensors.torch import load_file

    def same(x, y) -> bool:
        if torch.is_tensor(x):
            return torch.is_tensor(y) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(i, j) for i, j in zip(x, y, strict=False))
        return x == y

    n, differ = 0, []
    for under in ("model", "optimizer", "lr_scheduler"):
        for f in sorted((a / under).rglob("*")):
            if f.is_dir():
                continue
            g = b / f.relative_to(a)
            if f.suffix == ".safetensors":
                ok = same(load_file(f), load_file(g))
            elif f.suffix == ".pt":
                ok = same(torch.load(f, weights_only=False), torch.load(g, weights_only=False))
            else:
                ok = f.read_bytes() == g.read_bytes()
            n += 1
            if not ok:
                differ.append(str(f.relative_to(a)))
    return n, differ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--groups", type=int, default=2, help="replica groups (jobs) to start")
    ap.add_argument(
        "--output",
        type=Path,
        default=Path("runs/fault_tolerance"),
        help="where each group's metrics, log and (by default) checkpoints go",
    )
    ap.add_argument(
        "--kill",
        type=int,
        default=None,
        metavar="G",
        help="kill -9 replica group G's whole job once it logged --kill-at steps",
    )
    ap.add_argument(
        "--kill-at",
        type=int,
        default=10,
        metavar="STEP",
        help="the step after which --kill kills the group (default 10)",
    )
    ap.add_argument(
        "--restart-after",
        type=float,
        default=3.0,
        metavar="S",
        help="start the killed group again (the same command) after S seconds",
    )
    ap.epilog = (
        "Every other argument goes to recipes/train.py: --config-file FILE and dotted overrides."
    )
    a, args = ap.parse_known_args(argv)
    if not any(x.startswith("checkpoints.checkpoints_path=") for x in args):
        args += [f"checkpoints.checkpoints_path={a.output / 'checkpoints'}"]
    args += ["mesh3d.existing_checkpoints=resume"]  # a restarted group takes up its own folder
    server, address = start_lighthouse()
    print(f"lighthouse at {address}; {a.groups} replica groups, output in {a.output}", flush=True)
    procs = {g: start_group(g, a.groups, address, args, a.output) for g in range(a.groups)}
    restarted = None
    if a.kill is not None:
        path = a.output / f"group_{a.kill}" / "metrics.jsonl"
        while len(metrics(path)) < a.kill_at and procs[a.kill].poll() is None:
            time.sleep(0.05)
        kill_group(procs[a.kill])
        print(f"killed replica group {a.kill} (kill -9 of its job) after its step "
              f"{len(metrics(path))}", flush=True)  # fmt: skip
        time.sleep(a.restart_after)
        restarted = start_group(a.kill, a.groups, address, args, a.output, tag="_restarted")
        procs[a.kill] = restarted
        print(f"started replica group {a.kill} again", flush=True)
    codes = {g: p.wait() for g, p in procs.items()}
    server.shutdown()
    last = {}
    for g in range(a.groups):
        tag = "_restarted" if restarted is not None and g == a.kill else ""
        rows = metrics(a.output / f"group_{g}" / f"metrics{tag}.jsonl")
        fewer = [m["iteration"] for m in rows if m.get("ft_replicas", a.groups) < a.groups]
        span = f"steps {rows[0]['iteration']}-{rows[-1]['iteration']}" if rows else "no step"
        print(f"group {g}: exit {codes[g]}, {span}{' (after healing)' if tag else ''}; "
              f"with fewer groups: {f'{fewer[0]}-{fewer[-1]}' if fewer else 'none'}")  # fmt: skip
        last[g] = rows[-1]["iteration"] if rows else None
    ck = next(x.split("=", 1)[1] for x in args if x.startswith("checkpoints.checkpoints_path="))
    folders = [Path(ck) / f"replica_{g}" / str(last[0]) for g in range(a.groups)]
    if all(f.is_dir() for f in folders) and a.groups > 1:
        for f in folders[1:]:
            n, differ = same_checkpoints(folders[0], f)
            print(f"{folders[0]} vs {f}: {n} files, {'bitwise identical' if not differ else f'{len(differ)} differ: {differ[:3]}'}")  # fmt: skip
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main())
