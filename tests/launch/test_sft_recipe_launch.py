"""`recipes/sft_arithmetic.py`, the SFT starter, run as a user runs it (a real process): the
summary gives the exact-match accuracy before and after, and training raises it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_sft_starter_reports_exact_match_before_and_after(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    r = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "sft_arithmetic.py"), "--output",
         str(tmp_path / "run"), "--steps", "150", "--held-out", "30"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"exact match\s+(\d+)/30 \(\d+%\) before -> (\d+)/30 \(\d+%\) after", r.stdout)
    assert m, r.stdout
    before, after = int(m[1]), int(m[2])
    loss = re.search(r"train loss\s+([\d.]+) -> ([\d.]+)", r.stdout)
    assert float(loss[2]) < float(loss[1]) / 2, r.stdout
    assert after > before and after >= 6, r.stdout  # 26/50 measured at 150 steps


def test_sft_data_without_prompt_columns_is_one_error_line(tmp_path):
    from data_fixtures import make_tokenizer

    tok = make_tokenizer(tmp_path / "tok", vocab_size=300).parent
    (tmp_path / "bad.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    stage = (f"data_stages=[{{name: s, start_training_step: 1, data: {{dataset: "
             f"{{hf_dataset_or_datasets: {tmp_path / 'bad.jsonl'}, sft_dataloader: true}}}}}}]")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    r = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "train.py"), "--config-file",
         str(REPO / "recipes" / "configs" / "cpu_tiny.yaml"), f"tokenizer.tokenizer_name_or_path={tok}",
         "model.model_config.vocab_size=320", stage],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr
    assert "'question', 'answer'" in errors[0] and "'prompt' and 'completion'" in errors[0]
