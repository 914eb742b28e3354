"""benchmarks/moe.py --quick, run as a user would (a subprocess).

It exits 0, prints its table and writes the JSON: every step of both models has positive, finite
seconds and loss, all start from about ln(vocab) (random ids), the MoE model's grouped-GEMM
and expert-loop runs have the same losses; the medians and both ratios
are positive and finite, the per-round median inside its bootstrap interval; the parameter
counts are the ones designed (active MoE = dense + the routers, total MoE = active + the idle
experts, worked out by hand from the shape); the profile shares are in [0, 1], sum to 1 and give
the expert matmuls a nonzero share. The expert-parallel comparison (2 forked ranks, dp2 ep1,
ep2 all-to-all and ep2 all-gather): every step of both ranks timed and finite, all start from
about ln(vocab), the two ep2 dispatchers give the same losses, the ratios inside their
intervals, each dispatch share in (0, 1). Nothing asserts a speed: a shared CPU is noisy.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_moe_quick_writes_sane_json(tmp_path):
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "benchmarks/moe.py", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| model | params |" in proc.stdout and "| dp2 ep2 | 4 | all-gather |" in proc.stdout
    assert "ep2 all-gather / all-to-all step time" in proc.stdout
    r = json.loads(out.read_text())
    assert r["mode"] == "quick" and r["tokens_per_step"] == 2 * 256
    for way in ("moe", "moe_loop", "dense"):
        run = r["runs"][way]
        assert len(run["seconds"]) == len(run["loss"]) == r["rounds"]
        assert all(map(_positive, run["seconds"] + run["loss"])), way
        assert abs(run["loss"][0] - math.log(2048)) < 0.5, run["loss"][0]
        assert _positive(r["summary"]["tokens_per_s_median"][way])
    t = r["summary"]
    assert _positive(t["ratio_of_medians"]) and _positive(t["ratio_paired_median"])
    lo, hi = t["ratio_paired_ci95"]
    assert 0 < lo <= t["ratio_paired_median"] <= hi
    lo, hi = t["grouped_over_loop_ci95"]
    assert 0 < lo <= t["grouped_over_loop_median"] <= hi
    # the grouped GEMM and the loop over experts: the same model, the same losses (fp32)
    for a, b in zip(r["runs"]["moe"]["loss"], r["runs"]["moe_loop"]["loss"]):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    # hidden 256, 4 layers, 8 heads (4 kv, dh 32), vocab 2048 untied; 8 experts of 384, top 2
    h, layers, vocab, f, e, k = 256, 4, 2048, 384, 8, 2
    attn = 2 * h * h + 2 * h * 128 + 2 * h  # q, o; k, v; two norms
    dense = 2 * vocab * h + h + layers * (attn + 3 * h * k * f)
    p = r["params"]
    assert p["dense"] == {"total": dense, "active": dense} and p["moe_loop"] == p["moe"]
    assert p["moe"]["active"] == dense + layers * e * h  # + the routers
    assert p["moe"]["total"] == p["moe"]["active"] + layers * (e - k) * 3 * h * f
    shares = r["profile"]
    assert all(0 <= v <= 1 for v in shares.values()) and abs(sum(shares.values()) - 1) < 1e-9
    assert shares["expert matmuls"] > 0 and shares["dispatch"] > 0 and shares["router"] > 0
    e = r["expert_parallel"]
    ways = ("ep1", "ep2", "ep2_allgather")
    assert e["rounds"] == 4 and sorted(e["ranks"]) == ["0", "1"]  # JSON keys
    for rank in e["ranks"].values():
        for way in ways:
            assert len(rank["seconds"][way]) == e["rounds"], way
            assert all(map(_positive, rank["seconds"][way])), way
            assert abs(rank["loss"][way][0] - math.log(2048)) < 0.5, rank["loss"][way][0]
        for a, b in zip(rank["loss"]["ep2_allgather"], rank["loss"]["ep2"]):
            assert abs(a - b) <= 1e-5 * abs(b), (a, b)
        assert sorted(rank["comm"]) == ["ep2", "ep2_allgather"]
        for way, secs in rank["comm"].items():
            assert len(secs) == e["rounds"] and all(map(_positive, secs)), way
    for key in ("ep2_over_ep1", "allgather_over_alltoall"):
        lo, hi = e[f"{key}_ci95"]
        assert 0 < lo <= e[f"{key}_median"] <= hi, key
    assert all(_positive(e["step_s_median"][w]) for w in ways)
    for way in ("ep2", "ep2_allgather"):
        assert 0 < e["comm_share_median"][way] < 1 and _positive(e["comm_s_median"][way]), way
