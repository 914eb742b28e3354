"""Fault-tolerant training on one machine: a torchft lighthouse and N replica groups, each its own
job of `recipes/train.py` (which starts the group's dp x tp x pp ranks), training one model.

    python recipes/fault_tolerance/run_local.py --groups 2 --output runs/ft \\
        --config-file recipes/configs/cpu_tiny.yaml parallelism.tp=2 tokens.train_steps=200
    # the same, with group 1 killed (kill -9 of its whole job) after step 20 and started again
    # 3 s later with the same command: it heals from group 0 and both end bitwise identical
    python recipes/fault_tolerance/run_local.py --groups 2 --output runs/ft --kill 1 --kill-at 20 \\
        --config-file recipes/configs/cpu_tiny.yaml tokens.train_steps=200

Relative paths (`--output`, `--config-file`, overrides) are read against the current folder. A
config without `checkpoints.checkpoint_interval` (such as cpu_tiny.yaml) gets
`checkpoints.checkpoint_interval=10`, and one without `mesh3d.existing_checkpoints` gets `resume`
(a restarted group takes up its own folder); an override of either wins. Ctrl-C or SIGTERM is
forwarded to every group: each saves its step and exits 75, then the summary is printed.

Group g writes `<output>/group_<g>/metrics.jsonl`, appends to its `log.txt` (a rerun keeps the
previous runs' lines) and saves checkpoints under `<output>/checkpoints/replica_<g>/` (unless the config names another checkpoints path). At the
end it prints each group's steps, which steps ran with fewer groups, and whether the groups'
last checkpoints hold the same weights and optimizer state. On a cluster, start the lighthouse
once (`torchft_lighthouse --min_replicas 1`) and each group as its own job with
`mesh3d.fault_tolerance.replica_id=<g>` and `TORCHFT_LIGHTHOUSE=<address>` (docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mesh3d.errors import UserError, exit_on_user_error

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"
# for a config without one (recipes/configs/cpu_tiny.yaml): a group needs a checkpoints section
DEFAULT_CHECKPOINT_INTERVAL = 10


def start_lighthouse(heartbeat_ms: int = 1000):
    """A torchft lighthouse in this process (stops with it): (server, address)."""
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft starts its servers
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                              heartbeat_timeout_ms=heartbeat_ms)  # fmt: skip
    return server, server.address()


def start_group(g: int, groups: int, lighthouse: str, args: list[str], output: Path,
                tag: str = "") -> subprocess.Popen:  # fmt: skip
    """Replica group `g` as its own job (its own session, so a kill takes all of its ranks), run
    in the current folder, so that relative paths in `args` mean what the user meant."""
    folder = output / f"group_{g}"
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(TRAIN), *args, "--metrics-file",
               str(folder / f"metrics{tag}.jsonl"), f"mesh3d.fault_tolerance.replica_groups={groups}",
               f"mesh3d.fault_tolerance.replica_id={g}", f"mesh3d.fault_tolerance.lighthouse={lighthouse}"]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", RUST_LOG="warn")
    # the groups share this machine's cores: each its share (a group's launcher splits it
    # further only when unset, so a group of several ranks gets one thread per rank)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // groups)))
    log_path = folder / f"log{tag}.txt"
    with open(log_path, "ab") as log:  # append: a rerun keeps the previous runs' logs
        log.write(
            f"=== run_local.py: group {g} started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode()
        )
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    proc.log_path, proc.log_offset = log_path, offset  # type: ignore[attr-defined]
    return proc


def kill_group(proc: subprocess.Popen, signum: int = signal.SIGKILL) -> None:
    """kill -9 (or `signum`) of the group's launcher and every rank it started; a group that
    already exited is left as it is. Waits for the launcher only for SIGKILL."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the whole group exited
        os.killpg(proc.pid, signum)
    if signum == signal.SIGKILL:
        proc.wait()


def last_error(proc: subprocess.Popen) -> str | None:
    """The last `error: ...` line the group wrote to its log in this run, if any."""
    try:
        with open(proc.log_path, "rb") as f:  # type: ignore[attr-defined]
            f.seek(proc.log_offset)  # type: ignore[attr-defined]
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    errors = [line.strip() for line in lines if line.lstrip().startswith("error:")]
    return errors[-1] if errors else None


