"""Multi-node launch: two "nodes" (two launcher processes, each running torchrun with
`--nnodes=2`, c10d rendezvous on 127.0.0.1) train a few dp=2 steps on CPU together."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "recipes" / "slurm" / "launch.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(port: int, metrics: Path, *extra: str) -> list[str]:
    return [sys.executable, str(LAUNCH), "--config-file",
            str(REPO / "recipes" / "configs" / "cpu_tiny.yaml"), "--gpus-per-node", "1",
            "--nodes", "2", "--rdzv-host", "127.0.0.1", "--rdzv-port", str(port),
            "--rdzv-id", f"test-{port}", "--metrics-file", str(metrics), *extra,
            "parallelism.dp=2", "tokens.train_steps=3", "mesh3d.device=cpu",
            "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
            "model.model_config.num_hidden_layers=2"]  # fmt: skip


def test_two_nodes_train_together(tmp_path):
    port, metrics = _free_port(), tmp_path / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            _launcher(port, metrics),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [node.communicate(timeout=240)[0] for node in nodes]
    for node, out in zip(nodes, outs):
        assert node.returncode == 0, out[-3000:]
    assert "--nnodes=2" in outs[0] and "--rdzv_backend=c10d" in outs[0]
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [1, 2, 3]  # one logger rank across both nodes
    assert all(x["global_batch_size"] == 32 for x in lines)  # dp 2 x 8 x 2 microbatches


def test_launcher_checks_the_layout_before_starting(tmp_path):
    bad = _launcher(_free_port(), tmp_path / "m.jsonl", "--dry-run")
    bad[bad.index("--nodes") + 1] = "3"
    out = subprocess.run(bad, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert (
        "--nodes is 3, but dp 2 x tp 1 x pp 1 = 2 processes at 1 per node need 2 nodes"
        in out.stderr
    )
    assert "Traceback" not in out.stderr
