"""benchmarks/overhead.py --quick, run as a user would (a subprocess).

It exits 0 (the layouts' losses agree), prints one table row per layout with a positive step time
and shares that add up to about 100%, no DTensor op at 1x1x1, and at tp2 the DTensor op count of
a step whose blocks compute on local tensors: 238 with these toy shapes (2 layers, 4 microbatches).
Before the local styles (each block's ops dispatched as DTensors) the same step took over 1,200;
the bound catches a return to that. Nothing asserts a speed: a shared CPU is noisy.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_overhead_quick_profiles_each_layout(tmp_path):
    cmd = [sys.executable, "benchmarks/overhead.py", "--quick", "--out", str(tmp_path / "o.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.match(
            r"\| (1x1x1|tp2 all-reduce) \| (\d) \| (\d+) \| [\d,]+ \| ([\d,]+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|",
            line,
        )
        if m:
            rows[m.group(1)] = [int(x.replace(",", "")) for x in m.groups()[1:]]
    assert set(rows) == {"1x1x1", "tp2 all-reduce"}, proc.stdout
    for name, (_ranks, step_ms, _ops, *pct) in rows.items():
        assert step_ms > 0 and 96 <= sum(pct) <= 104, (name, pct)
    assert rows["1x1x1"][0] == 1 and rows["1x1x1"][2] == 0
    assert rows["tp2 all-reduce"][0] == 2 and 0 < rows["tp2 all-reduce"][2] < 400, rows
    saved = json.loads((tmp_path / "o.json").read_text())["layouts"]
    assert {k: v["dtensor_ops"] for k, v in saved.items()} == {k: v[2] for k, v in rows.items()}