def _option(args: list[str], *names: str) -> tuple[int, str] | None:
    """(index of the value, value) of the last `--name VALUE` / `--name=VALUE` in `args`."""
    found = None
    for i, x in enumerate(args):
        for n in names:
            if x == n and i + 1 < len(args):
                found = i + 1, args[i + 1]
            elif x.startswith(n + "="):
                found = i, x
    return found


def _override(args: list[str], key: str) -> str | None:
    """The value of the last dotted override `key=VALUE` in `args`."""
    values = [x.split("=", 1)[1] for x in args if x.startswith(key + "=")]
    return values[-1] if values else None


def _config_value(cfg: dict, key: str):
    for part in key.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def train_args(a: argparse.Namespace, args: list[str]) -> list[str]:
    """The arguments for recipes/train.py: the user's (the config file as an absolute path),
    a checkpoints path under --output, and the keys a replica group needs unless the user set
    them. Raises `UserError` for a flag that cannot work, before anything starts."""
    args = list(args)
    config = _option(args, "--config-file", "--config")
    if config is None:  # train.py's positional CONFIG: the first argument that is no override
        config = next(((i, x) for i, x in enumerate(args) if not x.startswith("-")
                       and "=" not in x and not (i and args[i - 1] == "--metrics-file")), None)  # fmt: skip
    cfg: dict = {}
    if config is not None:
        i, value = config
        flag, _, path = value.partition("=") if value.startswith("--") else ("", "", value)
        if not path:
            raise UserError(f"--config-file {path!r} is empty; give a YAML config file")
        file = Path(path).expanduser().resolve()
        if not file.is_file():
            raise UserError(f"--config-file {path}: no such file ({file}); give the path of a "
                            f"YAML config file, relative to {Path.cwd()} or absolute")  # fmt: skip
        args[i] = f"{flag}={file}" if flag else str(file)
        try:
            import yaml

            cfg = yaml.safe_load(file.read_text()) or {}
        except Exception:  # noqa: BLE001 - recipes/train.py reports a broken config itself
            cfg = {}
        cfg = cfg if isinstance(cfg, dict) else {}
    steps = _override(args, "tokens.train_steps") or _config_value(cfg, "tokens.train_steps")
    try:
        steps = int(steps) if steps is not None else None
    except ValueError:
        steps = None  # recipes/train.py names a bad value itself
    if a.kill is not None and steps is not None and a.kill_at >= steps:
        raise UserError(f"--kill-at {a.kill_at} with tokens.train_steps={steps}: group {a.kill} "
                        f"would have finished before the kill; give --kill-at below {steps} or "
                        f"more tokens.train_steps")  # fmt: skip
    ck = _override(args, "checkpoints.checkpoints_path")
    if ck is None:
        args.append(f"checkpoints.checkpoints_path={a.output / 'checkpoints'}")
    else:  # absolute, so that the summary finds it
        args = [x for x in args if not x.startswith("checkpoints.checkpoints_path=")]
        args.append(f"checkpoints.checkpoints_path={Path(ck).expanduser().resolve()}")
    if (_override(args, "checkpoints.checkpoint_interval") is None
            and _config_value(cfg, "checkpoints.checkpoint_interval") is None):  # fmt: skip
        args.append(f"checkpoints.checkpoint_interval={DEFAULT_CHECKPOINT_INTERVAL}")
    if (_override(args, "mesh3d.existing_checkpoints") is None
            and _config_value(cfg, "mesh3d.existing_checkpoints") is None):  # fmt: skip
        args.append("mesh3d.existing_checkpoints=resume")  # a restarted group takes up its folder
    return args


def check_flags(a: argparse.Namespace) -> None:
    """A `UserError` for a launcher flag that cannot work, before anything starts."""
    if a.groups < 1:
        raise UserError(f"--groups {a.groups} must be >= 1; give the number of replica groups, "
                        f"e.g. --groups 2")  # fmt: skip
    if a.kill is not None and not 0 <= a.kill < a.groups:
        raise UserError(f"--kill {a.kill} is not a replica group of --groups {a.groups}; give one "
                        f"of 0..{a.groups - 1}")  # fmt: skip
    if a.kill_at < 1:
        raise UserError(f"--kill-at {a.kill_at} must be >= 1 (the step after which --kill kills "
                        f"the group)")  # fmt: skip
    if not a.restart_after >= 0:  # also NaN
        raise UserError(f"--restart-after {a.restart_after} must be >= 0 (seconds before the "
                        f"killed group starts again)")  # fmt: skip
    if str(a.output).strip() == "":
        raise UserError("--output '' is empty; give a folder, e.g. --output runs/ft")


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


