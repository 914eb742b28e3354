"""Memory per dp rank for zero_stage 0, zero_stage 1 and mesh3d.full_shard on one config.

    python benchmarks/zero_memory.py [--dp 2] [--tp 1] [--steps 3] [--config F] [key=value ...]

Each mode trains the config (cpu_tiny.yaml + DEFAULTS + overrides) on freshly forked gloo ranks,
which then run one more real `train_step` on the model and optimizer `train(hooks=[KeepModel()])`
returned, with sampling hooks. Bytes per rank (local shards): params_rest after the run;
params_peak = most parameter storage held at a sample point (after each layer's forward, as its
output gradient arrives in backward, before optimizer.step; FSDP's gathered copies count, storage
it freed does not); grads right before optimizer.step; optim = AdamW exp_avg + exp_avg_sq.
maxrss = ru_maxrss; rss_* count from before the model is built: rss_rest after the run, rss_run
its peak, rss_step the extra step's peak over its start. Expected (P = a tp rank's full parameter
bytes): zero 0: P, P, P, 2P; zero 1 (FSDP, no reshard after forward): P/dp, P/dp + P, P/dp,
2P/dp; full (mesh3d.full_shard): the same but peak P/dp + root + one layer. Results go to
`benchmarks/results/local/zero_memory.json` (`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import shlex
import sys
import time
import types
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (FSDP imports it lazily: ~30 MiB RSS the ranks now inherit)
import torch.distributed as dist
from _ranks import (  # benchmarks/ is on sys.path when a script runs
    M_MMAP_THRESHOLD,
    launch,
    mallopt,
)
from _results import add_publish_flag, results_dir
from torch.distributed.tensor import DTensor

from mesh3d.checks import validate
from mesh3d.config import global_batch_size, load_config
from mesh3d.data.dummy import DummyTokens, microbatches
from mesh3d.layout import RunLayout
from mesh3d.parallel.parallelize import canonical_name
from mesh3d.train.build import ModelParts
from mesh3d.train.hooks import KeepModel
from mesh3d.train.loop import train
from mesh3d.train.loss import step_loss
from mesh3d.train.step import train_step

ROOT = Path(__file__).resolve().parents[1]
# cpu_tiny at hidden 512: ~11.9M parameters (45 MiB fp32), one 4 x 64-token microbatch per rank.
DEFAULTS = ["model.model_config.hidden_size=512", "model.model_config.intermediate_size=1376",
            "tokens.sequence_length=64", "tokens.micro_batch_size=4",
            "tokens.batch_accumulation_per_replica=1", "logging.log_level=warning",
            "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "mesh3d.device=cpu"]  # fmt: skip
MODES = {"zero0": (0, "false"), "zero1": (1, "false"), "full": (1, "true")}  # zero, full_shard
MiB = 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors if t is not None)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct, allocated storages behind `tensors` (views counted once)."""
    storages = [_local(t).untyped_storage() for t in tensors if t is not None]
    return sum({s.data_ptr(): s.nbytes() for s in storages if s.nbytes()}.values())


def proc_status_kib(key: str) -> int:
    lines = Path("/proc/self/status").read_text().splitlines()
    return next((int(ln.split()[1]) for ln in lines if ln.startswith(key + ":")), 0)


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError):  # "5" resets VmHWM (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")


