"""lighteval's tasks chosen without its registry: a fresh process asked for Nanotron's
`lighteval|hellaswag|0|1` and `mmlu|5` with no network imports those two built-in task modules
and no other (lighteval 0.13's own registry imports all ~100, two of which need the network)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "lighteval", reason="lighteval is not installed: pip install 'mesh3d[lighteval]'"
)


def test_a_built_in_task_loads_alone_and_offline():
    code = (
        "import sys\n"
        "from mesh3d.evaluation.lighteval_tasks import task_configs, task_specs, make_registry\n"
        "specs = task_specs('lighteval|hellaswag|0|1,mmlu|5')\n"
        "registry = make_registry(specs, task_configs(specs, None))\n"
        "print(sorted(m for m in sys.modules if m.startswith('lighteval.tasks.tasks.')))\n"
        "print(len(registry.task_to_configs), registry.task_to_configs['hellaswag'][0].full_name)\n"
    )
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()  # fmt: skip
    assert out[-2] == "['lighteval.tasks.tasks.hellaswag', 'lighteval.tasks.tasks.mmlu']"
    assert out[-1] == "58 hellaswag|0"  # hellaswag and mmlu's 57 subjects
