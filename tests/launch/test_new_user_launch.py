"""What a new user meets first (issue 26), the parts that start real processes: torchrun on
`recipes/train.py` behaves as `mesh3d train` (one run name, metrics file, plot, summary). The
others are in `tests/unit/test_new_user.py`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "configs" / "cpu_tiny.yaml")
SHORT = ["tokens.train_steps=3", "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
         "model.model_config.num_hidden_layers=2", "mesh3d.device=cpu"]  # fmt: skip


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "recipes" / "train.py"), *args]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240)


def test_torchrun_run_writes_what_mesh3d_train_writes(tmp_path):
    r = _torchrun("--config-file", TINY, "parallelism.dp=2", *SHORT, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = re.search(r"== run (\S+): 3 steps in", r.stdout).group(1)
    assert "%" not in run and run.startswith("cpu_tiny_")  # expanded once, rank 0's
    assert (tmp_path / "runs" / run / "metrics.jsonl").is_file()
    assert (tmp_path / "runs" / run / "metrics.png").is_file()  # the plot, as mesh3d train
    assert f"metrics      runs/{run}/metrics.jsonl" in r.stdout
    assert list((tmp_path / "runs").iterdir()) == [tmp_path / "runs" / run]  # one folder


def test_multi_node_launcher_reports_a_rank_mistake_in_one_line(tmp_path):
    """The documented multi-node launch: a mistake only the ranks see (the data folder is
    missing) is one `error:` line naming the fix and exit code 2, no torchrun traceback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(REPO / "recipes" / "slurm" / "launch.py"), "--config-file",
           str(REPO / "recipes" / "configs" / "cpu_nanoset.yaml"), "--gpus-per-node", "2",
           "--rdzv-host", "127.0.0.1", "--rdzv-port", str(port), "parallelism.dp=2",
           "mesh3d.device=cpu"]  # fmt: skip
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert errors == [
        "error: dataset_folder 'runs/tiny_data/tokenized' does not exist; fix the path "
        "(`python recipes/tiny_data.py` writes it)"
    ]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr


def test_import_transformers_after_mesh3d_prints_no_torchao_kernel_noise():
    """Item 10, in a fresh process as a user's script runs it (the filters are unit-tested in
    tests/unit/test_new_user.py)."""
    import pytest

    pytest.importorskip("torchao", reason="torchao (the float8 extra) is not installed")
    pytest.importorskip("transformers", reason="transformers (the hf extra) is not installed")
    code = "import mesh3d, transformers; from transformers import LlamaForCausalLM"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       env=_env())  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Failed to load" not in r.stderr and "is an Enum subclass" not in r.stderr, r.stderr
