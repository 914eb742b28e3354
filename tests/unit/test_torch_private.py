"""torch's private APIs are reached in one place, `mesh3d/torch_private.py` (issue 43).

- no other module of mesh3d imports a private torch module or name, reaches a `_name` through
  torch, or reads one of torch's private attributes off an object (a DTensor's `_spec`, a
  module's `_parameters`, a loader iterator's `_workers`, ...); names in strings (logger
  names, aten op names) and in comments or docstrings are free;
- the module imports nothing but torch and `mesh3d.errors` when it is imported;
- the accessors that need no process group work on this torch; an accessor whose private API
  is gone raises one `UserError` line naming it, the torch version and the verified range,
  inside or outside that range; outside it, what is there still works.

The DTensor, DeviceMesh and c10d accessors need a process group: they are checked in
`tests/ranks/test_torch_private_ranks.py`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mesh3d import torch_private as tp
from mesh3d.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mesh3d"

# torch's private attributes reached through an object rather than through `torch.` (a name
# of mesh3d's own objects must not be one of these)
PRIVATE_ATTRIBUTES = {
    "_spec", "_local_tensor", "_apply", "_partition_linear_fn", "_partition_embedding_fn",
    "_modules", "_parameters", "_buffers", "_version", "_flatten", "_unflatten",
    "_get_default_store", "_set_pg_timeout", "_step_count", "_last_lr", "_timeout", "_workers",
    "_index_queues", "_shutdown_workers", "_grouped_mm", "_current_graph_task_id",
    "_micro_pipeline_tp", "_PipelineSchedule", "_flatten_dense_tensors",
    "_unflatten_dense_tensors",
}  # fmt: skip


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str) -> list[str]:
    """`line: what` for every private torch API `source` reaches outside strings."""
    tree, found, torch_names = ast.parse(source), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add(alias.asname or "torch")
                    if any(map(_private, alias.name.split("."))):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            torch_names.update(a.asname or a.name for a in node.names)
            names = [a.name for a in node.names]
            if any(map(_private, node.module.split("."))) or any(map(_private, names)):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(names)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr in PRIVATE_ATTRIBUTES or _root(node.value) in torch_names:
                found.append(f"{node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and (node.args[1].value in PRIVATE_ATTRIBUTES
                   or _root(node.args[0]) in torch_names and _private(str(node.args[1].value)))):  # fmt: skip
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_the_checker_finds_each_kind_of_use():
    source = (
        "import torch\nimport torch.distributed as dist\nfrom torch._utils import x\n"
        "from torch.distributed import _symmetric_memory\nimport torch._dynamo\n"
        "a = p._local_tensor\nb = torch._C._current_graph_task_id()\n"
        "c = dist.distributed_c10d._private_thing\nd = getattr(it, '_workers', [])\n"
        "e = hasattr(torch, '_grouped_mm')\nstyle._apply(m, mesh)\n"
        "logger = 'torch.distributed.tensor._redistribute'  # a string: free\n"
        "ok = self._mine + other._own\n"
    )
    lines = sorted(int(use.split(":")[0]) for use in private_uses(source))
    assert sorted(set(lines)) == [3, 4, 5, 6, 7, 8, 9, 10, 11], private_uses(source)


def test_only_torch_private_reaches_private_torch_apis():
    uses = [f"{path.relative_to(ROOT)}:{use}" for path in sorted(PACKAGE.rglob("*.py"))
            if path.name != "torch_private.py"
            for use in private_uses(path.read_text())]  # fmt: skip
    assert uses == [], "private torch APIs outside mesh3d/torch_private.py:\n" + "\n".join(uses)


def test_the_module_imports_only_torch_and_errors_at_import():
    tree = ast.parse((PACKAGE / "torch_private.py").read_text())
    top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert top == {"__future__", "torch", "mesh3d.errors"}


def test_the_verified_range_starts_at_the_pyproject_floor():
    floor = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert tuple(int(x) for x in floor.split(".")) == tp.FLOOR
    assert tp.in_verified_range("2.13.0+cpu") and tp.in_verified_range("2.6.0")
    assert not tp.in_verified_range("2.5.1") and not tp.in_verified_range("2.14.0")
    assert not tp.in_verified_range("nightly")
    assert tp.in_verified_range(torch.__version__) == tp.VERIFIED


@pytest.mark.parametrize("version, where", [("2.99.0", "outside"), ("2.13.0", "inside")])
def test_a_missing_private_api_is_one_line_naming_it_the_version_and_the_range(
    monkeypatch, version, where
):
    monkeypatch.setattr(tp, "TORCH_VERSION", version)
    monkeypatch.delattr(torch._utils, "_flatten_dense_tensors")
    monkeypatch.setattr(tp, "_GROUPED_MM", None)
    errors = []
    for call in (lambda: tp.flatten_dense_tensors([torch.ones(2)]),
                 lambda: tp.local_tensor(torch.ones(2)),  # not a DTensor: no `_local_tensor`
                 lambda: tp.grouped_mm(torch.ones(2, 2), torch.ones(1, 2, 2), torch.tensor([2])),
                 lambda: tp.set_scheduler_position(object(), 1, [0.1])):  # fmt: skip
        with pytest.raises(UserError) as e:
            call()
        errors.append(str(e.value))
    apis = ["torch._utils._flatten_dense_tensors", "DTensor._local_tensor", "torch._grouped_mm",
            "LRScheduler._step_count"]  # fmt: skip
    for message, api in zip(errors, apis, strict=True):
        assert "\n" not in message
        assert (
            f"mesh3d needs {api}, a private torch API missing from torch {version} ({where} "
            in message
        )
        assert "torch 2.6 to 2.13" in message
    assert not tp.grouped_mm_available()


def test_outside_the_range_what_is_there_still_works(monkeypatch):
    monkeypatch.setattr(tp, "TORCH_VERSION", "2.99.0")
    a, b = torch.arange(3.0), torch.arange(4.0)
    flat = tp.flatten_dense_tensors([a, b])
    assert flat.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert [t.tolist() for t in tp.unflatten_dense_tensors(flat, [a, b])] == [
        a.tolist(),
        b.tolist(),
    ]


def test_grouped_mm_is_one_gemm_per_group():
    if not tp.grouped_mm_available():
        pytest.skip(f"torch {torch.__version__} has no grouped GEMM")
    rows, w = torch.randn(5, 4), torch.randn(2, 4, 8)  # rows 16-byte aligned, as the kernel needs
    out = tp.grouped_mm(rows, w, offs=torch.tensor([2, 5], dtype=torch.int32))
    torch.testing.assert_close(out, torch.cat([rows[:2] @ w[0], rows[2:] @ w[1]]))


def test_in_backward_recompute_is_true_inside_backward_only():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(tp.in_backward_recompute())
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(tp.in_backward_recompute())
            return g

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == [False, True]


def test_module_tensor_scheduler_and_loader_accessors():
    lin = nn.Sequential(nn.Linear(2, 2))
    assert tp.child_slots(lin) == {"0": lin[0]}
    assert tp.parameter_slots(lin[0])["weight"] is lin[0].weight
    t = torch.zeros(2)
    before = tp.version_counter(t)
    t.add_(1)
    assert tp.version_counter(t) == before + 1

    optimizer = torch.optim.SGD(lin.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.5**k)
    tp.set_scheduler_position(scheduler, 4, [0.125])
    assert scheduler._step_count == 4 and scheduler.get_last_lr() == [0.125]

    it = iter(torch.utils.data.DataLoader(range(4), num_workers=0))
    tp.set_loader_timeout(it, 2.0)
    assert it._timeout == 2.0 and tp.loader_workers(it) == []
    tp.shutdown_loader_workers(it)  # no workers: nothing to do


def test_the_lazily_imported_apis(monkeypatch):
    from torch._functorch import config as functorch_config
    from torch.distributed.pipelining import ScheduleGPipe

    assert isinstance(tp.inductor_cache_dir(), str)
    assert isinstance(tp.compile_counters()["aot_autograd"]["autograd_cache_hit"], int)
    wrapped = tp.checkpoint_wrapper(nn.Linear(2, 2), preserve_rng_state=False)
    assert wrapped(torch.ones(1, 2)).shape == (1, 2)
    assert issubclass(ScheduleGPipe, tp.pipeline_schedule_base())
    monkeypatch.setattr(functorch_config, "donated_buffer", True)
    tp.disable_donated_buffer()
    assert functorch_config.donated_buffer is False
    with pytest.raises(UserError, match="torch.no_such._private.thing"):
        tp._from("torch.no_such._private", "thing")
