"""`mesh3d generate`: greedy output token for token what transformers' `generate` gives on the
converted model (Llama, Qwen2, Starcoder2), seeded sampling, top-k, and the command line
(tokenizer choice, printed text, errors that exit 2 without a traceback).

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_generate.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import test_generate
from test_generate import SIZES, run_main, save_step

from mesh3d.config import LlamaConfig

HELPERS = Path(__file__).resolve().parents[1] / "helpers"

# test_generate's fixture, requested here by name
ckpts = test_generate.ckpts


def test_python_dash_m_runs(ckpts):
    r = subprocess.run(
        [sys.executable, "-m", "mesh3d.generate", "--checkpoint", str(ckpts / "ckpts" / "7"),
         "--prompt", "It is", "--max-new-tokens", "4", "--temperature", "0.7", "--top-k", "5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("It is")


def test_cli_errors_exit_2_without_traceback(ckpts, capsys, tmp_path):
    code, _, err = run_main(capsys, "--checkpoint", str(tmp_path), "--prompt", "x")
    assert code == 2
    assert err == (f"error: --checkpoint {tmp_path} is neither a step folder (with "
                   "checkpoint_metadata.json) nor a checkpoints folder with latest.txt\n")  # fmt: skip
    step = str(ckpts / "ckpts")
    code, _, err = run_main(capsys, "--checkpoint", step, "--prompt", "x", "--top-k", "0")
    assert code == 2 and "--top-k 0 must be >= 1" in err

    small = tmp_path / "small"
    save_step(small, LlamaConfig(**SIZES, vocab_size=128), tp=1, pp=1)
    code, _, err = run_main(capsys, "--checkpoint", str(small), "--prompt", "The cat was",
                            "--tokenizer", str(ckpts / "tok"))  # fmt: skip
    assert code == 2 and "but the model's vocabulary has 128 ids" in err

    r = subprocess.run(
        [sys.executable, "-m", "mesh3d.cli", "generate", "--checkpoint", str(tmp_path / "nope"),
         "--prompt", "x"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr == (
        f"error: --checkpoint {tmp_path / 'nope'}: no such folder in {tmp_path}, and no "
        "runs/*/checkpoints here either; give a step folder or a checkpoints folder (`mesh3d "
        "train` writes runs/<run name>/checkpoints, relative to the folder it ran in)\n"
    )


TRAIN_TINY = """
import copy, sys
from parity import TINY
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.data.synthetic import make_tokenizer
from mesh3d.train.loop import train
make_tokenizer(sys.argv[1] + "/tok", vocab_size=300)
train(apply_overrides(config_from_dict(copy.deepcopy(TINY)), [
    "model.model_config.vocab_size=301", "tokens.train_steps=1",
    "checkpoints.checkpoints_path=" + sys.argv[1] + "/ck", "checkpoints.checkpoint_interval=1",
    "tokenizer.tokenizer_name_or_path=" + sys.argv[1] + "/tok"]))
"""
LAUNCHES = 5


def test_torchrun_tp2_exits_cleanly_every_time(tmp_path):
    """Issue 26: rank 1 sometimes aborted at exit (`terminate called without an active
    exception`, SIGABRT) after the text was printed. Every launch must exit 0, print the text
    once, and neither rank may abort."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HELPERS), env.get("PYTHONPATH", "")])
    made = subprocess.run([sys.executable, "-c", TRAIN_TINY, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "mesh3d.generate", "--checkpoint",
               str(tmp_path / "ck"), "--prompt", "The cat", "--max-new-tokens", "1", "--tp", "2"]  # fmt: skip
    for i in range(LAUNCHES):
        r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "terminate called" not in r.stderr, (i, r.stderr[-3000:])
        assert r.stdout.startswith("The cat") and r.stdout.count("The cat") == 1, (i, r.stdout)
