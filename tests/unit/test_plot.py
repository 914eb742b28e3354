"""`mesh3d plot`: two synthetic metrics files make one PNG (signature, size, default path), the
validation curve appears only for a file with `val_loss`, a DoReMi proxy's domain weights get a
panel of their own, run labels, and the errors a new user meets: a missing, empty or non-JSON
file (named with its line), no matplotlib, and the CLI's exit code 2 without a traceback.

The tests of this subject that launch real processes are in `tests/launch/test_plot_launch.py`."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import sys
from pathlib import Path

import pytest

from mesh3d.errors import UserError
from mesh3d.plot import draw, main, read_metrics, run_labels, write_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed (pip install -e '.[dev]')",
)


def _metrics(path: Path, steps: int, val_every: int = 0, grad_norm: bool = True) -> Path:
    """A metrics file like --metrics-file's: loss decaying, lr warming up, val_loss every few."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(1, steps + 1):
        r = {"iteration": i, "lm_loss": 6 * math.exp(-i / 10), "lr": 1e-3 * min(1, i / 5),
             "tokens_per_sec": 7000.0 + i}  # fmt: skip
        if grad_norm:
            r["grad_norm"] = 1 / i
        if val_every and i % val_every == 0:
            r["val_loss"] = r["lm_loss"] + 0.2
        lines.append(json.dumps(r) + "\n")
    path.write_text("".join(lines))
    return path


@needs_matplotlib
def test_two_runs_make_one_png_next_to_the_first_file(tmp_path, capsys):
    a = _metrics(tmp_path / "run_a" / "metrics.jsonl", 30, val_every=5)
    b = _metrics(tmp_path / "run_b" / "metrics.jsonl", 20)
    main([str(a), str(b)])
    out = tmp_path / "run_a" / "metrics.png"
    assert capsys.readouterr().out == f"{out}\n"
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert struct.unpack(">II", data[16:24]) == (1200, 800)  # IHDR: 12 x 8 inches at 100 dpi
    assert 20_000 < len(data) < 2_000_000
    assert sorted(p.name for p in out.parent.iterdir()) == ["metrics.jsonl", "metrics.png"]

    chosen = write_plot([a], tmp_path / "plots" / "a.svg")  # folder made, type from the suffix
    assert chosen == tmp_path / "plots" / "a.svg" and b"<svg" in chosen.read_bytes()[:500]


@needs_matplotlib
def test_validation_curve_only_for_a_run_that_has_it(tmp_path):
    with_val = read_metrics(_metrics(tmp_path / "a.jsonl", 30, val_every=10))
    without = read_metrics(_metrics(tmp_path / "b.jsonl", 20, grad_norm=False))
    loss, lr, grad_norm, throughput = draw([("a", with_val), ("b", without)]).axes
    assert [line.get_label() for line in loss.lines] == ["a train", "a validation", "b train"]
    assert [line.get_color() for line in loss.lines] == ["C0", "C0", "C1"]
    validation = loss.lines[1]
    assert list(validation.get_xdata()) == [10, 20, 30] and validation.get_linestyle() == "--"
    assert list(validation.get_ydata()) == [with_val[i]["val_loss"] for i in (9, 19, 29)]
    assert [len(ax.lines) for ax in (lr, grad_norm, throughput)] == [2, 1, 2]  # b: no grad_norm
    assert list(throughput.lines[1].get_xdata()) == list(range(1, 21))

    assert loss.lines[0].get_marker() in ("", "None")  # a line; one logged step is a dot
    assert draw([("c", with_val[:1])]).axes[0].lines[0].get_marker() == "o"
    (empty_panel,) = draw([("b", without)]).axes[2].texts
    assert empty_panel.get_text() == "no grad_norm in these files"
    nan = [dict(r, lm_loss=float("nan")) for r in without]  # a diverged run: not "missing"
    assert draw([("n", nan)]).axes[0].texts[0].get_text() == "lm_loss / val_loss: no finite value"


@needs_matplotlib
def test_a_doremi_proxys_domain_weights_get_their_own_panel(tmp_path):
    records = read_metrics(_metrics(tmp_path / "proxy.jsonl", 5))
    for r in records:
        w = 1 - 0.5 / r["iteration"]
        r.update({"doremi/weight/easy": w, "doremi/weight/hard": 1 - w})
    fig = draw([("proxy", records)])
    *_, weights, unused = fig.axes
    assert not unused.get_visible() and weights.get_title() == "DoReMi domain weights"
    assert [line.get_label() for line in weights.lines] == ["proxy easy", "proxy hard"]
    assert [line.get_color() for line in weights.lines] == ["C0", "C1"]  # a colour per domain
    assert list(weights.lines[0].get_ydata()) == [r["doremi/weight/easy"] for r in records]
    assert len(draw([("plain", read_metrics(tmp_path / "proxy.jsonl"))]).axes) == 4


def test_run_labels():
    assert run_labels([Path("runs/a/metrics.jsonl"), Path("runs/b/metrics.jsonl")]) == ["a", "b"]
    assert run_labels([Path("runs/first.jsonl"), Path("runs/second.jsonl")]) == [
        "first",
        "second",
    ]
    assert run_labels([Path("x/m.jsonl"), Path("y/x/m.jsonl")]) == ["x/m.jsonl", "y/x/m.jsonl"]


BAD_FILES = {  # name: (file text or None for no file, fragments of the message)
    "missing": (None, ["does not exist", "--metrics-file"]),
    "empty": ("", ["is empty", "logging.iteration_step_info_interval"]),
    "blank-lines": ("\n\n", ["is empty"]),
    "not-json": ('{"iteration": 1, "lm_loss": 2.0}\n\n{"iteration": 2, "lm_lo\n', ["line 3 is not JSON"]),
    "not-a-record": ('{"iteration": 1}\n[1, 2]\n', ["line 2 is not a metrics record", "'iteration'"]),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_metrics_files_name_the_file_and_line(case, tmp_path):
    text, fragments = BAD_FILES[case]
    path = tmp_path / "run" / "metrics.jsonl"
    if text is not None:
        path.parent.mkdir()
        path.write_text(text)
    with pytest.raises(UserError) as e:
        write_plot([path], tmp_path / "out.png")
    assert str(path) in str(e.value)
    for fragment in fragments:
        assert fragment in str(e.value)
    assert not (tmp_path / "out.png").exists()


@needs_matplotlib
def test_unknown_image_type_is_refused(tmp_path):
    path = _metrics(tmp_path / "metrics.jsonl", 3)
    with pytest.raises(UserError, match=r"--output .*out\.xyz: matplotlib cannot write a '\.xyz'"):
        write_plot([path], tmp_path / "out.xyz")


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    path = _metrics(tmp_path / "metrics.jsonl", 3)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` -> ImportError
    with pytest.raises(UserError, match=r"needs matplotlib.*pip install matplotlib.*\[dev\]"):
        write_plot([path], tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()
