"""Output paths that cannot be written (`checkpoints.checkpoints_path`, `--metrics-file`,
`mesh3d.tensorboard_dir`, convert's `--output`): one UserError line naming the key, the path,
the reason and the fix; nothing half-written. Runs as root: /proc/nope cannot be created."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from parity import TINY

from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.nanotron_weights import write_nanotron_weights
from mesh3d.checkpoint.run_folder import claim_folder
from mesh3d.config import LlamaConfig, config_from_dict
from mesh3d.convert import main as convert_main
from mesh3d.errors import UserError
from mesh3d.models.registry import spec_of
from mesh3d.train.metrics import JsonlWriter
from mesh3d.train.sinks import MetricSinks

NOPE = "/proc/nope"


def _bad(tmp_path, kind: str):
    """An uncreatable path, or an existing regular file where a folder is needed."""
    if kind == "uncreatable":
        return NOPE
    (tmp_path / "afile").write_text("keep")
    return str(tmp_path / "afile")


def _cfg(**mesh3d):
    d = copy.deepcopy(TINY)
    d["mesh3d"] |= {"wandb": False, **mesh3d}
    return d


@pytest.mark.parametrize("kind", ["uncreatable", "file"])
def test_checkpoints_path_that_cannot_be_written(tmp_path, kind):
    path = _bad(tmp_path, kind)
    cfg = config_from_dict(_cfg() | {"checkpoints": {"checkpoints_path": path,
                                                     "checkpoint_interval": 1}})  # fmt: skip
    with pytest.raises(UserError) as e:
        claim_folder(cfg, "run1")
    text = str(e.value)
    assert "`checkpoints.checkpoints_path`" in text and path in text and "choose a folder" in text
    assert "\n" not in text
    assert kind == "uncreatable" or sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("kind", ["uncreatable", "file", "directory"])
def test_metrics_file_that_cannot_be_written(tmp_path, kind):
    if kind == "directory":
        (tmp_path / "d").mkdir()
        path = str(tmp_path / "d")
    else:
        path = f"{_bad(tmp_path, kind)}/m.jsonl"
    with pytest.raises(UserError, match="^`--metrics-file` .*: cannot write there") as e:
        JsonlWriter(path)
    assert path in str(e.value) and "\n" not in str(e.value)
    left = {"uncreatable": [], "file": ["afile"], "directory": ["d"]}[kind]
    assert sorted(p.name for p in tmp_path.iterdir()) == left  # no temp file left


@pytest.mark.parametrize("kind", ["uncreatable", "file"])
def test_tensorboard_dir_that_cannot_be_written(tmp_path, kind):
    path = _bad(tmp_path, kind)
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"iteration": 1}\n')
    cfg = config_from_dict(_cfg(tensorboard_dir=path))
    error = MetricSinks(cfg, True, str(metrics)).error  # the loop raises it on every rank
    assert error.startswith("`mesh3d.tensorboard_dir` ") and "choose a folder" in error
    assert path in error
    assert metrics.read_text() == '{"iteration": 1}\n'  # the metrics file left as it was


@pytest.mark.parametrize("kind", ["uncreatable", "file"])
def test_to_hf_output_that_cannot_be_written(tmp_path, capsys, kind):
    mc = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=16,
                     vocab_size=64)  # fmt: skip
    step = tmp_path / "ck"
    model = spec_of(mc).build(mc, attention="sdpa")
    write_nanotron_weights(step / "model", model.state_dict(), convert.shape_of(mc), tp=1, pp=1)
    (step / "model_config.json").write_text(json.dumps(dataclasses.asdict(mc)))
    out = _bad(tmp_path, kind)
    with pytest.raises(SystemExit) as e:
        convert_main(["to-hf", "--checkpoint", str(step), "--output", out])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: `--output` {out}: cannot write there (") and "\n" not in err
    assert "choose a folder you can write" in err
    assert kind == "uncreatable" or (tmp_path / "afile").read_text() == "keep"
