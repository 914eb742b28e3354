"""`mesh3d generate`: greedy output token for token what transformers' `generate` gives on the
converted model (Llama, Qwen2, Starcoder2), seeded sampling, top-k, and the command line
(tokenizer choice, printed text, errors that exit 2 without a traceback).

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_generate.py`."""

from __future__ import annotations

import subprocess
import sys

import test_generate
from test_generate import SIZES, run_main, save_step

from mesh3d.config import LlamaConfig

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
         "--prompt", "x"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr == f"error: --checkpoint {tmp_path / 'nope'} does not exist; give a step " \
        "folder or a checkpoints folder\n"  # fmt: skip