def tp_local_bytes(p: torch.Tensor) -> int:
    """Bytes of `p` on one tp rank if it were not sharded over dp."""
    n = p.numel()
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ()
        for i, (name, pl) in enumerate(zip(names, p.placements)):
            if name == "tp" and pl.is_shard():
                n = -(-n // p.device_mesh.size(i))
    return n * p.element_size()


def expected(model: torch.nn.Module, mode: str, dp: int) -> dict:
    units: dict[str, int] = {}  # FSDP units: "root" and one per decoder layer
    for name, p in model.named_parameters():
        parts = canonical_name(name).split(".")
        unit = parts[1] if parts[0] == "layers" else "root"
        units[unit] = units.get(unit, 0) + tp_local_bytes(p)
    P = sum(units.values())
    if mode == "replicate":
        return dict(params_rest=P, params_peak=P, grads=P, optim=2 * P)
    layer = max((b for u, b in units.items() if u != "root"), default=0)
    peak = P // dp + (P if mode == "zero1" else units.get("root", 0) + layer)
    return dict(params_rest=P // dp, params_peak=peak, grads=P // dp, optim=2 * P // dp)


def measure(rank: int, world: int, cfg, steps: int) -> dict:
    """One rank: train, then one sampled extra step; what it held."""
    rss0, t0 = proc_status_kib("VmRSS"), time.time()
    reset_peak_rss()
    res = train(cfg, hooks=[KeepModel()])
    train_s, run_peak, rss1 = time.time() - t0, proc_status_kib("VmHWM"), proc_status_kib("VmRSS")
    model, optimizer, group = res.model, res.optimizer, res.mesh["dp"].get_group()
    layout = RunLayout.resolve(cfg, world, rank)
    mode, dp = layout.dp_mode, cfg.parallelism.dp
    rest = list(model.parameters())  # at rest: the shards, under FSDP
    meas = dict(params_rest=local_bytes(rest))
    peak = dict(params=0, params_grads=0)

    def sample(*_):
        held = rest + list(model.parameters())  # + the gathered params FSDP swapped in
        p, g = storage_bytes(held), storage_bytes([q.grad for q in held])
        peak.update(params=max(peak["params"], p), params_grads=max(peak["params_grads"], p + g))

    def after_layer(module, args, output):
        sample()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(sample)  # in backward, before this layer's gradients

    def before_step(opt, args, kwargs):
        sample()
        meas["grads"] = local_bytes([q.grad for q in model.parameters()])

    for layer in model.layers.values():  # hooks stay: the model dies with the rank
        layer.register_forward_hook(after_layer)
    optimizer.register_step_pre_hook(before_step)
    mc, tok, gbs = cfg.model.model_config, cfg.tokens, global_batch_size(cfg)
    data = DummyTokens(mc.vocab_size, tok.sequence_length, cfg.general.seed, cfg.mesh3d.dummy_data)
    batches = microbatches(data, steps + 1, gbs, dist.get_rank(group), dp, tok.micro_batch_size)
    reset_peak_rss()
    no_lr = types.SimpleNamespace(step=lambda: None)  # the LR stays where the run left it
    loss_fn = step_loss(layout)
    train_step(ModelParts(modules=[model], loss_fn=loss_fn), optimizer, no_lr, batches,
               layout=layout, clip_grad=cfg.optimizer.clip_grad, mesh=res.mesh,
               device=torch.device("cpu"))  # fmt: skip
    step_peak = proc_status_kib("VmHWM")
    state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    kib = dict(maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rss_rest=rss1 - rss0)
    kib.update(rss_run=max(run_peak, step_peak) - rss0, rss_step=step_peak - rss1)
    meas.update({k: v * 1024 for k, v in kib.items()}, optim=local_bytes(state), train_s=train_s)
    meas.update(params_peak=peak["params"], params_grads_peak=peak["params_grads"])
    return dict(rank=rank, measured=meas, expected=expected(model, mode, dp))


def _fixed_mmap() -> None:
    """A fixed M_MMAP_THRESHOLD: freed tensors > 64 KiB go back to the OS, RSS tracks live ones."""
    mallopt(M_MMAP_THRESHOLD, 64 * 1024)


def table(modes: dict) -> str:
    keys = ["params_rest", "params_peak", "grads", "optim"]
    more = ["params_grads_peak", "maxrss", "rss_rest", "rss_run", "rss_step"]
    head = ["mode", "rank", *keys, *more, "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, m in modes.items():
        for r in m["ranks"]:
            meas, exp = r["measured"], r["expected"]
            cells = [mode, r["rank"], *(f"{meas[k] / MiB:.1f} / {exp[k] / MiB:.1f}" for k in keys)]
            cells += [f"{meas[k] / MiB:.1f}" for k in more] + [f"{m['seconds']:.1f}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of MODES")
    ap.add_argument("--config", default=str(ROOT / "recipes/configs/cpu_tiny.yaml"))
    add_publish_flag(ap)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, key=value")
    a = ap.parse_args()
    layout = [f"parallelism.dp={a.dp}", f"parallelism.tp={a.tp}", f"tokens.train_steps={a.steps}"]
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"torch {torch.__version__} | cores {os.cpu_count()} | {now}")
    print(f"config: {os.path.relpath(a.config)} + {' '.join(DEFAULTS + layout + a.overrides)}\n")
    modes, t_all = {}, time.time()
    for mode in a.modes.split(","):
        flags = [f"optimizer.zero_stage={MODES[mode][0]}", f"mesh3d.full_shard={MODES[mode][1]}"]
        cfg = load_config(a.config, DEFAULTS + layout + flags + a.overrides)
        validate(cfg, world_size=a.dp * a.tp)  # here, not as one traceback per rank
        t0 = time.time()
        ranks = launch(a.dp * a.tp, measure, cfg, a.steps, setup=_fixed_mmap)
        modes[mode] = dict(overrides=flags, seconds=time.time() - t0, ranks=ranks)
    out = results_dir(a.publish) / "zero_memory.json"
    meta = dict(command=sys.argv, torch=torch.__version__, cores=os.cpu_count(), date=now)
    meta.update(config=os.path.relpath(a.config), overrides=DEFAULTS + layout + a.overrides)
    out.write_text(json.dumps({**meta, "modes": modes}, indent=2) + "\n")
    print("MiB per rank; 4 columns measured / expected (see the docstring); s = mode wall\n")
    print(table(modes) + f"\n\ntotal {time.time() - t_all:.1f}s; wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
