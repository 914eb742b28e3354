"""Fault tolerance across replica groups (torchft): what it costs without a failure, and what a
failure costs with it against restarting from a checkpoint.

    python benchmarks/fault_tolerance.py            # ~3 min on 2 cores
    python benchmarks/fault_tolerance.py --quick    # ~1.5 min

The model is the CPU default's (`recipes/configs/cpu_tiny.yaml`, a ~3M-parameter Llama), 16
sequences of 128 tokens per group and step, each group one process (2 cores).
1. Overhead: one job at dp 2 (fault tolerance off) against 2 replica groups of one rank
   (`mesh3d.fault_tolerance`, a lighthouse in this process), which train the same samples to the
   same weights; median step time over steps 3 on, alternating off/on `--repeats` times, the
   ratio per repetition.
2. A failure: group 1's job is killed (kill -9) after its step 10 and started again 1 s later
   with the same command. Measured from this process, polling the metrics files: the time from
   the kill to group 0's next step, from the restart to group 1's first step after healing,
   and the steps group 0 trained again (a step in flight is voided and trained again). Against
   that, the checkpoint-restart path at the same `checkpoint_interval` restarts every group and
   loses the steps since the last checkpoint: `kill step mod interval` here, interval / 2 on
   average. The losses are compared with the same run without a fault.
Results: benchmarks/results/local/fault_tolerance[_quick].json (`--publish`: benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import add_publish_flag, print_header, results_dir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes" / "fault_tolerance"))
from run_local import TRAIN, kill_group, metrics, start_group, start_lighthouse  # noqa: E402

CFG = REPO / "recipes" / "configs" / "cpu_tiny.yaml"


def _median_step_ms(rows: list[dict]) -> float:
    return statistics.median(m["elapsed_time_per_iteration_ms"] for m in rows[2:])


def _plain(steps: int, folder: Path) -> float:
    """One job at dp 2 (its own 2 ranks), fault tolerance off: median step ms."""
    import subprocess

    out = folder / "plain.jsonl"
    cmd = [sys.executable, str(TRAIN), "--config-file", str(CFG), "parallelism.dp=2",
           f"tokens.train_steps={steps}", "logging.log_level=warning", "--metrics-file", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return _median_step_ms(metrics(out))


def _groups(steps: int, folder: Path, address: str, extra=()) -> list[float]:
    """2 replica groups of one rank: each group's median step ms."""
    args = ["--config-file", str(CFG), f"tokens.train_steps={steps}", "logging.log_level=warning",
            *extra]  # fmt: skip
    procs = [start_group(g, 2, address, args, folder) for g in range(2)]
    assert [p.wait() for p in procs] == [0, 0], (folder / "group_0" / "log.txt").read_text()[-2000:]
    return [_median_step_ms(metrics(folder / f"group_{g}" / "metrics.jsonl")) for g in range(2)]


def overhead(steps: int, repeats: int, address: str, root: Path) -> dict:
    rows = []
    for r in range(repeats):
        off = _plain(steps, root / f"off{r}")
        on = max(_groups(steps, root / f"on{r}", address))
        rows.append({"off_ms": off, "on_ms": on, "ratio": on / off})
        print(f"repetition {r + 1}: dp 2 off {off:.1f} ms/step | 2 groups on {on:.1f} ms/step | "
              f"ratio {on / off:.3f}", flush=True)  # fmt: skip
    ratio = statistics.median(x["ratio"] for x in rows)
    print(f"step time with fault tolerance on / off (median of {repeats}): {ratio:.3f}")
    return {"repetitions": rows, "ratio": ratio}