@exit_on_user_error
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
    check_flags(a)
    a.output = a.output.expanduser().resolve()  # the groups' summary and this one agree
    args = train_args(a, args)
    if a.output.exists() and not a.output.is_dir():
        raise UserError(f"--output {a.output} is a file; give a folder")
    server, address = start_lighthouse()
    print(f"lighthouse at {address}; {a.groups} replica groups, output in {a.output}", flush=True)
    procs: dict[int, subprocess.Popen] = {}
    stop: list[int] = []  # the stop signals received, forwarded to every group

    def forward(signum, _frame):
        stop.append(signum)
        name = signal.Signals(signum).name
        print(f"{name} received: forwarded to every replica group, which saves its step and "
              f"exits (75); waiting for them", file=sys.stderr, flush=True)  # fmt: skip
        for p in list(procs.values()):
            if p.poll() is None:
                kill_group(p, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for g in range(a.groups):
            if not stop:
                procs[g] = start_group(g, a.groups, address, args, a.output)
        restarted = None
        if a.kill is not None and not stop:
            path = a.output / f"group_{a.kill}" / "metrics.jsonl"
            while len(metrics(path)) < a.kill_at and procs[a.kill].poll() is None and not stop:
                time.sleep(0.05)
            if stop:
                pass
            elif procs[a.kill].poll() is not None:
                print(f"replica group {a.kill} exited ({procs[a.kill].returncode}) before its step "
                      f"{a.kill_at}: not killed nor started again", flush=True)  # fmt: skip
            else:
                kill_group(procs[a.kill])
                print(f"killed replica group {a.kill} (kill -9 of its job) after its step "
                      f"{len(metrics(path))}", flush=True)  # fmt: skip
                end = time.monotonic() + a.restart_after
                while time.monotonic() < end and not stop:
                    time.sleep(min(0.05, a.restart_after))
                if not stop:
                    restarted = start_group(a.kill, a.groups, address, args, a.output,
                                            tag="_restarted")  # fmt: skip
                    procs[a.kill] = restarted
                    print(f"started replica group {a.kill} again", flush=True)
        codes = {g: p.wait() for g, p in procs.items()}
    finally:
        for p in procs.values():  # an error of our own: no group is left running unsupervised
            if p.poll() is None:
                kill_group(p, signal.SIGTERM)
        for p in procs.values():
            p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.shutdown()
    last = {}
    for g in procs:
        tag = "_restarted" if restarted is not None and g == a.kill else ""
        rows = metrics(a.output / f"group_{g}" / f"metrics{tag}.jsonl")
        fewer = [m["iteration"] for m in rows if m.get("ft_replicas", a.groups) < a.groups]
        span = f"steps {rows[0]['iteration']}-{rows[-1]['iteration']}" if rows else "no step"
        print(f"group {g}: exit {codes[g]}, {span}{' (after healing)' if tag else ''}; "
              f"with fewer groups: {f'{fewer[0]}-{fewer[-1]}' if fewer else 'none'}")  # fmt: skip
        if codes[g] not in (0, 75) and (error := last_error(procs[g])) is not None:
            print(f"group {g}: {error} (log: {procs[g].log_path})")  # type: ignore[attr-defined]
        last[g] = rows[-1]["iteration"] if rows else None
    ck = _override(args, "checkpoints.checkpoints_path")
    if last and last[0] is not None:
        folders = [Path(ck) / f"replica_{g}" / str(last[0]) for g in procs]
        if all(f.is_dir() for f in folders) and len(folders) > 1:
            for f in folders[1:]:
                n, differ = same_checkpoints(folders[0], f)
                print(f"{folders[0]} vs {f}: {n} files, {'bitwise identical' if not differ else f'{len(differ)} differ: {differ[:3]}'}")  # fmt: skip
    return max(codes.values()) if codes else 128 + stop[0]


if __name__ == "__main__":
    sys.exit(main())
