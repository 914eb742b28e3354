"""benchmarks/context_parallel.py --quick, run as a user would (a subprocess), and the properties
of what it measured:

- saved-for-backward bytes per rank fall as cp grows (cp 1 > cp 2 > cp 4, on rank 0 and on the
  worst rank), and the script's analytic estimate is within 5% of each measured value;
- under the cap (cp 1's own saved bytes at the cap length), cp 1's longest sequence is the cap
  length itself and the longest sequence grows with cp; each is a multiple of 2·cp, fits the cap,
  and the next length the search tried does not;
- the step-time ratios (cp 2 / cp 1, cp 1 / cp 1 on one thread) and every step time are
  positive and finite, and cp 1 ran on 2 threads against 1 per cp 2 rank.

Timings on a shared CPU are noisy, so nothing here asserts a speed.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_context_parallel_quick(tmp_path):
    out = tmp_path / "cp.json"
    cmd = [sys.executable, "benchmarks/context_parallel.py", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for title in ("1. Saved for backward", "2. Longest sequence", "3. Step time"):
        assert title in proc.stdout, title
    r = json.loads(out.read_text())
    assert r["mode"] == "quick"
    mem = {int(cp): m for cp, m in r["memory"].items()}
    assert sorted(mem) == [1, 2, 4]

    rank0 = [mem[cp]["ranks"][0]["saved"] for cp in (1, 2, 4)]
    worst = [mem[cp]["ranks"][0]["saved_max"] for cp in (1, 2, 4)]
    assert rank0[0] > rank0[1] > rank0[2] > 0, rank0
    assert worst[0] > worst[1] > worst[2] > 0, worst
    for cp, m in mem.items():
        assert len(m["ranks"]) == cp
        assert max(x["saved"] for x in m["ranks"]) == m["ranks"][0]["saved_max"]
        for rank, x in enumerate(m["ranks"]):
            estimate = m["analytic"][rank]["total"]
            assert abs(estimate / x["saved"] - 1) < 0.05, (cp, rank, estimate, x["saved"])

    cap, cap_seq = r["cap_bytes"], r["settings"]["cap_seq"]
    longest = [mem[cp]["ranks"][0]["longest"] for cp in (1, 2, 4)]
    assert longest[0] == cap_seq, (longest, cap_seq)
    assert longest[0] < longest[1] < longest[2], longest
    for cp, m in mem.items():
        r0 = m["ranks"][0]
        assert r0["cap"] == cap and r0["longest"] % (2 * cp) == 0
        probes = dict(r0["probes"])
        assert probes[r0["longest"]] <= cap
        assert probes[r0["longest"] + 2 * cp] > cap  # the search tried the next length
        assert all(x["longest"] == r0["longest"] for x in m["ranks"])  # the ranks agree
        lengths = sorted(probes)
        assert all(probes[a] < probes[b] for a, b in zip(lengths, lengths[1:])), probes

    t = r["timing"]
    assert t["threads"] == {"cp1": 2, "cp2": 1, "cp1_1thread": 1}
    for name, times in t["step_s"].items():
        assert len(times) == t["rounds"] and all(_positive(x) for x in times), name
    for key in ("cp2/cp1", "cp1/cp1_1thread"):
        ratio = t["ratios"][key]
        assert _positive(ratio["of_medians"]) and _positive(ratio["per_round_median"]), key
        low, high = ratio["per_round_ci95"]
        assert low <= ratio["per_round_median"] <= high, key
    assert all(math.isfinite(x) for x in t["last_loss"].values())
