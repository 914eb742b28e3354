"""End-to-end runs of recipes/train.py through torchrun (the way users launch it)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "recipes" / "train.py")
LINE = re.compile(
    r"\[INFO\|DP=0\|PP=0\|TP=0\]: iteration: (\d+) / (\d+) \| consumed_tokens: \S+ \| "
    r"elapsed_time_per_iteration_ms: \S+ \| tokens_per_sec: \S+ \| tokens_per_sec_per_gpu: \S+ \| "
    r"global_batch_size: \S+ \| lm_loss: \S+ \| lr: \S+ \| model_tflops_per_gpu: \S+ \| "
    r"hardware_tflops_per_gpu: \S+ \| grad_norm: \S+"
)


def torchrun(nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--standalone", TRAIN, *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cpu_default_config_loss_falls(tmp_path):
    mf = tmp_path / "metrics.jsonl"
    r = torchrun(1, "--metrics-file", str(mf), "tokens.train_steps=15")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = LINE.findall(r.stdout)
    assert [int(i) for i, _ in lines] == list(range(1, 16)) and lines[0][1] == "15"
    m = read_metrics(mf)
    assert [x["iteration"] for x in m] == list(range(1, 16))
    for key in ("lm_loss", "lr", "grad_norm", "consumed_tokens", "tokens_per_sec"):
        assert all(key in x for x in m)
    assert m[-1]["consumed_tokens"] == 15 * 16 * 128
    first, last = m[0]["lm_loss"], m[-1]["lm_loss"]
    assert last < 0.5 * first, (first, last)  # the learnable dummy task is being learned


def test_dp2_tp2_torchrun_matches_one_process(tmp_path):
    steps = ["tokens.train_steps=6"]
    one, four = tmp_path / "one.jsonl", tmp_path / "four.jsonl"
    r1 = torchrun(1, "--metrics-file", str(one), *steps, "tokens.batch_accumulation_per_replica=4")
    assert r1.returncode == 0, r1.stdout + r1.stderr
    r4 = torchrun(4, "--metrics-file", str(four), *steps, "parallelism.dp=2", "parallelism.tp=2")
    assert r4.returncode == 0, r4.stdout + r4.stderr
    a, b = read_metrics(one), read_metrics(four)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        for key in ("lm_loss", "grad_norm", "lr"):
            assert abs(x[key] - y[key]) <= 1e-5 * abs(x[key]), (key, x[key], y[key])
        assert x["consumed_tokens"] == y["consumed_tokens"]


def test_bad_config_exits_2_without_traceback():
    r = subprocess.run(
        [sys.executable, TRAIN, "parallelism.tp=3"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ")
    assert "parallelism.tp" in r.stderr
