"""A process killed in the middle of writing a checkpoint leaves the previous one loadable, and
damaged training-state files give their own clear errors.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_checkpoint_crash.py`."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import torch
from dist import run_ranks
from parity import layout_overrides, train_runs
from safetensors.torch import load_file

from mesh3d.checkpoint.training import resolve_step_dir

LAYOUT = layout_overrides(1, 1, "ALL_REDUCE", 0, True) + ["parallelism.pp=1"]


def _ckpt(root, steps, resume=None):
    out = LAYOUT + [f"checkpoints.checkpoints_path={root}", "checkpoints.checkpoint_interval=2"]
    out.append(f"tokens.train_steps={steps}")
    return out + ([f"checkpoints.resume_checkpoint_path={resume}"] if resume else [])


def _train_and_die_in_save_of_step_4(root: str) -> None:
    """Child process: train with a save every 2 steps; SIGKILL itself inside step 4's save, after
    some of its weight files are on disk."""
    from mesh3d.checkpoint.folder import FolderWriter

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE="1", RANK="0")
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(root, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    written = []
    real_save_tensors = FolderWriter.save_tensors

    def save_tensors(self, rel, tensors, metadata=None):
        real_save_tensors(self, rel, tensors, metadata)
        if self.folder.name == ".tmp-4":
            written.append(rel)
            if len(written) == 3:
                os.kill(os.getpid(), signal.SIGKILL)

    FolderWriter.save_tensors = save_tensors
    train_runs(0, 1, [_ckpt(os.path.join(root, "ck"), 6)])


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    child = multiprocessing.get_context("fork").Process(
        target=_train_and_die_in_save_of_step_4, args=(str(tmp_path),)
    )
    child.start()
    child.join(timeout=180)
    assert child.exitcode == -signal.SIGKILL, child.exitcode
    root = tmp_path / "ck"
    assert (root / "latest.txt").read_text() == "2"
    assert (root / ".tmp-4").is_dir() and not (root / "4").exists()
    assert resolve_step_dir(root) == root / "2"
    # the surviving checkpoint resumes exactly; the next save replaces the stale temporary folder
    straight, resumed = run_ranks(
        1, train_runs, [_ckpt(tmp_path / "straight", 4), _ckpt(root, 4, resume=root)], timeout=200
    )[0]
    assert resumed["loss"] == straight["loss"][2:]
    assert (root / "latest.txt").read_text() == "4"
    assert not (root / ".tmp-4").exists() and (root / "4" / "checkpoint_metadata.json").is_file()


def test_bf16_checkpoint_keeps_fp32_masters(tmp_path):
    bf16 = ["model.dtype=bfloat16", "optimizer.accumulate_grad_in_fp32=true"]
    root = tmp_path / "ck"
    straight, _, resumed = run_ranks(
        1,
        train_runs,
        [_ckpt(tmp_path / "s", 4) + bf16, _ckpt(root, 2) + bf16, _ckpt(root, 4, root) + bf16],
        timeout=200,
    )[0]
    assert resumed["loss"] == straight["loss"][2:]  # exact: the fp32 masters were restored
    step = root / "2"
    payload = torch.load(
        step / "optimizer" / "optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt", weights_only=True
    )
    masters = payload["gradient_accumulator"]
    assert set(masters) == set(payload["names"].values())
    assert all(t.dtype == torch.float32 for t in masters.values())
    config = json.loads((step / "optimizer" / "optimizer_config.json").read_text())
    assert config["type"] == "OptimizerFromGradientAccumulator"
    norm = step / "model" / "model" / "final_layer_norm" / "pp_block" / "model_weight.safetensors"
    assert load_file(norm)["data"].dtype == torch.bfloat16  # weights in the model dtype
