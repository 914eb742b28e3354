"""A plain run reads in an afternoon: what a default `mesh3d train` loads of mesh3d.

The run (one process, in place, 2 steps of the built-in default: a Llama on the prepared
standard-library data) ends by listing the mesh3d modules in `sys.modules` and their lines. No
optional capability (`mesh3d/extensions.py`'s table) and no other family's spec may be among
them, and the lines stay under `CEILING`: 18,606 lines in 114 modules before the optional parts
moved behind the extension point, 14,252 in 94 after; 14,395 in 93 with later work (the lighteval
checks, the streamed-data share, µP's rules and the BPE trainer imported where used; 14,568
with the hooks of fault tolerance and DoReMi in the schema, run, step and loop, their own
modules and checks loaded only when configured; 14,600 with the sbatch evaluation jobs, DoReMi's
per-domain datasets and the CPU pair's tp collectives moved out of tp_styles; 14,791 with
`torch_private` (also issue 43: torch's private APIs behind one version-checked module);
issue 43 asks for 10,000; the rest is the core itself: config, checks, checkpoint formats, the
parallel plan, the loop).
"""

from __future__ import annotations

import json
import subprocess
import sys

from launch import quiet_env

from mesh3d.extensions import CAPABILITIES
from mesh3d.models.registry import FAMILIES

CEILING = 14_800

_MEASURE = """
import json, sys
from mesh3d.launch import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
rows = {m: sum(1 for _ in open(mod.__file__)) for m, mod in sys.modules.items()
        if m.startswith("mesh3d") and getattr(mod, "__file__", "") and mod.__file__.endswith(".py")}
print("MODULES " + json.dumps(rows))
"""


def test_a_default_run_loads_the_core_only(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, "tokens.train_steps=2", "mesh3d.device=cpu"],
        cwd=tmp_path, env=quiet_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("MODULES "))
    rows = json.loads(line.removeprefix("MODULES "))
    optional = set(CAPABILITIES.values()) | {
        module for family, (module, _, _) in FAMILIES.items() if family != "llama"
    }
    assert sorted(optional & set(rows)) == []
    assert "mesh3d.models.llama_spec" in rows and "mesh3d.train.loop" in rows
    total = sum(rows.values())
    assert total <= CEILING, (total, sorted(rows.items(), key=lambda kv: -kv[1])[:15])