def failure(steps: int, interval: int, address: str, root: Path, kill_at: int = 10) -> dict:
    ck = root / "ck"
    args = ["--config-file", str(CFG), f"tokens.train_steps={steps}", "logging.log_level=info",
            f"checkpoints.checkpoints_path={ck}", f"checkpoints.checkpoint_interval={interval}",
            "mesh3d.existing_checkpoints=resume", "mesh3d.fault_tolerance.quorum_timeout_s=30"]  # fmt: skip
    procs = [start_group(g, 2, address, args, root) for g in range(2)]
    m0, m1 = root / "group_0" / "metrics.jsonl", root / "group_1" / "metrics.jsonl"
    while len(metrics(m1)) < kill_at:
        assert procs[1].poll() is None, (root / "group_1" / "log.txt").read_text()[-2000:]
        time.sleep(0.01)
    kill_group(procs[1])
    killed, before = time.monotonic(), len(metrics(m0))
    while len(metrics(m0)) <= before:
        time.sleep(0.005)
    next_step_s = time.monotonic() - killed
    time.sleep(1.0)
    restarted = time.monotonic()
    again = start_group(1, 2, address, args, root, tag="_restarted")
    mr = root / "group_1" / "metrics_restarted.jsonl"
    while not metrics(mr) and again.poll() is None:
        time.sleep(0.01)
    rejoin_s = time.monotonic() - restarted
    assert procs[0].wait() == 0 and again.wait() == 0
    log0 = (root / "group_0" / "log.txt").read_text()
    redone = len(re.findall(r"was not applied", log0))
    first = metrics(mr)[0]["iteration"]
    kill_step = before  # group 0's steps when group 1 died (they trained in lock step)
    lost_ckpt = kill_step % interval
    print(f"group 1 killed after step {kill_step}: group 0's next step {next_step_s:.2f} s later "
          f"({redone} step voided and trained again); group 1 restarted, trained again from "
          f"step {first} (healed, no checkpoint read) {rejoin_s:.1f} s after its restart")  # fmt: skip
    faulted = [m["lm_loss"] for m in metrics(m0)]
    base_root = root / "no_fault"
    base_args = [a for a in args if not a.startswith("checkpoints.checkpoints_path=")]
    base_args.append(f"checkpoints.checkpoints_path={base_root / 'ck'}")
    again = [start_group(g, 2, address, base_args, base_root) for g in range(2)]
    assert [p.wait() for p in again] == [0, 0]
    clean = [m["lm_loss"] for m in metrics(base_root / "group_0" / "metrics.jsonl")]
    same_until = next((i for i, (x, y) in enumerate(zip(faulted, clean, strict=True)) if x != y),
                      len(clean))  # fmt: skip
    print(f"losses against the same run without a fault: equal (bitwise) up to step {same_until}, "
          f"then {steps - same_until} steps apart (group 1's samples dropped for the steps it "
          f"missed); final loss {faulted[-1]:.4f} vs {clean[-1]:.4f}, largest difference "
          f"{max(abs(x - y) for x, y in zip(faulted, clean, strict=True)):.4f}")  # fmt: skip
    print(f"steps lost per failure: fault tolerance {0} committed steps ({redone} retried); "
          f"checkpoint restart at checkpoint_interval {interval}: {lost_ckpt} here, "
          f"{interval / 2:.0f} on average, plus every group's restart")  # fmt: skip
    return {"kill_step": kill_step, "death_to_next_step_s": next_step_s, "restart_to_rejoin_s": rejoin_s,
            "rejoined_at_step": first, "steps_retried": redone, "checkpoint_interval": interval,
            "steps_lost_checkpoint_restart": lost_ckpt, "steps_lost_mean_checkpoint_restart": interval / 2,
            "losses_equal_until_step": same_until, "final_loss": faulted[-1], "final_loss_no_fault": clean[-1],
            "losses": faulted, "losses_no_fault": clean}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and one repetition")
    add_publish_flag(ap)
    a = ap.parse_args()
    head = print_header()
    steps, repeats = (12, 1) if a.quick else (30, 3)
    server, address = start_lighthouse()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        result = {**head, "overhead": overhead(steps, repeats, address, root)}
        result["failure"] = failure(60 if a.quick else 120, 20, address, root / "failure")
    server.shutdown()
    out = results_dir(a.publish) / f"fault_tolerance{'_quick' if a.quick else ''}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
