"""benchmarks/throughput.py and benchmarks/gpu.sh, run as a user would (subprocesses).

- `throughput.py --tiny --out F` (a toy Llama trained by mesh3d, a plain loop and transformers,
  step by step in interleaved rounds, then mesh3d at 2x2x2 on 8 torchrun ranks) exits 0 and
  writes the JSON: every way has positive, finite tokens/s for every round; the three ways start
  from the same loss (same weights, same batch); the ratios (of medians, and the per-round median
  inside its bootstrap interval) and the 8-rank efficiency are finite and in a broad sane range. Tokens/s on a shared
  CPU is noisy, so nothing here asserts a speed. `--tiny` compiles nothing (~30 s a way here).
- `throughput.py --peer --tiny` (toy shapes, 4 steps: mesh3d 1x1x1, 2x2x2 and tp=2 on 1, 8 and 2
  torchrun ranks, and the plain loop) exits 0 and writes every layout's tokens/s (finite,
  positive) and efficiency; every mesh3d layout logs the same first and last loss.
- The compiled ways' columns without compiling: `summarize` and `table` on made-up step times
  give each targeted ratio (compiled round 1 left out) and a row per way.
- Without a GPU, `gpu.sh` exits 0 with its message, and `gpu.py --dry-run` lists the variants,
  with `mesh3d.compile: true` accepted by mesh3d's config validation.
- `gpu.py --smoke` runs the float8 (eager and compiled) and packed-documents variants on CPU at
  a positive rate, and refuses the async-TP one with the reason (it needs CUDA). The tp=2
  compiled variant is the launch `tests/launch/test_train_e2e.py` checks for parity.

The tests of this subject that run in one process without a process group are in
`tests/unit/test_bench_throughput_unit.py`."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("mesh3d", "plain", "transformers")


def _finite_positive(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_throughput_tiny_writes_sane_json(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "throughput.json"
    cmd = [sys.executable, "benchmarks/throughput.py", "--tiny", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cores" in proc.stdout and "| way |" in proc.stdout
    r = json.loads(out.read_text())
    for key in ("command", "torch", "transformers", "cores", "threads", "date", "shapes", "impls"):
        assert key in r, key
    assert r["mode"] == "tiny" and r["shapes"]["tokens_per_step"] > 0
    assert r["compiled"] is False and set(r["impls"]) == set(WAYS)
    losses = []
    for way in WAYS:
        m = r["impls"][way]
        steps = m["step_tokens_per_sec"]
        assert len(steps) == len(m["losses"]) == r["steps"] > r["warmup_steps"]
        assert all(_finite_positive(s) for s in steps), (way, steps)
        assert _finite_positive(m["tokens_per_sec_median"])
        losses.append(m["loss_step1"])
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses  # the same model and batch
    for name in ("mesh3d_over_plain", "mesh3d_over_transformers"):
        ratio = r["ratios"][name]
        assert _finite_positive(ratio) and 0.2 <= ratio <= 5, (name, ratio)
        paired, (lo, hi) = r["ratios"][f"{name}_paired"], r["ratios"][f"{name}_paired_ci95"]
        assert _finite_positive(paired) and lo <= paired <= hi, (name, lo, paired, hi)
        assert len(r["ratios"][f"{name}_per_round"]) == r["steps"] - r["warmup_steps"]
    s = r["scaling"]
    assert s["cores"] == r["cores"] and s["eight_ranks"]["layout"] == "dp=2 tp=2 pp=2"
    assert len(s["eight_ranks"]["step_tokens_per_sec"]) == len(s["one_rank"]["step_tokens_per_sec"])
    assert _finite_positive(s["efficiency"]) and s["efficiency"] < 5, s["efficiency"]


def test_throughput_peer_tiny_writes_sane_json(tmp_path):
    out = tmp_path / "peer.json"
    cmd = [sys.executable, "benchmarks/throughput.py", "--peer", "--tiny", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| system | 1×1×1 | 2×2×2 | efficiency | over 1 thread |" in proc.stdout
    r = json.loads(out.read_text())
    ranks = {way: reps[0]["ranks"] for way, reps in r["runs"].items()}
    assert ranks == {"mesh3d_1x1x1_cores": 1, "mesh3d_1x1x1": 1, "plain_1x1x1": 1,
                     "mesh3d_2x2x2_reduce_scatter": 8, "mesh3d_tp2_all_reduce": 2}  # fmt: skip
    assert r["runs"]["mesh3d_1x1x1_cores"][0]["threads"] == os.cpu_count()
    assert r["efficiency"]["mesh3d_1x1x1_cores"]["median"] == 1.0
    assert r["efficiency_one_thread"]["mesh3d_1x1x1"]["median"] == 1.0
    ref = r["runs"]["mesh3d_1x1x1"][0]["losses"]
    for way, reps in r["runs"].items():
        assert len(reps) == r["repetitions"] >= 1
        for run in reps:
            assert len(run["step_tokens_per_sec"]) == len(run["losses"]) == r["steps"]
            assert all(_finite_positive(x) for x in run["step_tokens_per_sec"]), (way, run)
            assert _finite_positive(run["tokens_per_sec_median"])
            checked = [0, -1] if way.startswith("mesh3d") else [0]  # the loop's LR is constant
            for i in checked:
                assert abs(run["losses"][i] - ref[i]) <= 1e-4 * abs(ref[i]), (way, i, run["losses"])
        assert _finite_positive(r["efficiency"][way]["median"])
    assert r["loss_parity"]["ok"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_script_without_gpu_exits_cleanly():
    proc = subprocess.run(
        ["bash", "benchmarks/gpu.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no CUDA GPU" in proc.stdout
    dry = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "1.100B parameters" in dry.stdout
    line = next(x for x in dry.stdout.splitlines() if "mesh3d sdpa compile:" in x)
    assert "compile True, documents False, ranks 1 (config valid)" in line, line
    assert "plain sdpa compile" in dry.stdout
    line = next(x for x in dry.stdout.splitlines() if "mesh3d tp2 compile:" in x)
    assert "ranks 2 (config valid)" in line, line
    assert "plain sdpa docs: plain, attention sdpa, compile False, documents True" in dry.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke path")
def test_gpu_smoke_runs_the_float8_documents_and_async_tp_variants_on_cpu():
    pytest.importorskip("torchao", reason="the float8 variants need torchao (the dev extra has it)")
    only = ["--only", "float8", "--only", "docs", "--only", "async"]
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", *only], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("| ") and not line.startswith(("| variant", "|---")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells
    assert set(rows) == {"mesh3d sdpa float8", "mesh3d sdpa float8 compile", "plain sdpa docs",
                         "mesh3d tp2 compile async"}, proc.stdout  # fmt: skip
    for name in ("mesh3d sdpa float8", "mesh3d sdpa float8 compile", "plain sdpa docs"):
        tokens_per_sec = float(rows[name][1])
        assert math.isfinite(tokens_per_sec) and tokens_per_sec > 0, rows[name]
    note = rows["mesh3d tp2 compile async"][-1]
    assert note.startswith("refused:") and "mesh3d.async_tp" in note and "CUDA" in note, note


PICOTRON = os.environ.get("MESH3D_PICOTRON", "")


@pytest.mark.skipif(
    not Path(PICOTRON, "train.py").is_file() if PICOTRON else True,
    reason="no Picotron checkout: set MESH3D_PICOTRON to one (git clone "
    "https://github.com/huggingface/picotron) to run Picotron's step beside mesh3d's",
)
def test_picotron_peer_way_trains_at_1x1x1_and_2x2x2():
    """`throughput.py --peer --picotron` 's way: Picotron's own train.py, through
    benchmarks/_picotron.py, trains the toy peer shape on CPU at 1x1x1 and 2x2x2 (8 ranks) and
    reports a finite, positive rate and a finite loss for every step."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import _peer\n"
        "print(json.dumps({w: _peer.run_way(w, 'peer_tiny', 3, Path(sys.argv[1]))\n"
        "                  for w in ('picotron_1x1x1_cores', 'picotron_2x2x2')}))"
    )
    proc = subprocess.run([sys.executable, "-c", code, PICOTRON], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    assert {w: r["ranks"] for w, r in runs.items()} == {
        "picotron_1x1x1_cores": 1,
        "picotron_2x2x2": 8,
    }
    for way, run in runs.items():
        assert len(run["step_tokens_per_sec"]) == len(run["losses"]) == 3, (way, run)
        assert all(_finite_positive(x) for x in run["step_tokens_per_sec"]), (way, run)
        assert all(math.isfinite(x) and 0 < x < 10 for x in run["losses"]), (way, run)
