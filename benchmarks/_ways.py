"""The ways benchmarks/throughput.py trains one Llama, each stepped one step at a time.

A `Stepper` runs step k (1-based) of its way and returns (seconds, loss): mesh3d's own run
(`mesh3d.train.run.Run`: `Run.prepare` / `run.step`), or a plain training loop over a model given by the
caller (mesh3d's single-device `Llama`, or transformers' `LlamaForCausalLM` with the same
weights). The shapes and config overrides of each benchmark mode are here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mesh3d.config import global_batch_size
from mesh3d.data.build import build_dataset
from mesh3d.data.dummy import microbatches
from mesh3d.models.init import init_weights
from mesh3d.models.llama import Llama
from mesh3d.train.run import Run

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes/configs/cpu_tiny.yaml"
MC = "model.model_config"
# name -> (hidden, ffn, layers, heads, kv heads, vocab, seq, micro batch, accumulation)
SHAPES = {
    "quick": (512, 1376, 4, 8, 4, 4096, 256, 2, 2),
    "tiny": (64, 176, 2, 4, 2, 256, 32, 2, 2),
    "peer": (256, 1024, 4, 4, 2, 512, 128, 4, 8),  # the shape peers' 3D numbers use
    "peer_tiny": (64, 176, 2, 4, 2, 256, 32, 2, 4),
}
COMMON = ["logging.log_level=warning", "mesh3d.device=cpu", "mesh3d.dummy_data=random",
          "mesh3d.wandb=false", "model.dtype=float32", "model.make_vocab_size_divisible_by=1",
          "optimizer.learning_rate_scheduler.lr_warmup_steps=1"]  # fmt: skip

Batches = list[tuple[torch.Tensor, torch.Tensor]]
# A way to train, one step at a time: step k (1-based) -> (seconds, loss).
Stepper = Callable[[int], tuple[float, float]]


def shape_overrides(mode: str) -> list[str]:
    """Config overrides for the model and batch shape of `mode` at dp=tp=pp=1."""
    h, ffn, layers, heads, kv, vocab, seq, mbs, acc = SHAPES[mode]
    return [f"{MC}.hidden_size={h}", f"{MC}.intermediate_size={ffn}",
            f"{MC}.num_hidden_layers={layers}", f"{MC}.num_attention_heads={heads}",
            f"{MC}.num_key_value_heads={kv}", f"{MC}.vocab_size={vocab}",
            f"{MC}.max_position_embeddings={seq}", f"tokens.sequence_length={seq}",
            f"tokens.micro_batch_size={mbs}", f"tokens.batch_accumulation_per_replica={acc}"]  # fmt: skip


def torchrun_train(ranks: int, overrides: list[str], threads: int = 1,
                   script: Path = ROOT / "recipes/train.py") -> tuple[list[dict], float]:  # fmt: skip
    """Train `CONFIG` + `overrides` with `script` (`recipes/train.py`) on `ranks` torchrun ranks
    of `threads` intra-op threads each: (the metrics record of every step, wall seconds of the
    whole run)."""
    with tempfile.TemporaryDirectory(prefix="mesh3d-throughput-") as tmp:
        metrics_file = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", str(script), "--config-file",
               str(CONFIG), "--metrics-file", str(metrics_file), *overrides]  # fmt: skip
        t0 = time.time()
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(
                f"{ranks}-rank run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        return [json.loads(line) for line in metrics_file.read_text().splitlines()], wall


def mesh3d_stepper(cfg) -> Stepper:
    """mesh3d's run for `cfg`, stepped as its training loop steps it."""
    run = Run.prepare(cfg)

    def step(k: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = run.step(k).loss
        return time.perf_counter() - t0, loss

    return step


def plain_model(cfg) -> Llama:
    """The model mesh3d trains, built and initialized the single-device way (same weights)."""
    mc = cfg.model.model_config
    model = Llama(mc, vocab_size=mc.vocab_size, attention=cfg.mesh3d.attention)
    init = cfg.model.init_method
    init_weights(model, init.std, mc.num_hidden_layers, getattr(init, "scaling_method",
                 "NUM_LAYERS"), seed=cfg.general.seed)  # fmt: skip
    return model


def hf_model(cfg, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with the same config and weights (SDPA, fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mesh3d.models.llama_spec import LLAMA

    hf_dict = LLAMA.hf[0].config_to_hf(cfg.model.model_config, "float32")
    hf_cfg = LlamaConfig(**hf_dict, attn_implementation="sdpa")
    model = LlamaForCausalLM(hf_cfg).float()
    renamed = {k if k == "lm_head.weight" else f"model.{k}": v for k, v in weights.items()}
    model.load_state_dict(renamed, strict=True)
    return model


def loop_stepper(
    model: torch.nn.Module,
    logits_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    cfg,
    steps: list[Batches],
) -> Stepper:
    """A plain training loop over `model`, the batches of step k being `steps[k - 1]`."""
    o, f = cfg.optimizer, cfg.optimizer.optimizer_factory
    lr = o.learning_rate_scheduler.learning_rate
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(f.adam_beta1, f.adam_beta2),
                                  eps=f.adam_eps, weight_decay=o.weight_decay,
                                  fused=bool(f.torch_adam_is_fused) or None)  # fmt: skip
    vocab = cfg.model.model_config.vocab_size
    tokens = global_batch_size(cfg) * cfg.tokens.sequence_length
    model.train()

    def step(k: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        total = torch.zeros(())
        for inputs, labels in steps[k - 1]:
            logits = logits_of(model, inputs)  # (B, S, V)
            loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum")
            loss = loss / tokens  # this microbatch's share of the step's mean token loss
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, float(total)

    return step


def step_batches(cfg, n: int) -> list[Batches]:
    """The microbatches mesh3d reads at steps 1..n (same dataset, same samples)."""
    data, gbs = build_dataset(cfg, 0), global_batch_size(cfg)
    return [microbatches(data, s, gbs, 0, 1, cfg.tokens.micro_batch_size) for s in range(1, n + 1)]


def steppers(cfg, steps: list[Batches], compiled_cfg=None) -> dict[str, Stepper]:
    """name -> a fresh way to train `cfg` (models built and initialized here, not timed).

    With `compiled_cfg` (`cfg` with `mesh3d.compile: true`) two more: mesh3d's run of it, which
    compiles each layer's blocks, and transformers' model compiled whole (`model.compile()`, as
    `torch_compile=True` in HF's Trainer does). Both compile in their first step.
    """
    weights = plain_model(cfg).state_dict()
    plain = plain_model(cfg)

    def hf_stepper(compiled: bool) -> Stepper:
        hf = hf_model(cfg, weights)
        if compiled:
            hf.compile()
        return loop_stepper(hf, lambda m, x: m(input_ids=x, use_cache=False).logits, cfg, steps)

    ways = {
        "mesh3d": mesh3d_stepper(cfg),
        "plain": loop_stepper(plain, lambda m, x: m(x), cfg, steps),
        "transformers": hf_stepper(compiled=False),
    }
    if compiled_cfg is not None:
        assert compiled_cfg.mesh3d.compile
        ways["mesh3d_compiled"] = mesh3d_stepper(compiled_cfg)
        ways["transformers_compiled"] = hf_stepper(compiled=True)
    return ways
